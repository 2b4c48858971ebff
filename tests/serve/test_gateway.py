"""The gateway a program task's episodes call during training: teamrl serve's app in-process on 127.0.0.1, each
episode at its own URL, every call's exact tokens recorded in its episode, refusals in OpenAI's error shape and in
the episode's faults."""

from __future__ import annotations

import json

import pytest
import torch

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.rollout.episodes import ProgramEpisode
from teamrl.rollout.generate import encode_prompts

openai = pytest.importorskip("openai")

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")
"""A chat template for the tiny word-level tokenizer (its words: the roles, the contents, its end token)."""


@pytest.fixture
def gateway(lora_team, tmp_path):
    """A started gateway over a tiny LoRA team (agents 'first' and 'second'), for a program task of three items."""
    from teamrl.envs.program import ProgramTask
    from teamrl.serve.gateway import Gateway

    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"id": f"i{n}", "text": "3 4 5"}) + "\n" for n in range(3)))
    task = ProgramTask(program=lambda item, base_url: 0.0, data=str(data), eval_split=1, agents=["first", "second"])
    with Gateway(lora_team(), task) as running:
        yield running


def _client(gateway, episode):
    return openai.OpenAI(base_url=gateway.open(episode), api_key="-", max_retries=0, timeout=60)


def test_each_episode_records_exactly_what_its_own_calls_sampled(gateway):
    a, b = ProgramEpisode("a", {"id": "i0"}, seed=1), ProgramEpisode("b", {"id": "i1"}, seed=2)
    client_a, client_b = _client(gateway, a), _client(gateway, b)
    chat = client_a.chat.completions.create(model="first", messages=[{"role": "user", "content": "3 4 5"}])
    # A program's temperature is the served team's business; while training, every agent samples as it is trained.
    two = client_b.chat.completions.create(model="second", messages=[{"role": "user", "content": "6 7"}], n=2,
                                           temperature=0.2)
    ids = [5, 6, 7]
    raw = client_a.completions.create(model="second", prompt=ids, max_tokens=3)
    assert [call.agent for call in a.calls] == [0, 1] and [call.agent for call in b.calls] == [1, 1]
    assert [call.completion.text for call in a.calls] == [chat.choices[0].message.content, raw.choices[0].text]
    assert [call.completion.text for call in b.calls] == [choice.message.content for choice in two.choices]
    assert a.calls[1].completion.prompt_ids == ids and len(a.calls[1].completion.completion_ids) <= 3
    assert b.calls[0].completion.completion_ids != b.calls[1].completion.completion_ids  # two draws, not one twice
    team = gateway.served.team
    for call in a.calls + b.calls:
        agent = team[call.agent]
        agent.activate()
        prompt, tokens = torch.tensor([call.completion.prompt_ids]), torch.tensor([call.completion.completion_ids])
        with torch.no_grad():
            trained = token_logprobs(agent.model, prompt, torch.ones_like(prompt), tokens, torch.ones_like(tokens),
                                     temperature=agent.sampling.temperature)[0]
        torch.testing.assert_close(trained, torch.tensor(call.completion.logprobs), atol=1e-4, rtol=0)


def test_a_chat_of_the_agents_role_and_an_observation_is_prompted_token_for_token_as_in_training(gateway):
    agent = gateway.served.team[0]
    agent.tokenizer.chat_template = TEMPLATE
    agent.system_prompt = "you add digits"
    try:
        episode = ProgramEpisode("c", {"id": "i0"}, seed=3)
        _client(gateway, episode).chat.completions.create(
            model="first",
            messages=[{"role": "system", "content": "you add digits"}, {"role": "user", "content": "4 5"}])
        ids, mask = encode_prompts(agent, [agent.prompt("4 5")])
        assert episode.calls[0].completion.prompt_ids == ids[0][mask[0].bool()].tolist()
    finally:
        agent.tokenizer.chat_template, agent.system_prompt = None, None


def test_an_unknown_model_is_openais_404_and_a_fault_of_the_episode(gateway):
    episode = ProgramEpisode("d", {"id": "i0"}, seed=4)
    with pytest.raises(openai.NotFoundError) as missing:
        _client(gateway, episode).chat.completions.create(model="planner", messages=[{"role": "user", "content": "3"}])
    error = missing.value.body
    assert (error["code"], error["type"], error["param"]) == ("model_not_found", "invalid_request_error", "model")
    assert episode.faults == ["called model 'planner', which is no agent of this team (first, second)"]
    assert episode.calls == []


def test_a_prompt_over_the_context_is_a_400_and_a_fault_and_an_ended_episode_a_404(gateway):
    episode = ProgramEpisode("e", {"id": "i0"}, seed=5)
    client = _client(gateway, episode)
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model="first", messages=[{"role": "user", "content": "3 " * 400}])
    assert long.value.body["code"] == "context_length_exceeded"
    assert "exceeds the model's context" in episode.faults[0]
    gateway.close(episode)
    with pytest.raises(openai.NotFoundError, match="has ended"):
        client.chat.completions.create(model="first", messages=[{"role": "user", "content": "3"}])


def test_a_streamed_call_of_an_episode_is_recorded_and_streamed_whole(gateway):
    episode = ProgramEpisode("s", {"id": "i0"}, seed=6)
    chunks = _client(gateway, episode).chat.completions.create(
        model="second", messages=[{"role": "user", "content": "3 4"}], stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert [call.agent for call in episode.calls] == [1] and episode.calls[0].completion.text == text
