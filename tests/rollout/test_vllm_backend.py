"""The vLLM rollout backend.

Everything but vLLM itself is checked on any machine: the config's errors, the conversion of vLLM's
outputs into a Generation, the exported base weights, change detection, and the sampler's whole
protocol (engines, adapter versions, weight pushes, request layout) against a stand-in ``vllm`` module
inside a real training step. The tests marked ``gpu`` run the real engine and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import random
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.config import ConfigError, RolloutConfig, config_from_dict, load_config
from teamrl.models.tiny import tiny_tokenizer
from teamrl.rollout.generate import encode_prompts, generate_team
from teamrl.rollout.vllm_backend import (
    VLLMBackend,
    VLLMSampler,
    export_model,
    generation_from_outputs,
    vllm_lora_rank,
    weights_version,
)
from teamrl.train import Trainer

WORDS = "a b c d e f".split()
PAD, EOS = 0, 1  # tiny_tokenizer: <pad>, <eos>, <unk>, then the words


# ------------------------------------------------------------------------------------------------
# config
# ------------------------------------------------------------------------------------------------


def test_vllm_backend_without_a_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as err:
        config_from_dict({"rollout": {"backend": "vllm"}})
    message = str(err.value)
    assert message.startswith("rollout.backend: ") and "\n" not in message
    assert "NVIDIA GPU" in message and 'pip install "teamrl[vllm]"' in message


def test_vllm_backend_without_the_package_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r'^rollout\.backend: .*pip install "teamrl\[vllm\]"'):
        config_from_dict({"rollout": {"backend": "vllm"}})


@pytest.mark.parametrize("field, value, rule", [
    ("gpu_memory_utilization", 0, "must be in (0, 1]"),
    ("gpu_memory_utilization", 1.5, "must be in (0, 1]"),
    ("max_model_len", -1, "must be >= 0"),
    ("backend", "sglang", "is not one of"),
])
def test_rollout_fields_are_checked(field, value, rule):
    with pytest.raises(ConfigError, match=rf"^rollout\.{field}: ") as err:
        config_from_dict({"rollout": {field: value}})
    assert rule in str(err.value)


def test_rollout_defaults_to_transformers_and_round_trips_overrides():
    assert config_from_dict({}).rollout.backend == "transformers"
    config = load_config(None, ["rollout.gpu_memory_utilization=0.25", "rollout.sleep_between_rollouts=true"])
    assert config.rollout == RolloutConfig(gpu_memory_utilization=0.25, sleep_between_rollouts=True)


def test_transformers_backend_samples_in_this_process(tiny_config):
    from teamrl.backend import LocalBackend

    assert type(Trainer(tiny_config(steps=1)).agents) is LocalBackend


def _vllm_trainer(tiny_config, **overrides) -> Trainer:
    """A Trainer on the vLLM backend (with the fake_vllm fixture, on this GPU-less machine)."""
    rollout = {"backend": "vllm", **overrides.pop("rollout", {})}
    with pytest.MonkeyPatch.context() as patch:  # the config's check that vLLM can run here
        patch.setattr(torch.cuda, "is_available", lambda: True)
        find_spec = importlib.util.find_spec
        patch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
        config = tiny_config(rollout=rollout, **overrides)
    return Trainer(config)


# ------------------------------------------------------------------------------------------------
# vLLM outputs -> Generation
# ------------------------------------------------------------------------------------------------


def completion(token_ids: list[int], logprobs: list[float] | None = None) -> SimpleNamespace:
    """A stand-in for vLLM's CompletionOutput: the sampled ids and, per position, {sampled id: Logprob}."""
    values = logprobs if logprobs is not None else [-0.1 * (k + 1) for k in range(len(token_ids))]
    return SimpleNamespace(token_ids=token_ids, logprobs=[
        {token: SimpleNamespace(logprob=value), 99: SimpleNamespace(logprob=-9.0)}  # a top-k entry: ignored
        for token, value in zip(token_ids, values)])


