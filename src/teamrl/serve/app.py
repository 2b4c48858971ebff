"""The HTTP API of ``teamrl serve``: OpenAI's chat completions for a team and for each of its agents.

* ``GET /v1/models``: the team (``TEAM``) and each agent (``TEAM/AGENT``).
* ``POST /v1/chat/completions``: with ``model: TEAM`` the last user message's content is the task's input
  (a JSON object: the item's fields; else the item ``{"id": request id, "text": content}``), each agent
  answers its own observation of it, concurrently, and the message content is the agents' parts joined
  (headed by the task's ``output_names`` when it has them), each agent's own part in
  ``message.agent_outputs``. With ``model: TEAM/AGENT`` that agent alone answers the chat. ``stream: true``
  sends Server-Sent Events in OpenAI's chunk format: the role once generation starts, then each agent's
  part as one chunk once the batch finishes (not token by token), then ``data: [DONE]``.
* ``GET /health`` (no API key needed), ``GET /metrics`` (JSON, or ``?format=prometheus``).

Errors have OpenAI's shape, ``{"error": {"message", "type", "code", "param"}}``, with one-line messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from teamrl.serve.engine import AgentAnswer, Batcher, Job, RequestError, ServedTeam
from teamrl.serve.metrics import ServerMetrics, prometheus_text
from teamrl.serve.vllm_proxy import VLLMProxy

logger = logging.getLogger("teamrl.serve")

DEFAULT_MAX_BODY_BYTES = 1_000_000
DISCONNECT_POLL_SECONDS = 0.05
"""How often a waiting non-streaming request checks that its client is still there."""
CLIENT_CLOSED_REQUEST = 499
"""The status (nginx's) a request whose client went away is counted under; nobody receives it."""
CHAT_PATH = "/v1/chat/completions"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class ChatRequest:
    """The fields of a chat completion request that the server honours, validated."""

    model: str
    messages: list[dict[str, str]]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None

    @classmethod
    def parse(cls, data: Any) -> ChatRequest:
        """Raises RequestError (400) naming the first field that is missing or wrong."""
        if not isinstance(data, dict):
            raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise RequestError("missing field 'model': the team's name or TEAM/AGENT (GET /v1/models lists them)",
                               param="model")
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("missing field 'messages': a non-empty list of {\"role\", \"content\"} objects",
                               param="messages")
        if data.get("n") not in (None, 1):
            raise RequestError(f"n={data['n']!r}: this server returns one choice per request; send n=1, or n "
                               f"requests (they are batched)", param="n")
        if data.get("stop") not in (None, "", []):
            raise RequestError("stop sequences are not supported; leave 'stop' out", param="stop")
        stream_options = data.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", param="stream_options")
        max_tokens = _number(data, "max_completion_tokens", int, 1) or _number(data, "max_tokens", int, 1)
        return cls(
            model=model,
            messages=[_message(message, index) for index, message in enumerate(messages)],
            stream=_flag(data, "stream"),
            include_usage=_flag(stream_options, "include_usage"),
            max_tokens=max_tokens,
            temperature=_number(data, "temperature", float, 0.0, 2.0),
            top_p=_number(data, "top_p", float, 0.0, 1.0),
            seed=_number(data, "seed", int),
        )


def _message(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise RequestError(f"{where}: each message needs 'role' and 'content'", param=where)
    role = ROLES.get(message["role"])
    if role is None:
        raise RequestError(f"{where}.role: {message['role']!r} is not one of {', '.join(ROLES)}", param=where)
    content = message["content"]
    if isinstance(content, list):  # content parts: text ones only
        if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                   for part in content):
            raise RequestError(f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               f"supported", param=where)
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content: must be a string or a list of text parts", param=where)
    return {"role": role, "content": content}


def _flag(data: dict, name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _number(data: dict, name: str, kind: type, low: float | None = None, high: float | None = None):
    value = data.get(name)
    if value is None:
        return None
    allowed = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(f"{name} must be {bounds}, got {value!r}", param=name)
    return kind(value)


def error_response(status: int, message: str, *, error_type: str | None = None, code: str | None = None,
                   param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """OpenAI's error JSON."""
    error_type = error_type or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": error_type, "code": code, "param": param}},
                        status_code=status, headers=headers)


class _ClientGone(Exception):
    """The client of a request closed its connection before the answer was ready."""


def create_app(team: str | Path | ServedTeam, *, name: str | None = None, api_key: str | None = None,
               batch_window_ms: float = 10.0, max_batch: int = 32, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               device: str = "cpu", dtype: str = "float32", max_new_tokens: int | None = None,
               vllm_url: str | None = None, vllm_timeout_s: float = 300.0) -> FastAPI:
    """The FastAPI app serving ``team`` (a saved team's directory, RUN_DIR/team, or a loaded
    :class:`ServedTeam`).

    Args:
        name: the team's model id (default: the folder's name; its run's when the folder is called 'team').
        api_key: when given, every ``/v1`` route and ``/metrics`` need ``Authorization: Bearer API_KEY``.
        batch_window_ms: requests arriving within this many milliseconds of the oldest waiting one share one
            generate call per base model (0: each request alone).
        max_batch: at most this many requests in one generate call.
        max_body_bytes: larger request bodies get 413 before they are read.
        device, dtype: where and in what precision the models run.
        max_new_tokens: replaces every agent's own ``max_new_tokens`` (the most a request gets) when ``team``
            is a directory.
        vllm_url: generate on the vLLM server at this URL (e.g. http://127.0.0.1:8001/v1, serving one LoRA
            adapter per agent under the agent's name) instead of in-process; see
            :class:`~teamrl.serve.vllm_proxy.VLLMProxy`. Batching is then vLLM's.
        vllm_timeout_s: a vLLM request not answered within this many seconds is a 504.
    """
    served = team if isinstance(team, ServedTeam) else ServedTeam.load(team, name=name, device=device, dtype=dtype,
                                                                       max_new_tokens=max_new_tokens)
    if name is not None:
        served.name = name
    if batch_window_ms < 0 or max_batch < 1 or max_body_bytes < 1:
        raise ValueError(f"batch_window_ms must be >= 0, max_batch and max_body_bytes >= 1 (got {batch_window_ms}, "
                         f"{max_batch}, {max_body_bytes})")
    metrics = ServerMetrics(batch_window_ms)
    if vllm_url is None:
        batcher: Batcher | VLLMProxy = Batcher(served, metrics, window=batch_window_ms / 1000, max_batch=max_batch)
    else:
        batcher = VLLMProxy(served, metrics, vllm_url, timeout=vllm_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            # Uvicorn gets here after the requests in flight have finished: nothing is left for the worker.
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title=f"teamrl serve: {served.name}", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served, app.state.metrics, app.state.batcher = served, metrics, batcher
    app.state.draining = False
    app.add_middleware(_Measured, metrics=metrics)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise RequestError("missing API key: send the header 'Authorization: Bearer KEY'", status=401,
                               code="invalid_api_key")
        if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise RequestError("wrong API key", status=401, code="invalid_api_key")

    def check_open() -> None:
        if app.state.draining:
            raise RequestError("the server is shutting down; send the request to another instance", status=503,
                               code="server_shutting_down")

    @app.exception_handler(RequestError)
    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return error_response(err.status, str(err), code=err.code, param=err.param, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = str(err.detail)
        if err.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; this server has GET /v1/models, "
                       f"POST {CHAT_PATH}, GET /health and GET /metrics")
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(err.status_code, message, code=None)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        logger.exception("teamrl serve: %s %s failed", request.method, request.url.path)
        first_line = str(err).splitlines()[0] if str(err) else ""
        return error_response(500, f"internal error: {type(err).__name__}: {first_line}")

    @app.get("/health")
    async def health() -> JSONResponse:
        if app.state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok", "model": served.name, "agents": [agent.name for agent in served.team]})

    @app.get("/metrics")
    async def get_metrics(request: Request, format: str = "json") -> Response:
        check_key(request)
        snapshot = metrics.snapshot(queue_depth=batcher.queued)
        if format == "prometheus":
            return PlainTextResponse(prometheus_text(snapshot), media_type="text/plain; version=0.0.4")
        return JSONResponse(snapshot)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        check_key(request)
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "teamrl"}
            for model_id in served.model_ids()]})

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        check_open()
        check_key(request)
        body = await _read_body(request, max_body_bytes)
        try:
            data = json.loads(body)
        except ValueError as err:  # UnicodeDecodeError included
            raise RequestError(f"the request body is not valid JSON ({err})") from None
        chat = ChatRequest.parse(data)
        agent_index = served.resolve_model(chat.model)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        job = _job(served, chat, agent_index, request_id)
        batcher.submit(job)
        if chat.stream:
            try:
                await _wait(request, job, job.accepted)
            except _ClientGone:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return StreamingResponse(_events(served, chat, agent_index, request_id, job),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            answers = await _wait(request, job, job.future)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse(_completion(served, chat, agent_index, request_id, answers))

    return app


def _job(served: ServedTeam, chat: ChatRequest, agent_index: int | None, request_id: str) -> Job:
    """The generation work of ``chat``: every agent's prompt of the task's input, or one agent's of the chat."""
    loop = asyncio.get_running_loop()
    if agent_index is None:
        user = [message for message in chat.messages if message["role"] == "user"]
        if not user:
            raise RequestError("the team answers the last user message, and there is none", param="messages")
        observations = served.observations(served.item(user[-1]["content"], request_id))
        inputs = dict(enumerate(observations))
        prompts = {i: agent.prompt(observations[i]) for i, agent in enumerate(served.team)}
        label = "messages[-1].content"
    else:
        agent = served.team[agent_index]
        prompts = {agent_index: served.chat_prompt(agent, chat.messages)}
        inputs = {agent_index: "\n\n".join(message["content"] for message in chat.messages)}
        label = "messages"
    sampling = {i: served.sampling(served.team[i], max_tokens=chat.max_tokens, temperature=chat.temperature,
                                   top_p=chat.top_p) for i in prompts}
    return Job(prompts=prompts, inputs=inputs, sampling=sampling, seed=chat.seed, label=label,
               future=loop.create_future(), accepted=loop.create_future(), loop=loop)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, or RequestError 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the request body is {int(declared):,} bytes, over this server's limit of {limit:,} "
                           f"bytes (--max-body-bytes)", status=413, code="request_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(f"the request body is over this server's limit of {limit:,} bytes (--max-body-bytes)",
                               status=413, code="request_too_large")
    return bytes(body)


