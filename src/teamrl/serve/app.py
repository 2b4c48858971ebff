"""The HTTP API of ``teamrl serve``: OpenAI's chat completions for a team and for each of its agents.

* ``GET /v1/models``: the team (``TEAM``) and each agent (``TEAM/AGENT``, and its bare name ``AGENT``: what a program
  trained by teamrl calls it by).
* ``POST /v1/chat/completions``: with ``model: TEAM`` the last user message's content is the task's input
  (a JSON object: the item's fields; else the item ``{"id": request id, "text": content}``), each agent
  answers its own observation of it, concurrently, and the message content is the agents' parts joined
  (headed by the task's ``output_names`` when it has them), each agent's own part in
  ``message.agent_outputs``. With ``model: TEAM/AGENT`` or ``AGENT`` that agent alone answers the chat (``n``
  choices, ``stop`` strings). ``stream: true``
  sends Server-Sent Events in OpenAI's chunk format: the role once generation starts, then each agent's
  part as one chunk once the batch finishes (not token by token), then ``data: [DONE]``.
* ``POST /v1/completions``: an agent continues a prompt (text, or token ids) as it is, no chat template.
* ``GET /health`` (no API key needed), ``GET /metrics`` (JSON, or ``?format=prometheus``).

During training the same app is the gateway a program task's episodes call (:mod:`teamrl.serve.gateway`): every
route above also answers under ``/episodes/EPISODE/v1``, and what each call sampled is recorded in that episode.

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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from teamrl.serve.engine import AgentAnswer, Batcher, ContinuousServer, Job, RequestError, ServedTeam
from teamrl.serve.metrics import ServerMetrics, prometheus_text
from teamrl.serve.vllm_proxy import VLLMProxy

if TYPE_CHECKING:
    from teamrl.rollout.continuous import TokenEngine
    from teamrl.rollout.episodes import ProgramEpisode

logger = logging.getLogger("teamrl.serve")

DEFAULT_MAX_BODY_BYTES = 1_000_000
DISCONNECT_POLL_SECONDS = 0.05
"""How often a waiting non-streaming request checks that its client is still there."""
CLIENT_CLOSED_REQUEST = 499
"""The status (nginx's) a request whose client went away is counted under; nobody receives it."""
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EPISODE_PREFIX = "/episodes/{episode}"
"""Where an episode of a program task calls during training: ``/episodes/EPISODE/v1/...``."""
MAX_CHOICES = 16
"""The most choices (``n``) one request may ask of an agent."""
MAX_STOPS = 4
"""The most stop strings one request may give (OpenAI's limit)."""
BATCHING = ("window", "continuous")
"""How the in-process server batches requests (``--batching``)."""
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
    n: int = 1
    stop: tuple[str, ...] = ()

    @classmethod
    def parse(cls, data: Any) -> ChatRequest:
        """Raises RequestError (400) naming the first field that is missing or wrong."""
        model = _model(data, "the team's name or TEAM/AGENT")
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("missing field 'messages': a non-empty list of {\"role\", \"content\"} objects",
                               param="messages")
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
            **_sampling_fields(data),
        )


@dataclass
class CompletionRequest:
    """The fields of a ``/v1/completions`` request that the server honours, validated: an agent continues ``prompt``
    (text, or token ids: exactly those) as it is, no chat template."""

    model: str
    prompt: str | list[int]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()

    @classmethod
    def parse(cls, data: Any) -> CompletionRequest:
        """Raises RequestError (400) naming the first field that is missing or wrong."""
        model = _model(data, "an agent's name")
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        token_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not token_ids:
            raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                               param="prompt")
        for name, allowed in (("stream", (None, False)), ("echo", (None, False)), ("logprobs", (None, 0)),
                              ("suffix", (None, ""))):
            if data.get(name) not in allowed:
                raise RequestError(f"{name}={data[name]!r} is not supported on /v1/completions; leave it out",
                                   param=name)
        return cls(model=model, prompt=prompt,
                   max_tokens=_number(data, "max_tokens", int, 1), **_sampling_fields(data))


def _model(data: Any, names: str) -> str:
    """A request body's ``model``, after checking the body is a JSON object; ``names``: what the model may be."""
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"missing field 'model': {names} (GET /v1/models lists them)", param="model")
    return model


