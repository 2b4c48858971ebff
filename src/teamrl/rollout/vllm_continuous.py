"""Continuous batching on vLLM: a program task's calls answered by vLLM engines (``rollout.backend: vllm``).

The gateway (:mod:`teamrl.serve.gateway`) hands every call of every episode in flight to a
:class:`~teamrl.rollout.continuous.TokenEngine`. On the transformers backend that is the
:class:`~teamrl.rollout.continuous.ContinuousBatcher`; with vLLM it is :class:`VLLMTokenEngine`, which adds each
call to the engine of its agent's model (``LLMEngine.add_request``: the prompt as token ids, the agent's adapter,
its own seed) and steps the engines while anything is in flight, so a call that arrives while others decode joins
at vLLM's next scheduling step. The engines are the :class:`~teamrl.rollout.vllm_sampler.VLLMSampler`'s that the
training backend already holds (one per base model, LoRA agents sharing theirs): each busy period starts by pushing
the weights an update changed, as a rollout does.

What the caller gets is what the transformers engine gives: the prompt's ids, every completion id up to and
including the end-of-sequence token or the one that completed a stop string (checked here, token by token: vLLM
has no tokenizer), and each token's sampling log-prob as vLLM reports it (``processed_logprobs``: after top-k/top-p
masking, which the transformers engine leaves out). The update recomputes its log-probs with its own forward pass,
so these are diagnostics, as in vLLM rollouts. vLLM schedules its own rows (``max_num_seqs``): ``max_rows`` is not
applied.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from teamrl.rollout.continuous import TokenEngine, _Row
from teamrl.rollout.vllm_sampler import VLLMSampler, _Engine
from teamrl.team import Team


class VLLMTokenEngine(TokenEngine):
    """Requests arriving at any time, sampled by ``sampler``'s vLLM engines (:mod:`teamrl.rollout.vllm_continuous`)."""

    thread_name = "teamrl-vllm-engine"

    def __init__(self, team: Team, sampler: VLLMSampler, *, max_rows: int = 64):
        super().__init__(team, max_rows=max_rows)
        self.sampler = sampler
        self._engines: dict[int, _Engine] = {}
        """Agent index -> the engine serving it, for the busy period under way."""
        self._live: dict[str, tuple[_Row, _Engine]] = {}
        """vLLM request id -> the row it samples and the engine it runs on."""
        self._request_ids = itertools.count()
        self.steps = 0
        """Engine steps run so far."""

    def _in_flight(self) -> list[_Row]:
        return [row for row, _ in self._live.values()]

    def _run_busy(self, stopping: bool) -> bool:
        groups, memory_share = self.sampler.engine_groups(self.team)
        for indices in groups:  # the team is idle: push what the last update changed
            engine = self.sampler.ready_engine(self.team, indices, memory_share)
            self._engines.update(dict.fromkeys(indices, engine))
        while self._waiting or self._live:
            self._admit()
            for engine in {id(engine): engine for _, engine in self._live.values()}.values():
                for output in engine.llm.llm_engine.step():
                    self._advance(output)
                self.steps += 1
            self._drop_gone()
            stopping = self._drain(block=False) or stopping
        return stopping

    def _went_idle(self) -> None:
        for request_id, (_, engine) in list(self._live.items()):  # a failed busy period leaves nothing decoding
            engine.llm.llm_engine.abort_request([request_id])
        self._live = {}
        for engine in {id(engine): engine for engine in self._engines.values()}.values():
            self.sampler.rest(engine)
        self._engines = {}

    def _admit(self) -> None:
        for row in self._waiting:
            if row.gone:
                continue
            request = row.request
            engine = self._engines[request.agent]
            seed = request.seed if request.seed is not None else int(torch.randint(2**31 - 1, ()))
            params = self.sampler.sampling_params(
                request.sampling, 1, [] if request.ignore_eos else row.agent.eos_token_ids, seed,
                **({"ignore_eos": True} if request.ignore_eos else {}))
            request_id = f"teamrl-{next(self._request_ids)}"
            engine.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(request.prompt_ids)}, params,
                                              lora_request=self.sampler.adapter_request(row.agent))
            self._live[request_id] = (row, engine)
        self._waiting = []

    def _advance(self, output: Any) -> None:
        """Take in one request's output of an engine step (cumulative: every token so far); finish its row where it
        ended (vLLM's end-of-sequence or length, or a stop string found here)."""
        if output.request_id not in self._live:
            return  # dropped meanwhile
        row, engine = self._live[output.request_id]
        completion = output.outputs[0]
        drawn = list(completion.token_ids)
        logprobs = ([position[token].logprob for position, token in zip(completion.logprobs, drawn)]
                    if completion.logprobs is not None else [0.0] * len(drawn))
        finish = None
        for length in range(len(row.tokens) + 1, len(drawn) + 1):  # the first token that ends it, stop strings too
            row.tokens, row.logprobs = drawn[:length], logprobs[:length]
            finish = self._finish_reason(row)
            if finish is not None:
                break
        if finish is None and output.finished:  # ended for a reason of vLLM's own (none drawn, the context)
            finish = "length" if completion.finish_reason == "length" else "stop"
        if finish is None:
            return
        if not output.finished:
            engine.llm.llm_engine.abort_request([output.request_id])
        del self._live[output.request_id]
        self._complete(row, finish)

    def _drop_gone(self) -> None:
        for request_id, (row, engine) in list(self._live.items()):
            if row.gone:
                engine.llm.llm_engine.abort_request([request_id])
                del self._live[request_id]