async def _wait(request: Request, job: Job, future: asyncio.Future) -> Any:
    """``future``'s result, or _ClientGone (the job marked cancelled) when the client disconnects first."""
    while True:
        done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_SECONDS)
        if done:
            return future.result()
        if await request.is_disconnected():
            job.cancelled = True
            raise _ClientGone


def _usage(answers: list[AgentAnswer]) -> dict[str, int]:
    prompt = sum(answer.prompt_tokens for answer in answers)
    completion = sum(answer.completion_tokens for answer in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(answers: list[AgentAnswer]) -> str:
    return "length" if any(answer.finish_reason == "length" for answer in answers) else "stop"


def _completion(served: ServedTeam, chat: ChatRequest, agent_index: int | None, request_id: str,
                answers: list[AgentAnswer]) -> dict:
    """The ``chat.completion`` object of ``answers``."""
    if agent_index is None:
        message = {"role": "assistant", "content": "".join(served.joined([answer.text for answer in answers])),
                   "agent_outputs": {answer.agent: answer.text for answer in answers}}
    else:
        message = {"role": "assistant", "content": answers[0].text}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": chat.model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(answers),
                         "logprobs": None}],
            "usage": _usage(answers)}


async def _events(served: ServedTeam, chat: ChatRequest, agent_index: int | None, request_id: str,
                  job: Job) -> AsyncIterator[str]:
    """The Server-Sent Events of a streamed answer: the role, each agent's part (``delta.agent`` names it) once
    generated, the finish reason, the usage when ``stream_options.include_usage``, ``[DONE]``. Starlette
    cancels this generator when the client disconnects; the job is then dropped."""
    created = int(time.time())

    def chunk(delta: dict, finish_reason: str | None = None, **extra: Any) -> str:
        body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": chat.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield chunk({"role": "assistant", "content": ""})
        try:
            answers = await job.future
        except RequestError as err:  # the headers are sent: OpenAI's streams carry an error as an event
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': 'invalid_request_error'}})}\n\n"
            yield "data: [DONE]\n\n"
            return
        if agent_index is None:
            parts = served.joined([answer.text for answer in answers])
            for answer, part in zip(answers, parts):
                yield chunk({"content": part, "agent": answer.agent})
        else:
            yield chunk({"content": answers[0].text})
        yield chunk({}, _finish_reason(answers))
        if chat.include_usage:
            body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": chat.model,
                    "choices": [], "usage": _usage(answers)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not job.future.done() or job.future.cancelled():
            job.cancelled = True


