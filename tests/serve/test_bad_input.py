"""Every bad request gets a 4xx in OpenAI's error shape with a one-line message that says what to change."""

from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
DIGITS_ITEM = '{"target": 9}'


def _error(response, status: int, code: str | None = None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert code is None or error["code"] == code, error
    assert error["message"] and "\n" not in error["message"]
    return error["message"]


@pytest.mark.parametrize("body, says", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "missing field 'model'"),
    (b'{"model": "digits"}', "missing field 'messages'"),
    (b'{"model": "digits", "messages": []}', "missing field 'messages'"),
    (b'{"model": "digits", "messages": [{"content": "hi"}]}', "messages[0]: each message needs 'role' and 'content'"),
    (b'{"model": "digits", "messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role: 'robot'"),
    (b'{"model": "digits", "messages": [{"role": "user", "content": 3}]}', "messages[0].content: must be a string"),
    (b'{"model": "digits", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}',
     "max_tokens must be >= 1"),
    (b'{"model": "digits", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
     "temperature must be a number"),
    (b'{"model": "digits", "messages": [{"role": "user", "content": "hi"}], "n": 2}', "n=2: this server returns one"),
    (b'{"model": "digits", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\n"]}', "stop sequences"),
    (b'{"model": "digits", "messages": [{"role": "system", "content": "hi"}]}', "there is none"),
])
def test_malformed_json_and_missing_or_wrong_fields_get_400_naming_them(digits_served, serve_client, body, says):
    client = serve_client(digits_served)
    response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert says in _error(response, 400)


def test_an_input_the_task_cannot_read_gets_400_saying_what_it_takes(digits_served, serve_client):
    client = serve_client(digits_served)
    message = _error(client.post(CHAT, json={"model": "digits", "messages": [{"role": "user", "content": "hi"}]}), 400)
    assert "DigitSumGame needs items with the field 'target'" in message and '{"target": 9}' in message


def test_an_unknown_model_gets_404_listing_the_models(digits_served, serve_client):
    client = serve_client(digits_served)
    for model in ("gpt-4o", "digits/third", "other/first"):
        response = client.post(CHAT, json={"model": model, "messages": [{"role": "user", "content": DIGITS_ITEM}]})
        assert "digits, digits/first, digits/second" in _error(response, 404, "model_not_found")
    assert "no route GET /v2/models" in _error(client.get("/v2/models"), 404)
    assert "GET is not allowed" in _error(client.get(CHAT), 405)


def test_an_input_longer_than_the_context_gets_400_naming_the_limit(tldr_served, serve_client, caplog):
    import gc
    import logging

    client = serve_client(tldr_served)
    long_text = "word " * 2_000
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for model, stream in (("tldr", False), ("tldr/first", False), ("tldr", True)):
            response = client.post(CHAT, json={"model": model, "stream": stream,
                                               "messages": [{"role": "user", "content": long_text}]})
            message = _error(response, 400, "context_length_exceeded")  # a stream too: refused before it starts
            assert "context of 256 tokens" in message and "shorten the input by about" in message
        # the server goes on answering
        ok = client.post(CHAT, json={"model": "tldr", "messages": [{"role": "user", "content": "A short text."}]})
        assert ok.status_code == 200
        gc.collect()  # asyncio logs an exception nobody read when its future is collected
    assert not [record.getMessage() for record in caplog.records], "an error was left unread in a future"


def test_an_oversized_body_gets_413_before_it_is_read(digits_served, serve_client):
    client = serve_client(digits_served, max_body_bytes=1_000)
    big = {"model": "digits", "messages": [{"role": "user", "content": "x" * 2_000}]}
    assert "limit of 1,000 bytes" in _error(client.post(CHAT, json=big), 413, "request_too_large")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 200

    response = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "limit of 1,000 bytes" in _error(response, 413, "request_too_large")


def test_a_missing_or_wrong_api_key_gets_401_and_health_needs_none(digits_served, serve_client):
    client = serve_client(digits_served, api_key="sesame")
    request = {"model": "digits", "messages": [{"role": "user", "content": DIGITS_ITEM}]}
    assert "missing API key" in _error(client.post(CHAT, json=request), 401, "invalid_api_key")
    wrong = client.post(CHAT, json=request, headers={"Authorization": "Bearer open"})
    assert _error(wrong, 401, "invalid_api_key") == "wrong API key"
    assert wrong.headers["www-authenticate"] == "Bearer"
    _error(client.get("/v1/models"), 401, "invalid_api_key")
    _error(client.get("/metrics"), 401, "invalid_api_key")
    assert client.get("/health").status_code == 200
    assert client.post(CHAT, json=request, headers={"Authorization": "Bearer sesame"}).status_code == 200