def _sampling_fields(data: dict) -> dict[str, Any]:
    """The sampling fields chat and text completions share, validated."""
    return {"temperature": _number(data, "temperature", float, 0.0, 2.0),
            "top_p": _number(data, "top_p", float, 0.0, 1.0),
            "seed": _number(data, "seed", int),
            "n": _number(data, "n", int, 1, MAX_CHOICES) or 1,
            "stop": _stops(data)}


def _stops(data: dict) -> tuple[str, ...]:
    stop = data.get("stop")
    if stop is None or stop == "":
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings, got {stop!r}",
                           param="stop")
    return tuple(stops)


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
               vllm_url: str | None = None, vllm_timeout_s: float = 300.0, batching: str = "window",
               episodes: Mapping[str, ProgramEpisode] | None = None, sample_as_trained: bool = False,
               engine: TokenEngine | None = None) -> FastAPI:
    """The FastAPI app serving ``team`` (a saved team's directory, RUN_DIR/team, or a loaded
    :class:`ServedTeam`).

    Args:
        name: the team's model id (default: the folder's name; its run's when the folder is called 'team').
        api_key: when given, every ``/v1`` route and ``/metrics`` need ``Authorization: Bearer API_KEY``.
        batch_window_ms: requests arriving within this many milliseconds of the oldest waiting one share one
            generate call per base model (0: each request alone).
        max_batch: at most this many requests in one generate call (continuous batching: rows decoding at once per
            base model).
        max_body_bytes: larger request bodies get 413 before they are read.
        device, dtype: where and in what precision the models run.
        max_new_tokens: replaces every agent's own ``max_new_tokens`` (the most a request gets) when ``team``
            is a directory.
        vllm_url: generate on the vLLM server at this URL (e.g. http://127.0.0.1:8001/v1, serving one LoRA
            adapter per agent under the agent's name) instead of in-process; see
            :class:`~teamrl.serve.vllm_proxy.VLLMProxy`. Batching is then vLLM's.
        vllm_timeout_s: a vLLM request not answered within this many seconds is a 504.
        batching: 'window' (requests arriving within ``batch_window_ms`` share a generate call) or 'continuous' (a
            request joins the rows decoding at the next step and leaves when it ends:
            :class:`~teamrl.serve.engine.ContinuousServer`).
        episodes: the episodes of a program task being trained, by key: the routes then also answer under
            ``/episodes/KEY/v1`` and record every call's tokens in its episode (:mod:`teamrl.serve.gateway`).
        sample_as_trained: every agent samples with its own settings, whatever a request asks (``temperature``,
            ``top_p``): what training needs, so that the policy that samples is the one the update trains.
        engine: what samples continuous batching's rows (default: a
            :class:`~teamrl.rollout.continuous.ContinuousBatcher` over ``team``; a training run's gateway passes its
            backend's, vLLM's where ``rollout.backend: vllm``).
    """
    served = team if isinstance(team, ServedTeam) else ServedTeam.load(team, name=name, device=device, dtype=dtype,
                                                                       max_new_tokens=max_new_tokens)
    if name is not None:
        served.name = name
    if batch_window_ms < 0 or max_batch < 1 or max_body_bytes < 1:
        raise ValueError(f"batch_window_ms must be >= 0, max_batch and max_body_bytes >= 1 (got {batch_window_ms}, "
                         f"{max_batch}, {max_body_bytes})")
    if batching not in BATCHING:
        raise ValueError(f"--batching: {batching!r} is not one of {', '.join(BATCHING)}")
    metrics = ServerMetrics(batch_window_ms if batching == "window" else 0.0)
    if vllm_url is not None:
        batcher: Batcher | ContinuousServer | VLLMProxy = VLLMProxy(served, metrics, vllm_url, timeout=vllm_timeout_s)
    elif batching == "continuous":
        batcher = ContinuousServer(served, metrics, max_rows=max_batch, engine=engine)
    else:
        batcher = Batcher(served, metrics, window=batch_window_ms / 1000, max_batch=max_batch)
    exact_tokens = isinstance(batcher, ContinuousServer)

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
                       f"POST {CHAT_PATH}, POST {COMPLETIONS_PATH}, GET /health and GET /metrics")
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

    async def read_json(request: Request) -> Any:
        check_open()
        check_key(request)
        body = await _read_body(request, max_body_bytes)
        try:
            return json.loads(body)
        except ValueError as err:  # UnicodeDecodeError included
            raise RequestError(f"the request body is not valid JSON ({err})") from None

    def find_episode(key: str | None) -> ProgramEpisode | None:
        if key is None:
            return None
        episode = (episodes or {}).get(key)
        if episode is None:
            raise RequestError(f"episode {key!r} has ended (or never began): its program may only call while "
                               f"training runs it", status=404, code="episode_not_found")
        return episode

    def agent_of(model: str, episode: ProgramEpisode | None) -> int | None:
        """The agent ``model`` names (None: the team); a 404 (recorded in the episode) for any other name."""
        try:
            return served.resolve_model(model)
        except RequestError as err:
            if episode is not None:
                agents = ", ".join(agent.name for agent in served.team)
                episode.refuse(f"called model {model!r}, which is no agent of this team ({agents})")
            raise err from None

    async def agent_answers(request: Request, jobs: list[Job], episode: ProgramEpisode | None) -> list[AgentAnswer]:
        """Every job's one answer (each job one choice of one agent), recorded in ``episode``."""
        for job in jobs:
            batcher.submit(job)
        answers = []
        for job in jobs:
            try:
                answers += await _wait(request, job, job.future)
            except RequestError as err:
                if episode is not None and err.code == "context_length_exceeded":
                    episode.refuse(f"sent a prompt too long for its agent: {err}")
                raise
        if episode is not None:
            for job, answer in zip(jobs, answers):
                episode.record(next(iter(job.prompts)), answer.tokens)
        return answers

    def choice_seed(asked: int | None, choice: int, episode: ProgramEpisode | None) -> int | None:
        if episode is not None:
            return episode.call_seed(asked)
        return asked if asked is None or choice == 0 else asked + choice

    async def chat_completions(request: Request, episode_key: str | None = None) -> Response:
        episode = find_episode(episode_key)
        chat = ChatRequest.parse(await read_json(request))
        agent_index = agent_of(chat.model, episode)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if agent_index is None:
            _team_request_limits(chat)
            job = _job(served, chat, None, request_id, chat.seed, sample_as_trained)
            batcher.submit(job)
            return await _respond(request, served, chat, None, request_id, job)
        jobs = [_job(served, chat, agent_index, request_id, choice_seed(chat.seed, choice, episode), sample_as_trained)
                for choice in range(chat.n)]
        if chat.stream:
            if chat.n > 1:
                raise RequestError("stream with n > 1 is not supported; send n requests", param="n")
            if episode is None:
                batcher.submit(jobs[0])
                return await _respond(request, served, chat, agent_index, request_id, jobs[0])
        try:
            answers = await agent_answers(request, jobs, episode)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if chat.stream:  # an episode's stream: recorded whole, then sent as events
            job = jobs[0]
            future = asyncio.get_running_loop().create_future()
            future.set_result(answers)
            job.future, job.accepted = future, future
            return StreamingResponse(_events(served, chat, agent_index, request_id, job),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(_completion(served, chat, agent_index, request_id, answers))

    async def completions(request: Request, episode_key: str | None = None) -> Response:
        episode = find_episode(episode_key)
        completion = CompletionRequest.parse(await read_json(request))
        agent_index = agent_of(completion.model, episode)
        if agent_index is None:
            raise RequestError(f"/v1/completions continues a prompt with one agent; the team {served.name!r} answers "
                               f"on {CHAT_PATH}", param="model")
        if isinstance(completion.prompt, list) and not exact_tokens:
            raise RequestError("a prompt of token ids needs continuous batching (teamrl serve --batching continuous)",
                               param="prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        jobs = [_completion_job(served, completion, agent_index, choice_seed(completion.seed, choice, episode),
                                sample_as_trained) for choice in range(completion.n)]
        try:
            answers = await agent_answers(request, jobs, episode)
        except _ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": int(time.time()), "model": completion.model,
            "choices": [{"index": i, "text": answer.text, "finish_reason": answer.finish_reason, "logprobs": None}
                        for i, answer in enumerate(answers)],
            "usage": _usage(answers, choices_of_one_prompt=True)})

    app.add_api_route(CHAT_PATH, chat_completions, methods=["POST"])
    app.add_api_route(COMPLETIONS_PATH, completions, methods=["POST"])
    if episodes is not None:
        async def episode_chat(request: Request, episode: str) -> Response:
            return await chat_completions(request, episode)

        async def episode_completions(request: Request, episode: str) -> Response:
            return await completions(request, episode)

        async def episode_models(request: Request, episode: str) -> JSONResponse:
            find_episode(episode)
            return await list_models(request)

        app.add_api_route(EPISODE_PREFIX + CHAT_PATH, episode_chat, methods=["POST"])
        app.add_api_route(EPISODE_PREFIX + COMPLETIONS_PATH, episode_completions, methods=["POST"])
        app.add_api_route(EPISODE_PREFIX + "/v1/models", episode_models, methods=["GET"])
    return app


