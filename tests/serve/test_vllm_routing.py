"""``teamrl serve --vllm-url``: the team router in front of a vLLM server, tested against a stand-in for vLLM's
OpenAI server (vLLM is not installed here and there is no GPU). The stand-in checks the request shape vLLM
requires, answers deterministically, and counts how many requests it has in flight at once."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi", reason="teamrl serve needs the serve extra (pip install 'teamrl[serve]')")

from fastapi import FastAPI, Request  # noqa: E402  (after the skip: FastAPI resolves the handler's annotations here)
from fastapi.responses import JSONResponse  # noqa: E402

STAND_IN_SECONDS = 0.3
"""How long the stand-in takes per request: a team's two requests overlap only when sent concurrently."""
BASE_GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "min_p": 0.05}
"""The sampling of the served folder's generation_config.json (Qwen2.5-3B-Instruct's, and a min_p): what vLLM's
server samples with where a request leaves a field out (its default_sampling_params, ``--generation-config auto``)."""
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0}


class StandInVLLM:
    """The state of a fake ``vllm serve BASE --enable-lora --lora-modules A=... B=...``."""

    def __init__(self, lora_names: list[str]):
        self.lora_names = lora_names
        self.received: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.delay = STAND_IN_SECONDS
        self.disconnected = 0
        """Requests whose client (teamrl) closed the connection before the answer: vLLM aborts those."""
        self.sampled_with: list[dict] = []
        """Each request's sampling as vLLM applies it: the request's field, else the generation config's, else
        vLLM's default (top_k -1 and 0 both mean off)."""

    def app(self):
        app = FastAPI()

        def invalid(message: str, status: int = 400) -> JSONResponse:
            return JSONResponse({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                                 "code": status}, status_code=status)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            if body.get("model") not in self.lora_names:
                return invalid(f"The model `{body.get('model')}` does not exist.", 404)
            prompt = body.get("prompt")
            if not isinstance(prompt, str) or not prompt:
                return invalid("prompt must be a non-empty string")
            max_tokens, temperature, top_p = body.get("max_tokens"), body.get("temperature"), body.get("top_p", 1.0)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                return invalid(f"max_tokens must be at least 1, got {max_tokens}.")
            if not isinstance(temperature, (int, float)) or temperature < 0:
                return invalid(f"temperature must be non-negative, got {temperature}.")
            if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
                return invalid(f"top_p must be in (0, 1], got {top_p}.")
            if not isinstance(body.get("stop_token_ids", []), list) or body.get("n", 1) != 1:
                return invalid("stop_token_ids must be a list and n 1")
            top_k = body.get("top_k", 0)
            if not isinstance(top_k, int) or top_k < -1:
                return invalid(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
            self.received.append(body)
            applied = {key: body[key] if body.get(key) is not None else BASE_GENERATION_CONFIG.get(key, default)
                       for key, default in VLLM_DEFAULTS.items()}
            self.sampled_with.append({**applied, "top_k": max(applied["top_k"], 0)})
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                deadline = time.monotonic() + self.delay
                while time.monotonic() < deadline:
                    if await request.is_disconnected():
                        self.disconnected += 1
                        return invalid("client gone", 499)
                    await asyncio.sleep(0.01)
            finally:
                self.in_flight -= 1
            text = f"{body['model']}: {' '.join(prompt.split()[:3])}"
            return {"id": "cmpl-stand-in", "object": "text_completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": 3,
                              "total_tokens": len(prompt.split()) + 3}}

        return app


