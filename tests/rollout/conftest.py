"""A strict stand-in for the parts of the ``vllm`` package that teamrl calls, for machines without vLLM.

Every class and method has vLLM's own signature (a subset of its parameters, no ``**kwargs``), and does vLLM's
own checks, copied from its source (0.10.2 and 0.33): ``EngineArgs``' LoRA ranks, ``logprobs_mode`` values
and dtypes, one sleep-mode engine per process, each engine's start-up check that the GPU's free memory covers
its ``gpu_memory_utilization``; ``SamplingParams``' ranges (temperature <= 2, below 0.01 raised to 0.01);
``LoRARequest``'s id >= 1; adapters cached by id and refused above ``max_lora_rank``. Its prefix cache goes
stale as vLLM's does: prompt blocks are keyed by tokens and adapter, kept across ``load_weights``, and cleared
only by ``sleep()`` and ``reset_prefix_cache()``; a request whose prompt is cached is answered from what the
cached weights computed. Completions are random tokens drawn from the request's seed and those weights.

tests/rollout/test_vllm_contract.py compares these signatures and fields with the real package's where vLLM
is installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import random
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's ``LoRAConfig.max_lora_rank`` values (0.10.2 to 0.33; 0.33 also takes 1)."""
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
MIN_TEMPERATURE = 0.01  # vLLM's _MAX_TEMP: a smaller positive temperature is raised to it, with a warning
TRAINING_SHARE = 0.05
"""The share of the stand-in GPU that training holds before any engine starts (CUDA context, the agents)."""


# ------------------------------------------------------------------------------------------------
# vllm.SamplingParams, vllm.lora.request.LoRARequest, and what generate returns
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SamplingParams:
    """vLLM's ``SamplingParams`` fields that teamrl sets, with vLLM's defaults and checks (``_verify_args``)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if not all(isinstance(token, int) for token in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if self.temperature < 1e-5 and self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")


@dataclasses.dataclass
class LoRARequest:
    """vLLM's ``LoRARequest``: an adapter on disk, cached by the engine under ``lora_int_id``."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("lora_path cannot be empty")


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


# ------------------------------------------------------------------------------------------------
# vllm.LLM
# ------------------------------------------------------------------------------------------------


class FakeGPU:
    """One GPU's memory, in shares of its total, and vLLM's one-per-process sleep-mode allocator."""

    def __init__(self) -> None:
        self.in_use = TRAINING_SHARE
        self.sleep_mode_engines = 0

    def reserve(self, share: float) -> None:
        """vLLM's start-up check (its GPU worker): the free memory must cover the engine's whole share."""
        free = 1.0 - self.in_use
        if free < share:
            raise ValueError(f"Free memory on device ({free:.2f} of the GPU) on startup is less than desired GPU "
                             f"memory utilization ({share}). Decrease GPU memory utilization or reduce GPU memory "
                             "used by other processes.")
        self.in_use += share


