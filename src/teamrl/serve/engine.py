"""The served team and the batcher that runs it.

:class:`ServedTeam` is a saved team loaded for inference with the task it was trained on: it turns a
request's input into an item, the item into each agent's observation (``env.observe``, as ``teamrl
generate`` does), an agent's chat messages into its prompt, and the agents' outputs into one answer.

:class:`Batcher` owns the models: ONE worker thread runs every generation (a shared LoRA base routes rows
through adapters by global state, and a fast tokenizer must not be used from two threads at once). Requests
are queued as :class:`Job` s; the worker takes the oldest, waits until ``window`` seconds after it
arrived for others (up to ``max_batch``), and runs them all in one :func:`~teamrl.rollout.generate.generate_team`
call per sampling setting: one batched ``generate`` per base model, the agents on different models
concurrently, exactly as :func:`~teamrl.inference.run_team` runs a team on many inputs.

:class:`ContinuousServer` runs the same jobs by continuous batching instead
(:class:`~teamrl.rollout.continuous.ContinuousBatcher`): a request joins the rows decoding at the next step and
leaves when it ends, and every answer carries its exact token ids and log-probs (what training's gateway records).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teamrl.config import SamplingConfig
from teamrl.envs.base import Environment, Item
from teamrl.inference import context_error
from teamrl.models.chat import render_chat
from teamrl.rollout.continuous import ContinuousBatcher, TokenCompletion, TokenEngine, TokenRequest
from teamrl.rollout.generate import derive_seed
from teamrl.serve.metrics import ServerMetrics
from teamrl.team import Agent, Team

GREEDY_TEMPERATURE = 1e-6
"""What ``temperature: 0`` samples at: the sampler divides by the temperature, and at 1e-6 the most likely
token takes all the probability (the tests' greedy)."""


class RequestError(ValueError):
    """A request the server cannot answer as asked (a 4xx): ``status``, OpenAI's ``code`` and ``param``."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


@dataclass
class AgentAnswer:
    """One agent's part of a job's answer."""

    agent: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    """'stop' (the agent ended its answer) or 'length' (it ran out of ``max_tokens``)."""
    tokens: TokenCompletion | None = None
    """The exact prompt and completion token ids and log-probs (continuous batching only)."""


@dataclass
class Job:
    """A request's generation work: one prompt per agent that answers (all of them for the team, one for
    ``TEAM/AGENT``), their sampling settings and the future the HTTP handler awaits."""

    prompts: dict[int, str]
    """Agent index -> the prompt that agent is conditioned on."""
    inputs: dict[int, str]
    """Agent index -> the part of the prompt the client wrote (how much to shorten, in a context error)."""
    sampling: dict[int, SamplingConfig]
    seed: int | None
    label: str
    """How a context error names the input, e.g. 'messages[-1].content'."""
    future: asyncio.Future
    """Gets the answers, in agent order, or the error (a RequestError for a 4xx)."""
    accepted: asyncio.Future
    """Done (None) once the worker has checked the job's prompts against the context and starts generating
    it, or failed as ``future`` fails: a stream waits for it before it sends its headers, so that an input
    too long for the context still gets a 4xx."""
    loop: asyncio.AbstractEventLoop
    prompt_ids: dict[int, list[int]] | None = None
    """Agent index -> the prompt's token ids, where the client sent ids (``/v1/completions``); None: each prompt is
    encoded as training encodes it."""
    stop: tuple[str, ...] = ()
    """Each answer ends where its text first contains one of these."""
    submitted: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    """Set by the handler when its client went away: the worker drops the job (or stops the call it is in,
    when every job of that call is gone)."""
    answers: dict[int, AgentAnswer] = field(default_factory=dict)
    on_cancel: list[Callable[[], None]] = field(default_factory=list)
    """Called once when the handler cancels the job (:meth:`cancel`): an engine's way to stop its rows at once."""

    def cancel(self) -> None:
        """The client went away: drop the job (its rows, where the engine can stop them)."""
        if not self.cancelled:
            self.cancelled = True
            for hook in self.on_cancel:
                hook()

    def __post_init__(self) -> None:
        # One error fails both futures and the handler awaits one of them: a stream only ``accepted`` (and never
        # ``future`` when that error refuses it before its headers), any other request only ``future``. Reading
        # both here keeps asyncio from logging the other as never retrieved.
        for future in (self.accepted, self.future):
            future.add_done_callback(lambda done: done.cancelled() or done.exception())

    def accept(self) -> None:
        """Tell the awaiting handler, from the worker thread, that the job is being generated."""
        self._deliver(self.accepted, None)

    def resolve(self, result: list[AgentAnswer] | BaseException) -> None:
        """Hand the result (or error) to the awaiting handler, from the worker thread."""
        if isinstance(result, BaseException):
            self._deliver(self.accepted, result)
        self._deliver(self.future, result)

    def _deliver(self, future: asyncio.Future, result: Any) -> None:
        def deliver() -> None:
            if future.done():
                return
            if self.cancelled:  # nobody awaits it: an exception set on it would be logged as never retrieved
                future.cancel()
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass


