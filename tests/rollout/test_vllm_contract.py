"""teamrl's calls against the installed vLLM: every argument the vLLM backend emits is one this vLLM takes.

The backend builds its engine, request and adapter arguments with pure functions (``engine_kwargs``,
``sampling_kwargs``, ``lora_request_kwargs``); these tests compare them with vLLM's own ``EngineArgs`` fields,
``SamplingParams`` and ``LoRARequest`` fields (building real objects, so vLLM's own checks run), and drive the
sampler through an engine that binds every call to the real ``LLM`` method's signature. They also compare the
strict stand-in of conftest.py with the real classes, so that the CPU tests test against vLLM's interface.

They need the ``vllm`` package, not a GPU (no engine starts), and are skipped where it is not installed; run
them with the GPU tests after installing or upgrading vLLM (docs/vllm.md#checking-teamrl-against-your-vllm).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from teamrl.config import VLLM_TEMPERATURE_RANGE, RolloutConfig, SamplingConfig
from teamrl.rollout.vllm_sampler import (
    VLLM_LORA_RANKS,
    VLLMSampler,
    engine_kwargs,
    lora_request_kwargs,
    sampling_kwargs,
)
from teamrl.train import Trainer

vllm = pytest.importorskip("vllm", reason="vllm is not installed: the contract test checks teamrl against an "
                                          "installed vLLM (pip install -e '.[vllm,test]' on a GPU machine)")
from vllm.engine.arg_utils import EngineArgs  # noqa: E402  (after the skip)
from vllm.lora.request import LoRARequest  # noqa: E402

REAL_LLM = vllm.LLM
LLM_METHODS = ("generate", "apply_model", "sleep", "wake_up", "reset_prefix_cache")
ENGINE_METHODS = ("add_request", "step", "abort_request")
"""What the gateway calls on ``LLM.llm_engine`` (teamrl.rollout.vllm_continuous)."""


def field_names(cls: type) -> set[str]:
    """The fields of one of vLLM's argument classes: a dataclass (pydantic's too) or a msgspec struct."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(cls.__struct_fields__)


def allowed_values(name: str) -> tuple[Any, ...]:
    """The values of one of vLLM's config types (a Literal, or an Enum in some releases), wherever it lives."""
    for module in ("vllm.config", "vllm.config.model"):  # 0.10.2 has them in the first, 0.33 in the second
        try:
            kind = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if kind is None:
            continue
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return tuple(member.value for member in kind)
        return typing.get_args(kind)
    pytest.fail(f"this vLLM has no {name} in vllm.config: where did it go?")


def every_engine_kwargs() -> list[dict[str, Any]]:
    """Every shape of engine arguments the backend emits: a full model, LoRA adapters, sleep mode, a length cap."""
    return [
        engine_kwargs("/model", torch.bfloat16, gpu_memory_utilization=0.25, max_model_len=0, sleep_mode=False),
        engine_kwargs("/model", torch.float16, gpu_memory_utilization=0.5, max_model_len=1024, sleep_mode=True,
                      lora_rank=16, num_adapters=2),
    ]


# ------------------------------------------------------------------------------------------------
# the arguments, against vLLM's classes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", every_engine_kwargs())
def test_engine_kwargs_are_engine_args_fields_with_values_vllm_takes(kwargs):
    assert set(kwargs) <= field_names(EngineArgs), set(kwargs) - field_names(EngineArgs)
    EngineArgs(**kwargs)
    assert kwargs["logprobs_mode"] in allowed_values("LogprobsMode")
    assert kwargs["dtype"] in allowed_values("ModelDType")
    assert 0 < kwargs["gpu_memory_utilization"] <= 1


def test_every_lora_rank_teamrl_asks_for_is_one_vllm_takes():
    from vllm.config import LoRAConfig

    for rank in VLLM_LORA_RANKS:
        LoRAConfig(max_lora_rank=rank, max_loras=2, max_cpu_loras=2)  # vLLM's own check of max_lora_rank
    with pytest.raises(ValueError):
        LoRAConfig(max_lora_rank=12, max_loras=2, max_cpu_loras=2)  # what vllm_lora_rank rounds up from


@pytest.mark.parametrize("sampling", [
    SamplingConfig(),
    SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12),
    SamplingConfig(temperature=VLLM_TEMPERATURE_RANGE[0]),
    SamplingConfig(temperature=VLLM_TEMPERATURE_RANGE[1]),
])
def test_sampling_kwargs_build_real_sampling_params_unchanged(sampling):
    kwargs = sampling_kwargs(sampling, 4, [1, 2], seed=7)
    assert set(kwargs) <= field_names(vllm.SamplingParams), set(kwargs) - field_names(vllm.SamplingParams)
    params = vllm.SamplingParams(**kwargs)
    # vLLM samples as teamrl trains: nothing raised, clamped or dropped (temperatures in teamrl's vLLM range)
    assert {key: getattr(params, key) for key in kwargs} == kwargs


def test_lora_request_kwargs_build_a_real_lora_request(tmp_path):
    kwargs = lora_request_kwargs("first-v1", 1, tmp_path)
    assert set(kwargs) <= field_names(LoRARequest), set(kwargs) - field_names(LoRARequest)
    request = LoRARequest(**kwargs)
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("first-v1", 1, str(tmp_path))
    with pytest.raises(ValueError):
        LoRARequest(**lora_request_kwargs("first-v0", 0, tmp_path))  # why the sampler counts ids from 1


# ------------------------------------------------------------------------------------------------
# the calls, against vLLM's signatures
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Completion:
    token_ids: list[int]
    logprobs: list[dict[int, Any]] | None