def test_outputs_become_a_generation_laid_out_like_generate():
    tokenizer = tiny_tokenizer(WORDS)
    a, b, c, d = (tokenizer.convert_tokens_to_ids(w) for w in "abcd")
    prompt_ids = torch.tensor([[PAD, a, b], [c, d, EOS]])  # left-padded; a chat prompt may end with EOS
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    outputs = [
        SimpleNamespace(outputs=[completion([c, EOS]), completion([d, d, d, d])]),   # stopped; length-capped
        SimpleNamespace(outputs=[completion([EOS]), completion([a, EOS, b], [-1.0, -2.0, -3.0])]),
    ]
    gen = generation_from_outputs(outputs, prompt_ids, prompt_mask, 2, [EOS], tokenizer)

    assert gen.prompt_ids.tolist() == [[PAD, a, b]] * 2 + [[c, d, EOS]] * 2  # 2 consecutive rows per prompt
    assert gen.prompt_mask.tolist() == [[0, 1, 1]] * 2 + [[1, 1, 1]] * 2
    assert gen.completion_ids.tolist() == [[c, EOS, PAD, PAD], [d, d, d, d], [EOS, PAD, PAD, PAD], [a, EOS, b, PAD]]
    # up to and including the first EOS; nothing after it is trained, even a token vLLM returned
    assert gen.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    expected = torch.tensor([[-0.1, -0.2, 0, 0], [-0.1, -0.2, -0.3, -0.4], [-0.1, 0, 0, 0], [-1.0, -2.0, 0, 0]])
    torch.testing.assert_close(gen.sampling_logprobs, expected)
    assert gen.texts == ["c", "d d d d", "", "a"]
    assert gen.num_tokens == 9


def test_padding_of_a_short_row_is_never_trained_when_pad_is_not_eos():
    tokenizer = tiny_tokenizer(WORDS)
    a = tokenizer.convert_tokens_to_ids("a")
    outputs = [SimpleNamespace(outputs=[completion([a, a, a]), completion([a])])]  # the second hit max_model_len
    gen = generation_from_outputs(outputs, torch.tensor([[a]]), torch.tensor([[1]]), 2, [EOS], tokenizer)
    assert gen.completion_ids.tolist() == [[a, a, a], [a, PAD, PAD]]
    assert gen.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_missing_logprobs_give_zeros_and_a_wrong_count_is_an_error():
    tokenizer = tiny_tokenizer(WORDS)
    a = tokenizer.convert_tokens_to_ids("a")
    bare = SimpleNamespace(token_ids=[a, EOS], logprobs=None)
    gen = generation_from_outputs([SimpleNamespace(outputs=[bare])], torch.tensor([[a]]), torch.tensor([[1]]), 1,
                                  [EOS], tokenizer)
    assert gen.sampling_logprobs.tolist() == [[0.0, 0.0]] and gen.completion_mask.tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="expected 2 completions for each of 1 prompts, got 1"):
        generation_from_outputs([SimpleNamespace(outputs=[bare])], torch.tensor([[a]]), torch.tensor([[1]]), 2,
                                [EOS], tokenizer)


def test_vllm_lora_rank_is_the_smallest_allowed_one_that_fits():
    assert [vllm_lora_rank(r) for r in (1, 8, 9, 64, 300, 512)] == [8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="team.lora.r"):
        vllm_lora_rank(513)


# ------------------------------------------------------------------------------------------------
# what gets synced: exported weights and change detection
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("training", ["lora", "full"])
def test_exported_model_is_what_vllm_must_serve(tiny_config, tmp_path, training):
    trainer = Trainer(tiny_config(steps=1, team={"training": training}))
    agent = trainer.team[0]
    with torch.no_grad():
        for p in agent.parameters:  # a trained agent: for LoRA, adapters that change the output
            p.add_(torch.randn_like(p) * 0.3)
    ids = agent.tokenizer("target 9 first", return_tensors="pt").input_ids
    exported = AutoModelForCausalLM.from_pretrained(export_model(agent, tmp_path / "model"))
    # LoRA: the base with every adapter off (vLLM applies the adapters itself); full: the model as it is
    served = agent.reference() if training == "lora" else contextlib.nullcontext(agent.model)
    with torch.no_grad(), served as model:
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(exported(input_ids=ids).logits, expected)
    if training == "lora":
        assert not any("lora" in name for name in exported.state_dict())


def test_weights_version_changes_with_every_update_and_checkpoint_load_only(tiny_config, tmp_path):
    config = tiny_config(steps=1, team={"training": "lora"})
    trainer = Trainer(config)
    agent = trainer.team[0]
    before = weights_version(agent)
    trainer.evaluate(max_items=2)  # sampling and forward passes write no weights
    assert weights_version(agent) == before
    trainer.train()  # one update, then the final checkpoint
    assert weights_version(agent) != before

    fresh = weights_version(Trainer(tiny_config(steps=1, team={"training": "lora"},
                                                run_dir=str(tmp_path / "fresh"))).team[0])
    resumed = Trainer(config, resume=True)  # loads the checkpoint; no step is left to run
    assert resumed.step == 1 and weights_version(resumed.team[0]) != fresh