class ServedTeam:
    """A saved team, loaded with its task, and what the API needs of it: names, inputs, prompts, joins."""

    def __init__(self, team: Team, env: Environment, name: str):
        self.team, self.env, self.name = team, env, name
        self.env_name = type(env).__name__
        self.agent_index = {agent.name: i for i, agent in enumerate(team)}
        items = list(env.items("eval"))[:1] or list(env.items("train"))[:1]
        self.example_item = {key: value for key, value in items[0].items() if key != "id"} if items else {}

    @classmethod
    def load(cls, team_dir: str | Path, *, name: str | None = None, device: str = "cpu", dtype: str = "float32",
             max_new_tokens: int | None = None) -> ServedTeam:
        """Load the team saved in ``team_dir`` (RUN_DIR/team) and rebuild its task from ``team.json``.
        ``name``: the model id clients ask for (default: the folder's name, or its run's when the folder is
        called 'team'). ``max_new_tokens``: replaces every agent's own, the most a request's ``max_tokens``
        gets (as ``teamrl generate --max-new-tokens``)."""
        from teamrl.envs.base import saved_team_task

        root = Path(team_dir)
        _, env = saved_team_task(root)
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens: must be >= 1 (got {max_new_tokens})")
        team = Team.from_pretrained(root, env, device=device, dtype=dtype)
        for agent in team if max_new_tokens is not None else ():
            agent.sampling = dataclasses.replace(agent.sampling, max_new_tokens=max_new_tokens)
        resolved = root.resolve()
        default = resolved.parent.name if resolved.name == "team" and resolved.parent.name else resolved.name
        return cls(team, env, name or default)

    # ----------------------------------------------------------------------------------- model ids

    def model_ids(self) -> list[str]:
        """The team's id (unless its task is a program, whose agents are only called one by one), each agent's as
        ``TEAM/AGENT``, then each agent's bare name (what a program trained by teamrl calls it by)."""
        team = [self.name] if self.env.joint_prompts else []
        return [*team, *(f"{self.name}/{agent.name}" for agent in self.team), *self.agent_index]

    def resolve_model(self, model: str) -> int | None:
        """None for the team; an agent's index for ``TEAM/AGENT`` or ``AGENT``. Raises RequestError (404, OpenAI's
        ``model_not_found``) otherwise."""
        if model == self.name and self.env.joint_prompts:
            return None
        team_name, _, agent = model.rpartition("/")
        if team_name in ("", self.name) and agent in self.agent_index:
            return self.agent_index[agent]
        raise RequestError(f"model {model!r} does not exist; this server has: {', '.join(self.model_ids())}",
                           status=404, code="model_not_found", param="model")

    # ----------------------------------------------------------------------------------- inputs

    def item(self, content: str, request_id: str) -> Item:
        """The task item a team request stands for: the fields of ``content`` when it is a JSON object
        (``id`` defaulting to the request's id), else ``{"id": request_id, "text": content}``."""
        stripped = content.strip()
        if stripped.startswith("{"):
            try:
                fields = json.loads(stripped)
            except ValueError:
                fields = None  # text that happens to open with a brace
            if isinstance(fields, dict):
                return {"id": request_id, **fields}
        return {"id": request_id, "text": content}

    def observations(self, item: Item) -> list[str]:
        """Each agent's observation of ``item`` (the task's ``observe``, checked). Raises RequestError (400)
        naming the fields the task needs when the item lacks one."""
        from teamrl.envs.checks import first_observations
        from teamrl.user_code import missing_field

        try:
            return first_observations(self.env, [item])[0]
        except (KeyError, ValueError, TypeError) as raised:
            err = missing_field(raised)
            if err is None:
                raise RequestError(f"{self.env_name} cannot read this input: {raised}", param="messages") from None
            example = json.dumps(self.example_item)[:200]
            raise RequestError(f"{self.env_name} needs items with the field {err}; send the item as a JSON object "
                               f"in the last user message's content, e.g. {example}",
                               param="messages") from None

    def chat_prompt(self, agent: Agent, messages: Sequence[dict[str, str]]) -> str:
        """``agent``'s prompt for a chat: the messages through its chat template (its own system prompt first
        unless the messages bring one), or, with no template, the messages' contents between blank lines."""
        if agent.system_prompt and not any(message["role"] == "system" for message in messages):
            messages = [{"role": "system", "content": agent.system_prompt}, *messages]
        if agent.uses_chat_template:
            return render_chat(agent.tokenizer, messages, agent.enable_thinking)
        return "\n\n".join(message["content"] for message in messages)

    def sampling(self, agent: Agent, *, max_tokens: int | None, temperature: float | None = None,
                 top_p: float | None = None) -> SamplingConfig:
        """``agent``'s sampling settings with a request's: ``max_tokens`` capped by the agent's own
        ``max_new_tokens``, ``temperature`` 0 as greedy."""
        changes: dict[str, Any] = {}
        if max_tokens is not None:
            changes["max_new_tokens"] = min(max_tokens, agent.sampling.max_new_tokens)
        if temperature is not None:
            changes["temperature"] = max(temperature, GREEDY_TEMPERATURE)
        if top_p is not None:
            changes["top_p"] = top_p
        return dataclasses.replace(agent.sampling, **changes)

    def joined(self, texts: Sequence[str]) -> list[str]:
        """The parts of the team's joint answer, one per agent, in seat order: each headed by the task's
        name for that seat's output (``env.output_names``, e.g. '## one-sentence summary') when it names
        every seat, and separated by a blank line, so that ``"".join`` of them is the message content."""
        names = list(getattr(self.env, "output_names", ()) or ())
        parts = [f"## {names[i]}\n\n{text}" if len(names) == len(texts) else text for i, text in enumerate(texts)]
        return [part if i == 0 else f"\n\n{part}" for i, part in enumerate(parts)]