@dataclasses.dataclass
class _Logprob:
    logprob: float


@dataclasses.dataclass
class _Output:
    outputs: list[_Completion]


class _CheckedModel:
    """The model ``apply_model`` hands over: its ``load_weights`` call is bound to vLLM's Llama's (the tiny model)."""

    def load_weights(self, *args, **kwargs) -> set[str]:
        from vllm.model_executor.models.llama import LlamaForCausalLM

        bound = inspect.signature(LlamaForCausalLM.load_weights).bind(self, *args, **kwargs)
        return {name for name, tensor in bound.arguments["weights"] if isinstance(tensor, torch.Tensor)}


class CheckedLLM:
    """``vllm.LLM`` for the sampler, without starting an engine: binds every call to the real method's signature,
    checks the arguments are vLLM's own objects, and answers each request with ``n`` short completions."""

    started: list[CheckedLLM] = []

    def __init__(self, *args, **kwargs):
        inspect.signature(REAL_LLM.__init__).bind(self, *args, **kwargs)
        assert set(kwargs) <= field_names(EngineArgs), set(kwargs) - field_names(EngineArgs)
        EngineArgs(**kwargs)
        self.calls: list[str] = []
        self.started.append(self)

    def _bind(self, method: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        self.calls.append(method)
        return inspect.signature(getattr(REAL_LLM, method)).bind(self, *args, **kwargs).arguments

    def generate(self, *args, **kwargs) -> list[_Output]:
        arguments = self._bind("generate", args, kwargs)
        prompts, params = arguments["prompts"], arguments["sampling_params"]
        adapters = arguments.get("lora_request")
        assert len(params) == len(prompts) and all(isinstance(p, vllm.SamplingParams) for p in params)
        assert all(set(prompt) == {"prompt_token_ids"} for prompt in prompts)  # vLLM's TokensPrompt
        assert all(isinstance(token, int) for prompt in prompts for token in prompt["prompt_token_ids"])
        if adapters is not None:
            assert len(adapters) == len(prompts) and all(isinstance(a, LoRARequest) for a in adapters)
            assert all(Path(a.lora_path, "adapter_config.json").is_file() for a in adapters)
        return [_Output([_Completion([p.stop_token_ids[0]], [{p.stop_token_ids[0]: _Logprob(-0.5)}])] * p.n)
                for p in params]

    def apply_model(self, *args, **kwargs) -> list[Any]:
        arguments = self._bind("apply_model", args, kwargs)
        return [arguments["func"](_CheckedModel())]

    def sleep(self, *args, **kwargs) -> None:
        self._bind("sleep", args, kwargs)

    def wake_up(self, *args, **kwargs) -> None:
        self._bind("wake_up", args, kwargs)

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        self._bind("reset_prefix_cache", args, kwargs)
        return True


@pytest.mark.parametrize("training, sleep", [("lora", True), ("full", False)])
def test_the_sampler_calls_vllm_only_as_its_signatures_allow(tiny_config, tmp_path, monkeypatch, training, sleep):
    monkeypatch.setattr(CheckedLLM, "started", [])
    monkeypatch.setattr(vllm, "LLM", CheckedLLM)
    trainer = Trainer(tiny_config(steps=1, team={"training": training}))
    prompts = [[agent.prompt(obs[i]) for obs in (trainer.env.observe(it) for it in trainer.items[:2])]
               for i, agent in enumerate(trainer.team)]
    sampler = VLLMSampler(RolloutConfig(backend="vllm", sleep_between_rollouts=sleep), workdir=tmp_path)
    sampler.generate_team(trainer.team, prompts, 2, seed=0)
    with torch.no_grad():
        for agent in trainer.team:
            for p in agent.parameters:
                p.add_(0.01)
    generations = sampler.generate_team(trainer.team, prompts, 2, seed=0)  # after a push
    assert all(gen.completion_ids.shape[0] == 4 for gen in generations)
    calls = {call for engine in CheckedLLM.started for call in engine.calls}
    assert calls == ({"generate", "sleep", "wake_up", "reset_prefix_cache"} if sleep
                     else {"generate", "apply_model", "reset_prefix_cache"})


# ------------------------------------------------------------------------------------------------
# the stand-in of the CPU tests, against vLLM
# ------------------------------------------------------------------------------------------------


def parameter_names(function: Any) -> set[str]:
    return {name for name, p in inspect.signature(function).parameters.items()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@pytest.mark.parametrize("method", LLM_METHODS)
def test_the_stand_in_llm_methods_take_a_subset_of_vllms_parameters(vllm_standin, method):
    mine, theirs = parameter_names(getattr(vllm_standin.LLM, method)), parameter_names(getattr(REAL_LLM, method))
    assert mine <= theirs, mine - theirs


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_the_stand_in_llm_engine_methods_take_a_subset_of_vllms_parameters(vllm_standin, method):
    mine = parameter_names(getattr(vllm_standin.LLMEngine, method))
    theirs = parameter_names(getattr(vllm.LLMEngine, method))
    assert mine <= theirs, mine - theirs


def test_the_stand_in_engine_arguments_and_argument_classes_are_vllms(vllm_standin):
    engine = parameter_names(vllm_standin.LLM.__init__) - {"self"}
    assert engine <= field_names(EngineArgs), engine - field_names(EngineArgs)
    for standin, real in ((vllm_standin.SamplingParams, vllm.SamplingParams), (vllm_standin.LoRARequest, LoRARequest)):
        assert field_names(standin) <= field_names(real), field_names(standin) - field_names(real)