class FakeModel:
    """The engine's model as ``apply_model`` hands it over: weights by vLLM's (here: transformers') names."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.pushes: list[list[str]] = []

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        pushed = list(weights)
        self.pushes.append([name for name, _ in pushed])
        loaded = set()
        for name, tensor in pushed:
            if name in self.weights:  # like vLLM's loaders, a tied lm_head is skipped
                self.weights[name] = tensor.detach().to("cpu", copy=True)
                loaded.add(name)
        return loaded

    def fingerprint(self) -> bytes:
        digest = hashlib.sha256()
        for name in sorted(self.weights):
            digest.update(name.encode())
            digest.update(self.weights[name].float().numpy().tobytes())
        return digest.digest()


class LLM:
    """vLLM's ``LLM`` for the arguments teamrl gives it; records what it was asked."""

    gpu: FakeGPU
    """Set per test by the ``fake_vllm`` fixture: the process's one GPU."""
    started: list[LLM]
    """Set per test by the ``fake_vllm`` fixture: every engine started, in order."""

    def __init__(self, model: str, *, skip_tokenizer_init: bool = False, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.9, enable_sleep_mode: bool = False,
                 logprobs_mode: str = "raw_logprobs", max_model_len: int | None = None,
                 enable_prefix_caching: bool | None = None, enable_lora: bool = False, max_lora_rank: int = 16,
                 max_loras: int = 1, max_cpu_loras: int | None = None):
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {dtype!r}")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if enable_lora:
            if max_lora_rank not in LORA_RANKS:
                raise ValueError(f"max_lora_rank ({max_lora_rank}) must be one of {LORA_RANKS}.")
            if max_loras < 1:
                raise ValueError(f"max_loras must be >= 1, got {max_loras}")
            if max_cpu_loras is not None and max_cpu_loras < max_loras:
                raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        if enable_sleep_mode:
            assert self.gpu.sleep_mode_engines == 0, "Sleep mode can only be used for one instance per process."
            self.gpu.sleep_mode_engines += 1
        self.gpu.reserve(gpu_memory_utilization)
        self.kwargs = dict(model=model, skip_tokenizer_init=skip_tokenizer_init, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                           logprobs_mode=logprobs_mode, max_model_len=max_model_len,
                           enable_prefix_caching=enable_prefix_caching, enable_lora=enable_lora,
                           max_lora_rank=max_lora_rank, max_loras=max_loras, max_cpu_loras=max_cpu_loras)
        """Every engine argument, as given or defaulted."""
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        self.model = FakeModel(dict(load_file(str(Path(model, "model.safetensors")))))
        self.prefix_caching = True if enable_prefix_caching is None else enable_prefix_caching
        self.prefix_cache: dict[tuple[int, tuple[int, ...]], bytes] = {}
        """(adapter id or 0, prompt tokens) -> the fingerprint of the weights that computed its keys and values."""
        self.adapters: dict[int, bytes] = {}
        """Adapter id -> the adapter's fingerprint when it was first requested (vLLM loads an id once)."""
        self.asleep = False
        self.calls: list[tuple[list, list, list | None]] = []
        self.events: list[str] = []
        self.rng = random.Random(0)
        self.llm_engine = LLMEngine(self)
        self.started.append(self)

    @property
    def loaded(self) -> list[list[str]]:
        """The names of every ``load_weights`` push, in order."""
        return self.model.pushes

    def generate(self, prompts: Sequence[dict[str, list[int]]], sampling_params: Sequence[SamplingParams] | None = None,
                 /, *, use_tqdm: bool | Callable[..., Any] = True,
                 lora_request: Sequence[LoRARequest] | LoRARequest | None = None) -> list[RequestOutput]:
        if self.asleep:
            raise RuntimeError("the engine is asleep: wake_up() first")
        self.events.append("generate")
        self.calls.append((prompts, sampling_params, lora_request))
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        adapters = lora_request if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError("Lists must have the same length as the prompts")
        weights = self.model.fingerprint()
        return [self._answer(i, prompt, request_params, adapter, weights)
                for i, (prompt, request_params, adapter) in enumerate(zip(prompts, params, adapters))]

    def apply_model(self, func: Callable[[FakeModel], Any]) -> list[Any]:
        self.events.append("apply_model")
        return [func(self.model)]

    def sleep(self, level: int = 1) -> None:
        assert self.kwargs["enable_sleep_mode"], "Sleep mode is not enabled in the model config"
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.events.append(f"sleep{level}")
        self.prefix_cache.clear()  # sleep frees the KV cache
        self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append("wake_up")
        self.asleep = False

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset_prefix_cache")
        self.prefix_cache.clear()
        return True

    # ----------------------------------------------------------------------------------------------
    def _answer(self, index: int, prompt: dict[str, list[int]], params: SamplingParams, adapter: LoRARequest | None,
                weights: bytes) -> RequestOutput:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if self.kwargs["skip_tokenizer_init"] and not isinstance(prompt, dict):
            raise ValueError("without a tokenizer (skip_tokenizer_init) a prompt must be {'prompt_token_ids': [...]}")
        tokens = prompt["prompt_token_ids"]
        if not tokens or not all(isinstance(token, int) for token in tokens):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ints, got {tokens!r}")
        computed_by = weights + self._adapter_fingerprint(adapter)
        key = (0 if adapter is None else adapter.lora_int_id, tuple(tokens))
        if self.prefix_caching:
            computed_by = self.prefix_cache.setdefault(key, computed_by)
        stream = random.Random(int.from_bytes(hashlib.sha256(
            computed_by + str(params.seed).encode()).digest()[:8], "big")) if params.seed is not None else self.rng
        completions = [self._complete(k, params, stream) for k in range(params.n)]
        return RequestOutput(request_id=str(index), prompt=None, prompt_token_ids=tokens, outputs=completions)

    def _adapter_fingerprint(self, adapter: LoRARequest | None) -> bytes:
        if adapter is None:
            return b""
        if not self.kwargs["enable_lora"]:
            raise ValueError(f"Got lora_request {adapter} but LoRA is not enabled!")
        if not isinstance(adapter, LoRARequest):
            raise TypeError(f"lora_request must be LoRARequest, got {type(adapter).__name__}")
        if adapter.lora_int_id not in self.adapters:  # loaded once per id; a changed file under an old id is unseen
            path = Path(adapter.lora_path)
            rank = json.loads((path / "adapter_config.json").read_text())["r"]
            if rank > self.kwargs["max_lora_rank"]:
                raise ValueError(f"LoRA rank {rank} is greater than max_lora_rank {self.kwargs['max_lora_rank']}.")
            self.adapters[adapter.lora_int_id] = hashlib.sha256(
                (path / "adapter_model.safetensors").read_bytes()).digest()
        return self.adapters[adapter.lora_int_id]

    def _complete(self, index: int, params: SamplingParams, stream: random.Random) -> CompletionOutput:
        tokens: list[int] = []
        while len(tokens) < params.max_tokens:
            tokens.append(stream.choice([*params.stop_token_ids, 3, 4, 5, 6]))
            if tokens[-1] in params.stop_token_ids:
                break  # vLLM keeps the stop token in token_ids
        logprobs = None
        if params.logprobs is not None:  # the sampled token's, and none of the top-k with logprobs=0
            logprobs = [{token: Logprob(-stream.random(), rank=1)} for token in tokens]
        return CompletionOutput(index=index, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                                finish_reason="stop" if tokens and tokens[-1] in params.stop_token_ids else "length")