@pytest.fixture
def stand_in(digits_served):
    """A StandInVLLM serving the digits team's agents on a free port of 127.0.0.1: (its /v1 URL, its state)."""
    import uvicorn

    from teamrl.serve.app import _listening_socket

    state = StandInVLLM([agent.name for agent in digits_served.team])
    listener = _listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(state.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stand-in did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1", state
    server.should_exit = True
    thread.join(10)
    assert not thread.is_alive(), "the stand-in did not stop"


def _team_request(served, **extra) -> dict:
    item = {**served.example_item, "id": "fixed"}  # a fixed id: the prompts are then known in advance
    return {"model": served.name, "messages": [{"role": "user", "content": json.dumps(item)}], **extra}


def _expected_prompts(served) -> list[str]:
    observations = served.observations({**served.example_item, "id": "fixed"})
    return [agent.prompt(observation) for agent, observation in zip(served.team, observations)]


def test_team_request_sends_each_agent_its_prompt_concurrently_and_joins_the_answers(digits_served, stand_in,
                                                                                      live_server):
    vllm_url, vllm = stand_in
    url, _ = live_server(digits_served, vllm_url=vllm_url)
    response = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                          json=_team_request(digits_served, max_tokens=10_000, temperature=0))
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    prompts = _expected_prompts(digits_served)
    by_agent = {body["model"]: body for body in vllm.received}
    assert sorted(by_agent) == sorted(agent.name for agent in digits_served.team)
    for agent, prompt in zip(digits_served.team, prompts):
        sent = by_agent[agent.name]
        assert sent["prompt"] == prompt  # exactly what the in-process path generates from
        assert sent["max_tokens"] == agent.sampling.max_new_tokens  # capped as in-process
        assert sent["temperature"] == 0.0
        assert message["agent_outputs"][agent.name] == f"{agent.name}: {' '.join(prompt.split()[:3])}"
    texts = [message["agent_outputs"][agent.name] for agent in digits_served.team]
    assert message["content"] == "".join(digits_served.joined(texts))
    assert vllm.most_in_flight == 2, "the agents' requests were not sent concurrently"
    assert response.json()["usage"]["completion_tokens"] == 6


def test_agent_request_and_stream(digits_served, stand_in, live_server):
    vllm_url, vllm = stand_in
    vllm.delay = 0.0
    url, _ = live_server(digits_served, vllm_url=vllm_url)
    second = digits_served.team[1]
    response = httpx.post(f"{url}/v1/chat/completions", timeout=10, json={
        "model": f"{digits_served.name}/{second.name}", "messages": [{"role": "user", "content": "hello there"}],
        "temperature": 0.5, "top_p": 0.9, "seed": 3})
    assert response.status_code == 200, response.text
    sent = vllm.received[-1]
    assert (sent["model"], sent["temperature"], sent["top_p"], sent["seed"]) == (second.name, 0.5, 0.9, 3)
    assert sent["prompt"] == digits_served.chat_prompt(second, [{"role": "user", "content": "hello there"}])
    assert response.json()["choices"][0]["message"]["content"].startswith(f"{second.name}: ")

    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=10,
                      json=_team_request(digits_served, stream=True)) as stream:
        assert stream.status_code == 200
        events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parts = [json.loads(event)["choices"][0]["delta"] for event in events[:-1]]
    agents = [delta["agent"] for delta in parts if "agent" in delta]
    assert agents == [agent.name for agent in digits_served.team]
    assert "".join(delta.get("content", "") for delta in parts).count(": ") >= 2


def test_vllm_down_is_a_502_and_too_slow_a_504(digits_served, stand_in, live_server):
    from teamrl.serve.app import _listening_socket

    with _listening_socket("127.0.0.1", 0) as probe:  # a port that was free a moment ago: nothing listens there
        free_port = probe.getsockname()[1]
    url, _ = live_server(digits_served, vllm_url=f"http://127.0.0.1:{free_port}/v1")
    for stream in (False, True):
        response = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                              json=_team_request(digits_served, stream=stream))
        assert response.status_code == 502, response.text
        error = response.json()["error"]
        assert error["code"] == "upstream_unreachable" and error["type"] == "server_error"
        assert f"127.0.0.1:{free_port}" in error["message"] and "\n" not in error["message"]

    vllm_url, vllm = stand_in
    vllm.delay = 1.0
    url, _ = live_server(digits_served, vllm_url=vllm_url, vllm_timeout_s=0.2)
    response = httpx.post(f"{url}/v1/chat/completions", timeout=10, json=_team_request(digits_served))
    assert response.status_code == 504, response.text
    assert response.json()["error"]["code"] == "upstream_timeout"

    vllm.delay = 0.0
    vllm.lora_names = ["someone-else"]  # vLLM's own 404: the adapters were registered under other names
    url, _ = live_server(digits_served, vllm_url=vllm_url)
    response = httpx.post(f"{url}/v1/chat/completions", timeout=10, json=_team_request(digits_served))
    assert response.status_code == 502, response.text
    assert "answered 404" in response.json()["error"]["message"]


def test_a_client_that_disconnects_closes_its_vllm_requests(digits_served, stand_in, live_server):
    vllm_url, vllm = stand_in
    vllm.delay = 5.0
    url, _ = live_server(digits_served, vllm_url=vllm_url)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(f"{url}/v1/chat/completions", timeout=0.5, json=_team_request(digits_served))
    deadline = time.monotonic() + 3
    while vllm.disconnected < 2 or vllm.in_flight:
        assert time.monotonic() < deadline, f"vLLM's requests were not closed ({vllm.disconnected} of 2)"
        time.sleep(0.02)
    while True:  # the job's task ends just after vLLM's connections close
        metrics = httpx.get(f"{url}/metrics", timeout=5).json()
        if metrics["requests"]["queued"] == 0:
            break
        assert time.monotonic() < deadline, "a job was left waiting on vLLM"
        time.sleep(0.02)
    assert metrics["cancelled"]["during_generation"] == 1


