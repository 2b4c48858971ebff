"""A real server: the official `openai` client against uvicorn on 127.0.0.1, clients that disconnect, and SIGTERM
on a `teamrl serve` process with a request in flight."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

DIGITS_ITEM = '{"target": 9}'


def test_the_official_openai_client_talks_to_the_server(digits_served, live_server):
    openai = pytest.importorskip("openai")
    url, _ = live_server(digits_served, api_key="sesame")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=60)
    assert [model.id for model in client.models.list()] == ["digits", "digits/first", "digits/second", "first",
                                                            "second"]

    answer = client.chat.completions.create(model="digits", messages=[{"role": "user", "content": DIGITS_ITEM}],
                                            seed=1)
    parts = answer.choices[0].message.model_extra["agent_outputs"]
    assert answer.choices[0].message.content == f"{parts['first']}\n\n{parts['second']}"
    assert answer.usage.completion_tokens > 0

    stream = client.chat.completions.create(model="digits", messages=[{"role": "user", "content": DIGITS_ITEM}],
                                            seed=1, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == \
        answer.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens

    alone = client.chat.completions.create(model="digits/first", messages=[{"role": "user", "content": "target 9"}],
                                           max_tokens=2)
    assert alone.model == "digits/first" and alone.usage.completion_tokens <= 2

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist") as missing:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": DIGITS_ITEM}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="context of 256 tokens"):
        client.chat.completions.create(model="digits/first", messages=[{"role": "user", "content": "9 " * 400}])


def _send_chat(url: str, request: dict) -> socket.socket:
    """A raw connection that has sent a chat completion request (so that the test can hang up on it)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(request).encode()
    connection = socket.create_connection((host, int(port)), timeout=10)
    connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return connection


def _metrics(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return json.load(response)


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_client_that_disconnects_while_queued_is_dropped_before_it_generates(digits_served, live_server):
    url, _ = live_server(digits_served, batch_window_ms=1500)  # the request waits in the batching window
    connection = _send_chat(url, {"model": "digits", "messages": [{"role": "user", "content": DIGITS_ITEM}]})
    time.sleep(0.3)
    connection.close()
    _wait_for(lambda: _metrics(url)["cancelled"]["before_generation"] == 1)
    metrics = _metrics(url)
    assert metrics["batching"]["generate_calls"] == 0  # nothing ran for it
    assert metrics["requests"]["in_flight"] == 0 and metrics["requests"]["queued"] == 0
    assert metrics["requests"]["by_status"] == {"499": 1}


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_mid_generation_stops_the_call(digits_served, live_server, monkeypatch, stream):
    import teamrl.rollout.generate as generate_module

    real_generate_team = generate_module.generate_team
    generating, stopped = threading.Event(), []

    def slow_generate_team(team, prompts, num_samples, **options):
        # A generation that lasts until the server asks it to stop (or 10 s): the tiny model alone takes milliseconds.
        generating.set()
        deadline = time.monotonic() + 10
        while not options["should_stop"]() and time.monotonic() < deadline:
            time.sleep(0.01)
        stopped.append(options["should_stop"]())
        return real_generate_team(team, prompts, num_samples, **options)

    monkeypatch.setattr(generate_module, "generate_team", slow_generate_team)
    url, _ = live_server(digits_served, batch_window_ms=0)
    connection = _send_chat(url, {"model": "digits", "stream": stream,
                                  "messages": [{"role": "user", "content": DIGITS_ITEM}]})
    assert generating.wait(10)
    if stream:
        assert connection.recv(4096).startswith(b"HTTP/1.1 200")  # the stream has started
    connection.close()
    _wait_for(lambda: _metrics(url)["cancelled"]["during_generation"] == 1)
    assert stopped == [True]
    metrics = _metrics(url)
    assert metrics["requests"]["in_flight"] == 0 and metrics["requests"]["queued"] == 0
    monkeypatch.setattr(generate_module, "generate_team", real_generate_team)
    request = urllib.request.Request(f"{url}/v1/chat/completions", method="POST", data=json.dumps(
        {"model": "digits", "messages": [{"role": "user", "content": DIGITS_ITEM}]}).encode())
    with urllib.request.urlopen(request, timeout=30) as response:  # and the server goes on answering
        assert response.status == 200


def test_generate_ends_the_call_after_the_step_at_which_should_stop_says_so(lora_team):
    from teamrl.rollout.generate import generate_team

    team = lora_team()
    prompts = [[agent.prompt("target 9 first")] * 2 for agent in team]
    steps = []

    def should_stop() -> bool:
        steps.append(1)
        return len(steps) >= 2

    generations = generate_team(team, prompts, 1, should_stop=should_stop)  # both agents in one call (one base)
    assert len(steps) == 2
    assert all(generation.completion_ids.shape[1] == 2 for generation in generations)


def test_sigterm_lets_the_request_in_flight_finish_refuses_new_ones_and_exits_0(digits_team_dir):
    command = [sys.executable, "-m", "teamrl.cli", "serve", str(digits_team_dir), "--port", "0", "--threads", "1",
               "--batch-window-ms", "1500"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([server.stdout], [], [], 120)
        assert ready, "the server printed nothing in 120 s"
        line = server.stdout.readline()
        names = "digits, digits/first, digits/second, first, second"
        assert line.startswith(f"teamrl serve: {names} on http://127.0.0.1:"), line
        url = line.split(" on ")[1].strip().removesuffix("/v1")
        answers = []

        def ask() -> None:
            request = urllib.request.Request(f"{url}/v1/chat/completions", method="POST", data=json.dumps(
                {"model": "digits", "messages": [{"role": "user", "content": DIGITS_ITEM}]}).encode())
            with urllib.request.urlopen(request, timeout=60) as response:
                answers.append((response.status, json.load(response)))

        in_flight = threading.Thread(target=ask)
        in_flight.start()
        _wait_for(lambda: _metrics(url)["requests"]["in_flight"] == 1)  # held in the 1.5 s batching window
        server.send_signal(signal.SIGTERM)
        _wait_for(lambda: _refused(url))
        in_flight.join(60)
        assert answers and answers[0][0] == 200 and answers[0][1]["choices"][0]["message"]["content"]
        assert server.wait(60) == 0, server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _refused(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/health", timeout=5)
    except urllib.error.HTTPError as err:
        return err.code == 503  # a connection the server still had open: refused by status
    except (urllib.error.URLError, ConnectionError):
        return True
    return False