class LLMEngine:
    """vLLM's ``LLMEngine`` (``LLM.llm_engine``) as teamrl's gateway drives it: requests added at any time, each
    engine step drawing one more token of every request in flight and returning their cumulative outputs (vLLM's
    default ``RequestOutputKind``), requests aborted by id. A request's tokens are what ``generate`` would draw
    for it (the same seed and weights), so the two paths can be compared."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.running: dict[str, tuple[RequestOutput, int]] = {}
        """Request id -> everything it will draw, and how many tokens of it were drawn so far."""
        self.added: list[tuple[str, list[int], SamplingParams, LoRARequest | None]] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.largest_batch = 0

    def add_request(self, request_id: str, prompt: dict[str, list[int]], params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        if self.llm.asleep:
            raise RuntimeError("the engine is asleep: wake_up() first")
        if request_id in self.running:
            raise ValueError(f"Request id {request_id} already running.")
        whole = self.llm._answer(0, prompt, params, lora_request, self.llm.model.fingerprint())
        if params.n != 1:
            raise ValueError("the stand-in's engine path samples n=1 requests")
        self.running[request_id] = (whole, 0)
        self.added.append((request_id, list(prompt["prompt_token_ids"]), params, lora_request))

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(self.running))
        outputs = []
        for request_id, (whole, drawn) in list(self.running.items()):
            completion, drawn = whole.outputs[0], drawn + 1
            finished = drawn >= len(completion.token_ids)
            partial = CompletionOutput(index=0, text="", token_ids=completion.token_ids[:drawn],
                                       cumulative_logprob=None,
                                       logprobs=None if completion.logprobs is None else completion.logprobs[:drawn],
                                       finish_reason=completion.finish_reason if finished else None)
            outputs.append(RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=whole.prompt_token_ids,
                                         outputs=[partial], finished=finished))
            if finished:
                del self.running[request_id]
            else:
                self.running[request_id] = (whole, drawn)
        return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.running.pop(request_id, None)
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def vllm_standin() -> types.ModuleType:
    """This module: the stand-in's classes, without installing them as ``vllm``."""
    return sys.modules[__name__]


@pytest.fixture
def fake_vllm(monkeypatch) -> list[LLM]:
    """The stand-in installed as ``vllm`` (``LLM``, ``SamplingParams``, ``vllm.lora.request.LoRARequest``) on a
    GPU of its own; yields the engines started, in order."""
    started: list[LLM] = []
    engine = type("LLM", (LLM,), {"gpu": FakeGPU(), "started": started})
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = engine, SamplingParams
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = LoRARequest
    for name, value in {"vllm": module, "vllm.lora": lora, "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, value)
    return started


@contextlib.contextmanager
def _vllm_can_run_here() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        find_spec = importlib.util.find_spec
        patch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
        yield


@pytest.fixture
def vllm_can_run_here() -> Callable[[], contextlib.AbstractContextManager]:
    """``with vllm_can_run_here(): ...``: the config's check that vLLM can run here (a CUDA GPU, the package)
    passes on this machine, inside the block."""
    return _vllm_can_run_here


@pytest.fixture
def vllm_trainer(tiny_config) -> Callable[..., Any]:
    """Factory: ``vllm_trainer(**overrides)`` -> a Trainer on the vLLM backend (with the fake_vllm fixture, on this
    GPU-less machine); ``rollout`` overrides add to ``backend: vllm``."""
    from teamrl.train import Trainer

    def make(**overrides: Any) -> Trainer:
        rollout = {"backend": "vllm", **overrides.pop("rollout", {})}
        with _vllm_can_run_here():
            config = tiny_config(rollout=rollout, **overrides)
        return Trainer(config)

    return make