def test_when_every_agents_call_fails_each_error_is_read_and_the_first_answers(digits_served):
    import gc

    from teamrl.serve.engine import Job, RequestError
    from teamrl.serve.metrics import ServerMetrics
    from teamrl.serve.vllm_proxy import VLLMProxy

    backend = VLLMProxy(digits_served, ServerMetrics(), "http://127.0.0.1:9/v1")

    async def fail(client, job, index):
        await asyncio.sleep(0.01)  # both calls fail in the same turn of the loop: both are in `done`
        raise RequestError(f"agent {index} failed", status=502)

    backend._complete = fail

    async def run() -> tuple[BaseException, list[dict]]:
        loop = asyncio.get_running_loop()
        unread: list[dict] = []
        loop.set_exception_handler(lambda _, context: unread.append(context))
        # Which failed call a set yields first varies: ten jobs make a lucky order for all of them unlikely.
        for _ in range(10):
            error = await one_job(loop)
        gc.collect()  # an unread exception is reported when its future is collected
        return error, unread

    async def one_job(loop) -> BaseException:
        sampling = {i: agent.sampling for i, agent in enumerate(digits_served.team)}
        job = Job(prompts={0: "a", 1: "b"}, inputs={0: "a", 1: "b"}, sampling=sampling, seed=None, label="x",
                  future=loop.create_future(), accepted=loop.create_future(), loop=loop)
        await backend._answer(job)
        try:
            await asyncio.wait_for(job.future, 5)
        except RequestError as raised:
            return raised
        raise AssertionError("the job succeeded")

    error, unread = asyncio.run(run())
    assert str(error) == "agent 0 failed"
    assert not unread, f"asyncio reported errors nobody read: {unread}"


def test_vllm_samples_each_agent_as_it_was_trained_whatever_the_served_folder_says(digits_served, stand_in,
                                                                                   live_server):
    """vLLM fills every sampling field a request leaves out from the base folder's generation_config.json: teamrl
    sends them all, the ones it never applies (min_p, penalties) at their off values and top_k 0 as -1."""
    vllm_url, vllm = stand_in
    url, _ = live_server(digits_served, vllm_url=vllm_url)
    response = httpx.post(f"{url}/v1/chat/completions", timeout=10, json=_team_request(digits_served))
    assert response.status_code == 200, response.text
    by_agent = dict(zip((body["model"] for body in vllm.received), vllm.sampled_with))
    for agent in digits_served.team:
        assert agent.sampling.top_k == 0  # the trained sampling: no top-k, no min-p, no penalties
        assert by_agent[agent.name] == {**VLLM_DEFAULTS, "temperature": agent.sampling.temperature,
                                        "top_p": agent.sampling.top_p}


def test_a_call_that_fails_while_the_other_agent_generates_answers_at_once(digits_served):
    """The second agent's call fails while the first's is still running: the first is cancelled and the job
    gets the second's error (it used to read the cancelled call's result and leave the client waiting)."""
    from teamrl.serve.engine import Job, RequestError
    from teamrl.serve.metrics import ServerMetrics
    from teamrl.serve.vllm_proxy import VLLMProxy

    backend = VLLMProxy(digits_served, ServerMetrics(), "http://127.0.0.1:9/v1")
    cancelled = []

    async def one_slow_one_failing(client, job, index):
        if index == 1:
            raise RequestError("agent 1 failed", status=502)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(index)
            raise

    backend._complete = one_slow_one_failing

    async def run() -> BaseException:
        loop = asyncio.get_running_loop()
        sampling = {i: agent.sampling for i, agent in enumerate(digits_served.team)}
        job = Job(prompts={0: "a", 1: "b"}, inputs={0: "a", 1: "b"}, sampling=sampling, seed=None, label="x",
                  future=loop.create_future(), accepted=loop.create_future(), loop=loop)
        backend.submit(job)
        try:
            await asyncio.wait_for(job.future, 5)
        except RequestError as raised:
            return raised
        raise AssertionError("the job succeeded")

    error = asyncio.run(run())
    assert str(error) == "agent 1 failed" and error.status == 502
    assert cancelled == [0], "the other agent's vLLM request was not closed"
