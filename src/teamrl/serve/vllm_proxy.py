"""The vLLM backend of ``teamrl serve --vllm-url URL``: the team router in front, vLLM generating on the GPU.

vLLM serves the exported base with one LoRA adapter per agent, each registered under the agent's name
(``vllm serve OUT/base --enable-lora --lora-modules AGENT=OUT/AGENT ...``, docs/serving.md). teamrl keeps
everything a general server does not do for a team: the API, turning a request's input into each agent's
observation and prompt, joining the agents' outputs, metrics and errors. :class:`VLLMProxy` has the
interface of :class:`~teamrl.serve.engine.Batcher` (``start``, ``stop``, ``submit``, ``queued``), so the
routes are the same; it sends each agent's prompt to vLLM's ``/v1/completions`` as one request, the agents of
a job concurrently, and vLLM batches them with everything else it runs.

Why ``/v1/completions`` with teamrl's prompt rather than ``/v1/chat/completions``: the prompt is then
exactly the one the in-process path generates from (the agent's system prompt and the task's observation
through the agent's chat template, or the raw prompt of an agent without one), tokenized as teamrl
tokenizes it (``add_special_tokens``) and stopped at the agent's end tokens. A chat request would let vLLM
rebuild the prompt from the base's template with its own defaults, which differ for agents trained without
a chat template and wherever teamrl passes template options.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from teamrl.serve.engine import GREEDY_TEMPERATURE, AgentAnswer, Job, RequestError, ServedTeam, refused_as_too_long
from teamrl.serve.metrics import ServerMetrics

logger = logging.getLogger("teamrl.serve")

DEFAULT_VLLM_TIMEOUT_S = 300.0
CANCEL_POLL_SECONDS = 0.05
"""How often a job's vLLM requests check that its client is still there (closing them makes vLLM abort)."""


