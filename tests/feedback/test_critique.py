"""The critique client against a tiny OpenAI-compatible server on 127.0.0.1, and the coding environments'
fallback to static feedback when the critique fails."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from teamrl.envs import Step, make_env
from teamrl.feedback.critique import CritiqueClient, CritiqueConfig, CritiqueError, parse_chat_completion


def _completion(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}).encode()


class _Server(ThreadingHTTPServer):
    """Answers each POST with the next scripted ``(status, body, delay_s)`` and records the requests."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script: list[tuple[int, bytes, float]] = []
        self.requests: list[dict] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def handle_error(self, request, client_address):  # a client that timed out hung up: expected here
        pass


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append({"path": self.path, "headers": dict(self.headers), "json": json.loads(body)})
        status, answer, delay = self.server.script.pop(0)
        time.sleep(delay)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = _Server()
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def _client(server, **overrides) -> CritiqueClient:
    return CritiqueClient(CritiqueConfig(**{"base_url": server.url, "model": "critic", "timeout_s": 2.0,
                                            "backoff_s": 0.01, **overrides}))


def test_success_sends_an_openai_chat_request_with_the_key(server, monkeypatch):
    monkeypatch.setenv("TEAMRL_TEST_KEY", "sk-test")
    server.script.append((200, _completion("  aux never returns; return the sorted list.  "), 0.0))
    text = _client(server, api_key_env="TEAMRL_TEST_KEY", max_chars=20).critique(
        "Sort numbers.", "def aux(xs):\n    xs.sort()\n", "1 of 2 tests failed")
    assert text == "aux never returns; r"  # stripped, then cut to max_chars
    (request,) = server.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer sk-test"
    assert request["json"]["model"] == "critic"
    system, user = request["json"]["messages"]
    assert system["role"] == "system" and user["role"] == "user"
    for part in ("Sort numbers.", "xs.sort()", "1 of 2 tests failed"):
        assert part in user["content"]


def test_timeout_gives_none_and_a_warning(server, caplog):
    server.script.append((200, _completion("too late"), 1.0))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert _client(server, timeout_s=0.2, max_retries=0).critique("p", "code", "checks") is None
    assert time.monotonic() - started < 0.9
    assert "critique model 'critic' failed" in caplog.text


def test_server_error_is_retried_with_backoff(server):
    server.script += [(500, b'{"error": "overloaded"}', 0.0), (503, b"", 0.0), (200, _completion("fine now"), 0.0)]
    assert _client(server, max_retries=2).critique("p", "code", "checks") == "fine now"
    assert len(server.requests) == 3


def test_client_errors_and_exhausted_retries_are_not_retried_further(server, caplog):
    server.script += [(401, b'{"error": "bad key"}', 0.0)]
    with caplog.at_level(logging.WARNING):
        assert _client(server, max_retries=3).critique("p", "code", "checks") is None
    assert len(server.requests) == 1 and "HTTP 401" in caplog.text
    server.script += [(500, b"", 0.0)] * 2
    assert _client(server, max_retries=1).critique("p", "code", "checks") is None
    assert len(server.requests) == 3


@pytest.mark.parametrize("body", [b"<html>not json</html>", b'{"choices": []}',
                                  b'{"choices": [{"message": {"content": ""}}]}', b'[1, 2]'])
def test_garbage_answers_raise_a_critique_error(body):
    with pytest.raises(CritiqueError, match="chat completion"):
        parse_chat_completion(body)


def test_configuration_errors_are_raised_at_once(monkeypatch):
    monkeypatch.delenv("TEAMRL_MISSING_KEY", raising=False)
    with pytest.raises(ValueError, match="TEAMRL_MISSING_KEY.*not set"):
        CritiqueClient(CritiqueConfig(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="TEAMRL_MISSING_KEY"))
    with pytest.raises(ValueError, match=r"critique: unknown field\(s\) \['url'\]"):
        CritiqueConfig.from_dict({"url": "http://x", "model": "m"})
    with pytest.raises(ValueError, match="critique.base_url"):
        CritiqueConfig(base_url="localhost:8000", model="m")
    with pytest.raises(ValueError, match="env.kwargs.critique: missing required field"):
        make_env("humaneval", limit=2, eval_size=1, critique={"base_url": "http://127.0.0.1:1/v1"})


# ------------------------------------------------------------------------------------------------
# In the coding environments


def _second_turn(env):
    item = env.items("train")[0]
    actions = ("def aux(x):\n    return x +\n", "no code here")  # graded statically: no sandbox needed
    step = Step(tuple(env.observe(item)), actions, env.joint_reward(item, actions))
    return env.next_observations(item, [step])


def test_env_adds_the_critique_to_both_agents_feedback(server):
    server.script.append((200, _completion("Finish the expression in aux; main is missing."), 0.0))
    env = make_env("humaneval", limit=2, eval_size=1, critique={"base_url": server.url, "model": "critic"})
    observations = _second_turn(env)
    assert len(server.requests) == 1  # one critique per joint action, shared by both agents
    for observation in observations:
        assert "A reviewer's critique of the team's code:\nFinish the expression in aux;" in observation
    assert "SyntaxError at line 2" in server.requests[0]["json"]["messages"][1]["content"]


def test_env_falls_back_to_static_feedback_on_garbage(server, caplog):
    server.script.append((200, b"Internal proxy page, not JSON", 0.0))
    critiqued = make_env("humaneval", limit=2, eval_size=1,
                         critique={"base_url": server.url, "model": "critic", "max_retries": 0})
    with caplog.at_level(logging.WARNING):
        observations = _second_turn(critiqued)
    assert observations == _second_turn(make_env("humaneval", limit=2, eval_size=1))
    assert "using static feedback only" in caplog.text
    assert "SyntaxError at line 2, column" in observations[0]