# ------------------------------------------------------------------------------------------------
# the sampler against a stand-in vllm module
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeSamplingParams(SimpleNamespace):
    pass


class FakeLLM:
    """Records how teamrl drives vLLM's ``LLM`` and answers with random completions that honour the params."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        self.calls: list[tuple[list, list, list | None]] = []
        self.loaded: list[list[str]] = []
        self.events: list[str] = []
        self.rng = random.Random(0)

    def generate(self, prompts, sampling_params, *, use_tqdm=True, lora_request=None):
        self.events.append("generate")
        self.calls.append((prompts, sampling_params, lora_request))
        if lora_request is not None:  # the adapter must be on disk when vLLM is asked to load it
            assert all(Path(r.lora_path, "adapter_model.safetensors").is_file() for r in lora_request)
        return [SimpleNamespace(outputs=[self._complete(params) for _ in range(params.n)])
                for params in sampling_params]

    def _complete(self, params) -> SimpleNamespace:
        tokens = []
        while len(tokens) < params.max_tokens:
            tokens.append(self.rng.choice([*params.stop_token_ids, 3, 4, 5, 6]))
            if tokens[-1] in params.stop_token_ids:
                break  # vLLM keeps the stop token in token_ids
        return completion(tokens, [-self.rng.random() for _ in tokens])

    def apply_model(self, fn):
        return [fn(SimpleNamespace(load_weights=lambda weights: self.loaded.append([n for n, _ in weights])))]

    def sleep(self, level):
        self.events.append(f"sleep{level}")

    def wake_up(self):
        self.events.append("wake_up")


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module with LLM, SamplingParams and vllm.lora.request.LoRARequest; yields the engines made."""
    engines: list[FakeLLM] = []

    def make_llm(**kwargs):
        engines.append(FakeLLM(**kwargs))
        return engines[-1]

    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = make_llm, FakeSamplingParams
    lora, request = types.ModuleType("vllm.lora"), types.ModuleType("vllm.lora.request")
    request.LoRARequest = FakeLoRARequest
    for name, value in {"vllm": module, "vllm.lora": lora, "vllm.lora.request": request}.items():
        monkeypatch.setitem(sys.modules, name, value)
    return engines