class VLLMProxy:
    """Generates each job's answers by one ``/v1/completions`` request per agent to the vLLM server at
    ``base_url`` (e.g. ``http://127.0.0.1:8001/v1``), concurrently; the model of agent ``A`` is the LoRA
    adapter registered as ``A``. Errors reaching or from vLLM become 502s, no answer within ``timeout``
    seconds a 504."""

    def __init__(self, served: ServedTeam, metrics: ServerMetrics, base_url: str, *,
                 timeout: float = DEFAULT_VLLM_TIMEOUT_S):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--vllm-url: {base_url!r} is not an http(s) URL; give vLLM's, e.g. "
                             f"http://127.0.0.1:8001/v1")
        if timeout <= 0:
            raise ValueError(f"--vllm-timeout: must be > 0 seconds (got {timeout})")
        self.served, self.metrics, self.timeout = served, metrics, timeout
        self.base_url = base_url.rstrip("/")
        self.completions_url = f"{self.base_url}/completions"
        self._running: set[asyncio.Task] = set()

    def start(self) -> None:
        """Nothing to start: each job opens its own connections (vLLM may come up after this server)."""

    def stop(self, timeout: float | None = None) -> None:
        """Nothing to stop: uvicorn has let the requests in flight, and so their vLLM calls, finish."""

    def submit(self, job: Job) -> None:
        """Start ``job``'s vLLM requests (from the event loop); its future gets the answers in agent order."""
        task = job.loop.create_task(self._run(job))
        self._running.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._running.discard)

    @property
    def queued(self) -> int:
        """Jobs waiting on vLLM (its own queue is in its /metrics)."""
        return len(self._running)

    async def _run(self, job: Job) -> None:
        try:
            await self._answer(job)
        except Exception as err:  # no job may be left waiting, whatever failed
            logger.exception("teamrl serve: a vLLM job failed")
            job.resolve(err)

    async def _answer(self, job: Job) -> None:
        # The same context check as in-process, so an input too long is a 400 naming the limit, not a 502.
        if refused_as_too_long(self.served, job):
            return
        if job.cancelled:
            self.metrics.cancelled(before_generation=True)
            return
        start = time.perf_counter()
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            calls = {index: asyncio.ensure_future(self._complete(client, job, index)) for index in job.prompts}
            pending: set[asyncio.Future] = set(calls.values())
            while pending:
                done, pending = await asyncio.wait(pending, timeout=CANCEL_POLL_SECONDS,
                                                   return_when=asyncio.FIRST_EXCEPTION)
                # Every done call's exception read, not just the first's: asyncio logs "exception was never
                # retrieved" for the others otherwise.
                failed = [call for call in done if call.exception() is not None]
                if job.cancelled or failed:
                    for call in pending:
                        call.cancel()  # closes its connection: vLLM aborts a request whose client went away
                    await asyncio.gather(*pending, return_exceptions=True)
                    break
        if job.cancelled:
            self.metrics.cancelled(before_generation=False)
            job.resolve(asyncio.CancelledError())  # nobody awaits it: the futures are just cancelled
            return
        # The first failure in agent order answers; a call cancelled because another failed has no result.
        errors = [error for error in (None if calls[index].cancelled() else calls[index].exception()
                                      for index in sorted(job.prompts)) if error is not None]
        if errors:
            if not isinstance(errors[0], RequestError):
                raise errors[0]
            job.resolve(errors[0])
            return
        answers = [calls[index].result() for index in sorted(job.prompts)]
        self.metrics.generated(requests=1, rows=len(answers),
                               prompt_tokens=sum(answer.prompt_tokens for answer in answers),
                               completion_tokens=sum(answer.completion_tokens for answer in answers),
                               seconds=time.perf_counter() - start)
        # Accepted only now, so that a stream whose vLLM call failed still gets a 502 status, not an event.
        job.accept()
        job.resolve(answers)

    def request_body(self, job: Job, index: int) -> dict:
        """The ``/v1/completions`` body of agent ``index``'s part of ``job``: its prompt and sampling settings
        (``max_tokens`` already capped by the agent's own), tokenized and stopped as teamrl does.

        Every sampling field is sent, the ones teamrl never applies at their "off" values: vLLM's server fills a
        field a request leaves out from the served folder's generation_config.json (Qwen3's: top_k 20, top_p
        0.95), so the agent would be served with other sampling than it was trained with."""
        agent, sampling = self.served.team[index], job.sampling[index]
        body = {
            "model": agent.name,
            "prompt": job.prompt_ids[index] if job.prompt_ids else job.prompts[index],
            "max_tokens": sampling.max_new_tokens,
            # teamrl samples temperature 0 at a tiny temperature (greedy); vLLM's greedy is 0.
            "temperature": 0.0 if sampling.temperature <= GREEDY_TEMPERATURE else sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # -1: off, in every vLLM release
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "n": 1,
            # vLLM's extra parameters: a chat-templated prompt already holds its special tokens.
            "add_special_tokens": not agent.uses_chat_template,
            "stop_token_ids": [int(token) for token in agent.eos_token_ids],
            "skip_special_tokens": True,
        }
        if job.seed is not None:
            body["seed"] = job.seed
        if job.stop:
            body["stop"] = list(job.stop)
        return body

    async def _complete(self, client: httpx.AsyncClient, job: Job, index: int) -> AgentAnswer:
        agent = self.served.team[index]
        where = f"vLLM at {self.base_url} (agent {agent.name!r})"
        try:
            response = await client.post(self.completions_url, json=self.request_body(job, index))
        except httpx.TimeoutException:
            raise RequestError(f"{where} did not answer within {self.timeout:g} s (--vllm-timeout)", status=504,
                               code="upstream_timeout") from None
        except httpx.HTTPError as err:
            raise RequestError(f"cannot reach {where}: {type(err).__name__}: {_first_line(str(err))}; is "
                               f"`vllm serve` running there?", status=502, code="upstream_unreachable") from None
        if response.status_code != 200:
            raise RequestError(f"{where} answered {response.status_code}: {_upstream_message(response)}",
                               status=502, code="upstream_error")
        try:
            data = response.json()
            choice = data["choices"][0]
            text, usage = choice["text"], data.get("usage") or {}
            if not isinstance(text, str):
                raise TypeError("text is not a string")
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise RequestError(f"{where} answered something that is not an OpenAI completion ({err})", status=502,
                               code="upstream_error") from None
        finish_reason = "length" if choice.get("finish_reason") == "length" else "stop"
        return AgentAnswer(agent.name, text, int(usage.get("prompt_tokens", 0)),
                           int(usage.get("completion_tokens", 0)), finish_reason)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no message"


def _upstream_message(response: httpx.Response) -> str:
    """The message of an error answer: OpenAI's ``error.message`` (vLLM's), FastAPI's ``detail``, or the body."""
    try:
        data = response.json()
    except ValueError:
        return _first_line(response.text)[:300]
    if isinstance(data, dict):
        error = data.get("error")
        message = error.get("message") if isinstance(error, dict) else data.get("message", data.get("detail"))
        if message is not None:
            return _first_line(str(message))[:300]
    return _first_line(response.text)[:300]
