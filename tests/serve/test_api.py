"""The OpenAI-compatible surface of `teamrl serve`: models, the team's and each agent's chat completions,
streaming, batching, health and metrics (in-process, FastAPI's TestClient)."""

from __future__ import annotations

import json
import threading

DIGITS_ITEM = '{"target": 9}'
"""A digit_sum item as a team request's content: the task takes a target, not text."""


def _chat(client, model: str, content: str, **fields):
    return client.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": content}],
                                                     **fields})


def _events(response) -> list:
    """The data of a Server-Sent Events body, '[DONE]' as a string."""
    data = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def test_models_lists_the_team_and_each_agent(digits_served, serve_client):
    client = serve_client(digits_served)
    listing = client.get("/v1/models").json()
    assert listing["object"] == "list"
    # Each agent also under its bare name: what a program trained by teamrl calls it by.
    assert [model["id"] for model in listing["data"]] == ["digits", "digits/first", "digits/second", "first", "second"]
    assert client.get("/health").json() == {"status": "ok", "model": "digits", "agents": ["first", "second"]}


def test_the_team_answers_with_each_agents_part_and_the_parts_joined(digits_served, serve_client):
    client = serve_client(digits_served)
    response = _chat(client, "digits", DIGITS_ITEM)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "digits" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    parts = message["agent_outputs"]
    assert list(parts) == ["first", "second"]
    # digit_sum names no outputs: the parts are joined with a blank line, in seat order.
    assert message["content"] == f"{parts['first']}\n\n{parts['second']}"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 2 * 4  # two agents, max_new_tokens=4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_the_team_reads_each_agents_observation_from_the_task(digits_served):
    # What the agents see is the task's observation of the item, not the raw message.
    item = digits_served.item(DIGITS_ITEM, "req-1")
    assert item == {"id": "req-1", "target": 9}
    assert digits_served.observations(item) == digits_served.env.observe({"target": 9})
    assert digits_served.item("plain words", "req-2") == {"id": "req-2", "text": "plain words"}
    assert digits_served.item("{not json", "req-3") == {"id": "req-3", "text": "{not json"}


def test_a_task_that_names_its_outputs_heads_each_part_with_its_name(tldr_served, serve_client):
    client = serve_client(tldr_served)
    body = _chat(client, "tldr", "We propose a method that learns summaries.").json()
    parts = body["choices"][0]["message"]["agent_outputs"]
    assert body["choices"][0]["message"]["content"] == (f"## one-sentence summary\n\n{parts['first']}\n\n"
                                                        f"## detailed summary\n\n{parts['second']}")


def test_an_agent_alone_answers_a_chat_with_its_own_system_prompt_unless_given_one(digits_served, serve_client):
    client = serve_client(digits_served)
    agent = digits_served.team[1]
    messages = [{"role": "user", "content": "target 9 second"}]
    assert digits_served.chat_prompt(agent, messages) == f"{agent.system_prompt}\n\ntarget 9 second"  # no template
    own = [{"role": "system", "content": "You write digits."}, *messages]
    assert digits_served.chat_prompt(agent, own) == "You write digits.\n\ntarget 9 second"
    body = client.post("/v1/chat/completions", json={"model": "digits/second", "messages": messages,
                                                     "max_tokens": 2}).json()
    assert body["model"] == "digits/second"
    assert "agent_outputs" not in body["choices"][0]["message"]
    assert 0 < body["usage"]["completion_tokens"] <= 2  # max_tokens honoured


def test_max_tokens_is_capped_by_the_agents_own_and_temperature_zero_and_seed_repeat(digits_served, serve_client):
    client = serve_client(digits_served)
    capped = _chat(client, "digits/first", "target 9 first", max_tokens=1000).json()
    assert capped["usage"]["completion_tokens"] <= 4
    greedy = [_chat(client, "digits", DIGITS_ITEM, temperature=0).json()["choices"][0]["message"]["content"]
              for _ in range(2)]
    assert greedy[0] == greedy[1]
    seeded = [_chat(client, "digits", DIGITS_ITEM, seed=7, temperature=1.5).json()["choices"][0]["message"]["content"]
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_a_stream_sends_openai_chunks_whose_contents_add_up_to_the_answer(digits_served, serve_client):
    client = serve_client(digits_served)
    response = _chat(client, "digits", DIGITS_ITEM, stream=True, stream_options={"include_usage": True}, seed=3)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["model"] == "digits" for chunk in chunks)
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    parts = [chunk["choices"][0]["delta"] for chunk in chunks[1:3]]
    assert [part["agent"] for part in parts] == ["first", "second"]  # each agent's part, once it is generated
    assert chunks[3]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] > 0
    whole = _chat(client, "digits", DIGITS_ITEM, seed=3).json()["choices"][0]["message"]
    assert "".join(part["content"] for part in parts) == whole["content"]
    alone = _events(_chat(client, "digits/first", "target 9 first", stream=True))
    assert alone[-1] == "[DONE]" and "content" in alone[1]["choices"][0]["delta"]


def test_requests_arriving_together_share_one_generate_call_and_a_zero_window_batches_nothing(tldr_served,
                                                                                             serve_client):
    for window_ms, most in ((1000, 4), (0, 1)):
        client = serve_client(tldr_served, batch_window_ms=window_ms)
        statuses = []

        def ask(client, text: str, statuses: list) -> None:
            statuses.append(_chat(client, "tldr", text).status_code)

        threads = [threading.Thread(target=ask, args=(client, f"We study case {i}.", statuses)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert statuses == [200] * 4
        batching = client.get("/metrics").json()["batching"]
        # The two LoRA agents share a base: one generate call serves every request's both agents.
        assert batching["largest_call"] == most, batching
        assert batching["generate_calls"] == (1 if most == 4 else 4), batching


def test_metrics_count_requests_errors_latency_and_tokens(digits_served, serve_client):
    client = serve_client(digits_served)
    assert _chat(client, "digits", DIGITS_ITEM).status_code == 200
    assert _chat(client, "nobody", DIGITS_ITEM).status_code == 404
    metrics = client.get("/metrics").json()
    assert metrics["requests"]["total"] == 2 and metrics["requests"]["errors"] == 1
    assert metrics["requests"]["by_status"] == {"200": 1, "404": 1} and metrics["requests"]["in_flight"] == 0
    assert metrics["latency_seconds"]["count"] == 1 and metrics["latency_seconds"]["p99"] > 0
    assert metrics["tokens"]["completion"] > 0 and metrics["tokens"]["completion_per_generate_second"] > 0
    text = client.get("/metrics", params={"format": "prometheus"}).text
    assert 'teamrl_requests_total{status="404"} 1' in text and 'teamrl_latency_seconds{quantile="0.99"}' in text


def test_max_new_tokens_replaces_every_agents_own_cap(digits_team_dir):
    from teamrl.serve.engine import ServedTeam

    served = ServedTeam.load(digits_team_dir, max_new_tokens=9, name="renamed")
    assert [agent.sampling.max_new_tokens for agent in served.team] == [9, 9]
    assert served.model_ids() == ["renamed", "renamed/first", "renamed/second", "first", "second"]
    assert served.sampling(served.team[0], max_tokens=50, temperature=0, top_p=None).max_new_tokens == 9


def test_a_draining_server_refuses_new_requests_with_503(digits_served, serve_client):
    client = serve_client(digits_served)
    client.app.state.draining = True  # what SIGTERM sets (tests/serve/test_server.py runs the real signal)
    response = _chat(client, "digits", DIGITS_ITEM)
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
    assert client.get("/health").status_code == 503