async def _respond(request: Request, served: ServedTeam, chat: ChatRequest, agent_index: int | None, request_id: str,
                   job: Job) -> Response:
    """The answer to ``chat``, whose ``job`` was submitted: a stream of events, or one completion object."""
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


def _team_request_limits(chat: ChatRequest) -> None:
    """What a request of the whole team may not ask: several choices, stop strings."""
    if chat.n != 1:
        raise RequestError(f"n={chat.n}: this server returns one choice per request of the team; send n=1, or n "
                           f"requests (they are batched)", param="n")
    if chat.stop:
        raise RequestError("stop sequences are not supported for the team's joint answer; leave 'stop' out, or ask "
                           "an agent", param="stop")


def _job(served: ServedTeam, chat: ChatRequest, agent_index: int | None, request_id: str, seed: int | None,
         sample_as_trained: bool) -> Job:
    """The generation work of ``chat``: every agent's prompt of the task's input, or one agent's of the chat."""
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
    return _new_job(served, prompts, None, inputs, label, chat, seed, sample_as_trained)


def _completion_job(served: ServedTeam, request: CompletionRequest, agent_index: int, seed: int | None,
                    sample_as_trained: bool) -> Job:
    """An agent's continuation of ``request``'s prompt, as it is."""
    text = request.prompt if isinstance(request.prompt, str) else ""
    ids = None if isinstance(request.prompt, str) else {agent_index: list(request.prompt)}
    return _new_job(served, {agent_index: text}, ids, {agent_index: text}, "prompt", request, seed, sample_as_trained)