def test_lora_team_trains_with_adapters_synced_after_every_update(tiny_config, fake_vllm):
    trainer = _vllm_trainer(tiny_config, steps=3, team={"training": "lora", "lora": {"r": 4}},
                            rollout={"gpu_memory_utilization": 0.3})
    sampler = trainer.agents.sampler

    metrics = trainer.train_step()
    assert math.isfinite(metrics["loss"]) and metrics["tokens/generated"] > 0
    (engine,) = fake_vllm  # one engine: both adapters sit on one base
    assert engine.multiprocessing == "0" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    kwargs = engine.kwargs
    assert kwargs["enable_lora"] and kwargs["max_loras"] == 2 and kwargs["max_lora_rank"] == 8
    assert kwargs["skip_tokenizer_init"] and kwargs["dtype"] == "float32" and kwargs["gpu_memory_utilization"] == 0.3
    assert kwargs["logprobs_mode"] == "processed_logprobs" and "max_model_len" not in kwargs
    exported = AutoModelForCausalLM.from_pretrained(kwargs["model"])
    assert not any("lora" in name for name in exported.state_dict())

    # one generate call for the whole team, every request on its own agent's adapter, prompts unpadded
    config = trainer.config
    (prompts, params, adapters), = engine.calls
    items = config.items_per_step
    assert len(prompts) == len(params) == len(adapters) == 2 * items
    assert [a.lora_name for a in adapters] == ["first-v1"] * items + ["second-v2"] * items
    first = trainer.team[0]
    observations = [trainer.env.observe(item) for item in trainer._last_tree.turns[0].items]
    ids, mask = encode_prompts(first, [first.prompt(obs[0]) for obs in observations])
    assert [p["prompt_token_ids"] for p in prompts[:items]] == [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    sampling = params[0]
    assert (sampling.n, sampling.max_tokens, sampling.top_k, sampling.logprobs) == (8, 4, 0, 0)
    assert sampling.stop_token_ids == first.eos_token_ids and not sampling.detokenize
    assert len({p.seed for p in params}) == len(params)  # no two requests share a random stream

    trainer.train_step()  # the update changed both adapters: new versions, new ids, old files gone
    (_, _, adapters) = engine.calls[-1]
    assert {a.lora_name for a in adapters} == {"first-v3", "second-v4"}
    assert not (sampler.root / "first-v1").exists() and (sampler.root / "first-v3").is_dir()

    trainer.evaluate(max_items=2)  # samples the weights of the second update
    assert {a.lora_int_id for a in engine.calls[-1][2]} == {5, 6}
    trainer.evaluate(max_items=2)  # no update since: nothing is rewritten
    assert {a.lora_int_id for a in engine.calls[-1][2]} == {5, 6}
    assert len(fake_vllm) == 1 and not engine.loaded


def test_full_fine_tuning_pushes_weights_and_sleeps_between_rollouts(tiny_config, fake_vllm):
    trainer = _vllm_trainer(tiny_config, steps=2, team={"training": "full"},
                            rollout={"sleep_between_rollouts": True, "max_model_len": 256})
    trainer.train_step()
    assert len(fake_vllm) == 2  # each agent owns its model: an engine each
    for engine in fake_vllm:
        assert engine.kwargs["enable_sleep_mode"] and engine.kwargs["max_model_len"] == 256
        assert "enable_lora" not in engine.kwargs and engine.calls[0][2] is None
        assert not engine.loaded  # started from the current weights: nothing to push yet
    trainer.train_step()
    names = set(trainer.team[0].model.state_dict())
    for engine in fake_vllm:
        (pushed,) = engine.loaded  # once, after the update, every weight by its transformers name
        assert set(pushed) == names
        assert engine.events == ["generate", "sleep1", "wake_up", "generate", "sleep1"]


def test_config_picks_the_vllm_backend(tiny_config, fake_vllm):
    trainer = _vllm_trainer(tiny_config, steps=1)
    assert isinstance(trainer.agents, VLLMBackend) and isinstance(trainer.agents.sampler, VLLMSampler)
    assert not fake_vllm  # engines start at the first rollout


def test_sampler_generations_match_the_transformers_layout(tiny_config, fake_vllm, tmp_path):
    trainer = Trainer(tiny_config(steps=1, team={"training": "lora"}))
    prompts = [[agent.prompt(obs[i]) for obs in (trainer.env.observe(it) for it in trainer.items[:3])]
               for i, agent in enumerate(trainer.team)]
    expected = generate_team(trainer.team, prompts, 2)
    sampler = VLLMSampler(RolloutConfig(backend="vllm"), workdir=tmp_path)
    got = sampler.generate_team(trainer.team, prompts, 2)
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine.prompt_ids, theirs.prompt_ids) and torch.equal(mine.prompt_mask, theirs.prompt_mask)
        assert mine.completion_ids.shape[0] == theirs.completion_ids.shape[0] == 6
        assert (mine.sampling_logprobs[mine.completion_mask == 0] == 0).all()
    for _ in range(2):
        sampler.generate_team(trainer.team, prompts, 2, seed=5)
    first, second = ([params.seed for params in call[1]] for call in fake_vllm[0].calls[-2:])
    assert first == second and len(set(first)) == len(first)  # a seed fixes every request's stream


# ------------------------------------------------------------------------------------------------
# on a GPU, with vLLM
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("training", ["lora", "full"])
def test_vllm_samples_the_policy_that_is_being_trained(tiny_config, tmp_path, training):
    """vLLM's log-probs of its samples match the training forward pass, before and after the weights change."""
    pytest.importorskip("vllm", reason="vllm not installed")
    trainer = Trainer(tiny_config(steps=1, team={"model": "bundled", "training": training, "device": "cuda",
                                                 "sampling": {"max_new_tokens": 16}}))
    sampler = VLLMSampler(RolloutConfig(backend="vllm", gpu_memory_utilization=0.3), workdir=tmp_path)
    prompts = [[agent.prompt(obs[i]) for obs in (trainer.env.observe(it) for it in trainer.items[:2])]
               for i, agent in enumerate(trainer.team)]

    def mismatch() -> float:
        worst = 0.0
        for agent, gen in zip(trainer.team, sampler.generate_team(trainer.team, prompts, 2)):
            agent.activate()
            with torch.no_grad():
                trained = token_logprobs(agent.model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                         gen.completion_mask, agent.sampling.temperature)
            on = gen.completion_mask.bool()
            assert on.any() and len(gen.texts) == 4
            worst = max(worst, float((trained[on] - gen.sampling_logprobs[on]).abs().mean()))
        return worst

    assert mismatch() < 0.02
    with torch.no_grad():
        for agent in trainer.team:
            for p in agent.parameters:
                p.add_(torch.randn_like(p) * (0.5 if training == "lora" else 0.01))
    assert mismatch() < 0.02  # the engine serves the changed weights, not the old ones