class Batcher:
    """The one thread that runs the team's models, batching the jobs that arrive within ``window`` seconds
    of each other (``0``: every job alone) into shared ``generate`` calls, at most ``max_batch`` jobs each."""

    def __init__(self, served: ServedTeam, metrics: ServerMetrics, *, window: float = 0.01, max_batch: int = 32):
        self.served, self.metrics = served, metrics
        self.window, self.max_batch = window, max_batch
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="teamrl-serve-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Run the jobs already queued, then end the worker."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> None:
        """Queue ``job`` (from the event loop); its future gets the answers in agent order."""
        if self._thread is None:
            raise RuntimeError("the batcher is not running")
        self._queue.put(job)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def _work(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            # The window counts from the oldest job's arrival: jobs that waited while a batch ran do not wait again.
            deadline = first.submitted + self.window
            while self.window > 0 and len(batch) < self.max_batch:
                try:
                    job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(job)
            try:
                self._run(batch)
            except Exception as err:  # no job may be left waiting, whatever failed
                for job in batch:
                    job.resolve(err)

    def _run(self, batch: list[Job]) -> None:
        live = []
        for job in batch:
            if job.cancelled:
                self.metrics.cancelled(before_generation=True)
                continue
            if refused_as_too_long(self.served, job):
                continue
            job.accept()
            live.append(job)
        # One generate_team call per sampling setting (every row of a call samples alike); a seeded job alone,
        # so that its seed alone decides its tokens.
        calls: dict[tuple, tuple[SamplingConfig, int | None, list[tuple[Job, int]]]] = {}
        for job in live:
            for index in job.prompts:
                sampling = job.sampling[index]
                key = (repr(sampling), None if job.seed is None else id(job))
                calls.setdefault(key, (sampling, job.seed, []))[2].append((job, index))
        for sampling, seed, rows in calls.values():
            self._generate(rows, sampling, seed=seed)
        for job in live:
            if job.cancelled:
                self.metrics.cancelled(before_generation=False)
            job.resolve([job.answers[index] for index in sorted(job.prompts)])

    def _generate(self, rows: list[tuple[Job, int]], sampling: SamplingConfig, seed: int | None) -> None:
        """Run ``rows`` (job, agent index) in one generate_team call; store each row's answer in its job."""
        from teamrl.rollout.generate import generate_team

        indices = sorted({index for _, index in rows})
        team = Team([dataclasses.replace(self.served.team[i], sampling=sampling) for i in indices])
        owners = [[job for job, index in rows if index == i] for i in indices]
        prompts = [[job.prompts[i] for job in jobs] for i, jobs in zip(indices, owners)]
        jobs = {id(job): job for job, _ in rows}.values()
        stop: Callable[[], bool] = lambda: all(job.cancelled for job in jobs)  # noqa: E731
        start = time.perf_counter()
        generations = generate_team(team, prompts, 1, concurrent=seed is None, seed=seed,
                                    should_stop=stop)
        seconds = time.perf_counter() - start
        prompt_tokens = completion_tokens = 0
        for agent, generation, jobs_of_agent in zip(team, generations, owners):
            eos = set(agent.eos_token_ids)
            for row, job in enumerate(jobs_of_agent):
                mask = generation.completion_mask[row]
                length = int(mask.sum())
                ended = length > 0 and int(generation.completion_ids[row, length - 1]) in eos
                # A stop string ends the text only: the whole call decodes as long as its longest row.
                text, stopped = cut_at_stop(generation.texts[row], job.stop)
                answer = AgentAnswer(agent.name, text, int(generation.prompt_mask[row].sum()),
                                     length, "stop" if ended or stopped else "length")
                job.answers[self.served.agent_index[agent.name]] = answer
                prompt_tokens += answer.prompt_tokens
                completion_tokens += answer.completion_tokens
        self.metrics.generated(requests=len(jobs), rows=len(rows), prompt_tokens=prompt_tokens,
                               completion_tokens=completion_tokens, seconds=seconds)


class ContinuousServer:
    """:class:`Batcher`'s jobs run by continuous batching (:class:`~teamrl.rollout.continuous.ContinuousBatcher`):
    each of a job's prompts is encoded as training encodes it (or taken as the client's ids), checked against the
    context, and joins the rows decoding at the next step; the job is answered when its last row ends, every answer
    with its exact tokens (:attr:`AgentAnswer.tokens`). ``max_rows``: the most rows decoding at once per base.
    ``engine``: what samples the rows (default: a :class:`~teamrl.rollout.continuous.ContinuousBatcher` over the
    served team; a training run's backend gives its own, e.g. vLLM's)."""

    def __init__(self, served: ServedTeam, metrics: ServerMetrics, *, max_rows: int = 64,
                 engine: TokenEngine | None = None):
        self.served, self.metrics = served, metrics
        self.engine = engine if engine is not None else ContinuousBatcher(served.team, max_rows=max_rows)

    def start(self) -> None:
        self.engine.start()

    def stop(self, timeout: float | None = None) -> None:
        self.engine.stop(timeout)

    @property
    def queued(self) -> int:
        return self.engine.queued

    def submit(self, job: Job) -> None:
        """Start ``job``'s rows (from the event loop); its future gets the answers in agent order."""
        if job.cancelled:
            self.metrics.cancelled(before_generation=True)
            return
        requests = {}
        try:
            for index, prompt in job.prompts.items():
                agent = self.served.team[index]
                ids = job.prompt_ids[index] if job.prompt_ids else self.engine.encode(agent, prompt)
                sampling = job.sampling[index]
                overflow = context_error(agent, len(ids), sampling.max_new_tokens, job.inputs[index], job.label)
                if overflow is not None:
                    raise RequestError(overflow, code="context_length_exceeded", param="messages")
                seed = None if job.seed is None else derive_seed(job.seed, index)
                requests[index] = TokenRequest(index, tuple(ids), sampling, job.stop, seed)
        except RequestError as err:
            job.resolve(err)
            return
        job.accept()
        futures = {index: self.engine.submit(request) for index, request in requests.items()}
        job.on_cancel.append(lambda: [self.engine.cancel(future) for future in futures.values()])
        remaining = [len(futures)]
        lock = threading.Lock()

        def finished(_: object) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            try:
                answers = [self._answer(index, futures[index].result()) for index in sorted(futures)]
            except BaseException as err:  # the engine failed (or the job was cancelled): the handler hears of it
                job.resolve(err if isinstance(err, Exception) else RuntimeError(str(err)))
                return
            job.resolve(answers)

        for future in futures.values():
            future.add_done_callback(finished)

    def _answer(self, index: int, completion: TokenCompletion) -> AgentAnswer:
        agent = self.served.team[index]
        answer = AgentAnswer(agent.name, completion.text, len(completion.prompt_ids), len(completion.completion_ids),
                             completion.finish_reason, completion)
        self.metrics.tokens(answer.prompt_tokens, answer.completion_tokens)
        return answer


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first of the ``stop`` strings it contains, and whether it contained one."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def refused_as_too_long(served: ServedTeam, job: Job) -> bool:
    """Whether ``job`` was answered with a 400 naming the context limit because an agent's prompt does not
    fit its model (the check ``teamrl generate`` makes), before any generation."""
    from teamrl.inference import _check_context

    try:
        for index, prompt in job.prompts.items():
            agent = dataclasses.replace(served.team[index], sampling=job.sampling[index])
            _check_context(agent, [prompt], [job.inputs[index]], [job.label])
    except ValueError as err:
        job.resolve(RequestError(str(err), code="context_length_exceeded", param="messages"))
        return True
    return False