def _new_job(served: ServedTeam, prompts: dict[int, str], prompt_ids: dict[int, list[int]] | None,
             inputs: dict[int, str], label: str, request: ChatRequest | CompletionRequest, seed: int | None,
             sample_as_trained: bool) -> Job:
    loop = asyncio.get_running_loop()
    asked = {} if sample_as_trained else {"temperature": request.temperature, "top_p": request.top_p}
    sampling = {i: served.sampling(served.team[i], max_tokens=request.max_tokens, **asked) for i in prompts}
    return Job(prompts=prompts, prompt_ids=prompt_ids, inputs=inputs, sampling=sampling, seed=seed, label=label,
               stop=request.stop, future=loop.create_future(), accepted=loop.create_future(), loop=loop)


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
            job.cancel()
            raise _ClientGone


def _usage(answers: list[AgentAnswer], choices_of_one_prompt: bool = False) -> dict[str, int]:
    """Tokens of ``answers``: each agent's prompt and completion (``choices_of_one_prompt``: the answers are choices of
    one prompt, counted once, as OpenAI counts ``n``)."""
    prompt = answers[0].prompt_tokens if choices_of_one_prompt else sum(answer.prompt_tokens for answer in answers)
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
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": chat.model,
                "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(answers),
                             "logprobs": None}],
                "usage": _usage(answers)}
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": chat.model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": answer.text},
                         "finish_reason": answer.finish_reason, "logprobs": None} for i, answer in enumerate(answers)],
            "usage": _usage(answers, choices_of_one_prompt=True)}


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
            job.cancel()


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