class _Measured:
    """ASGI middleware: counts every chat completion by status and times it until its last byte is sent
    (a stream's included), for ``/metrics``."""

    def __init__(self, app: Callable, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] != CHAT_PATH:
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def measured_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.request_started()
        try:
            await self.app(scope, receive, measured_send)
        finally:
            self.metrics.request_finished(status, time.perf_counter() - start)


# ------------------------------------------------------------------------------------------------ the server


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, access_log: bool = False,
          log_level: str = "info", on_listening: Callable[[str], None] | None = None) -> int:
    """Run ``app`` on uvicorn until SIGTERM or Ctrl-C; returns 0 after a graceful shutdown.

    On the signal the server stops listening (new connections are refused), answers requests arriving on
    open connections with 503, lets the requests in flight finish, and returns. ``on_listening(url)`` is
    called once the socket listens (port 0: the port the system chose).
    """
    listener = _listening_socket(host, port)
    bound_host, bound_port = listener.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=None)
    server = _GracefulServer(config, on_signal=lambda: setattr(app.state, "draining", True))
    if on_listening is not None:
        on_listening(url)
    server.run(sockets=[listener])
    return 0


def _listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` and listening, so that clients may connect (and queue) as soon as
    the caller reports the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as err:
        listener.close()
        raise ValueError(f"--host/--port: cannot listen on {host}:{port} ({err.strerror or err})") from None
    listener.listen(2048)
    return listener


class _GracefulServer(uvicorn.Server):
    """uvicorn's server, but a SIGTERM or SIGINT ends it with a graceful shutdown and nothing else: uvicorn
    re-raises the signal once shut down, which would end the process with -15 instead of 0."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]):
        super().__init__(config)
        self.on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        originals = {sig: signal.signal(sig, self.stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def stop_on_signal(self, sig: int, frame: Any) -> None:
        self.on_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for the requests in flight
        else:
            self.should_exit = True
