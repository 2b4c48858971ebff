"""The vLLM rollout backend.

Everything but vLLM itself is checked on any machine: the config's errors, the conversion of vLLM's
outputs into a Generation, the exported base weights, change detection, and the sampler's whole
protocol (engines, adapter versions, weight pushes, prefix-cache resets, request layout) against the strict
stand-in ``vllm`` of conftest.py inside a real training step. The tests marked ``gpu`` run the real engine and
skip elsewhere; test_vllm_contract.py checks teamrl's arguments against the installed vLLM.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.backends.vllm import VLLMBackend
from teamrl.config import ConfigError, RolloutConfig, SamplingConfig, config_from_dict, load_config
from teamrl.models.tiny import tiny_model, tiny_tokenizer
from teamrl.rollout.generate import encode_prompts, generate_team
from teamrl.rollout.vllm_sampler import (
    VLLMSampler,
    engine_kwargs,
    engine_memory_share,
    export_model,
    generation_from_outputs,
    lora_request_kwargs,
    sampling_kwargs,
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


@pytest.mark.parametrize("sampling, agents, field", [
    ({"temperature": 2.5}, [{"name": "a"}, {"name": "b"}], "team.sampling.temperature"),
    ({"temperature": 0.005}, [{"name": "a"}, {"name": "b"}], "team.sampling.temperature"),
    ({}, [{"name": "a"}, {"name": "b", "sampling": {"temperature": 3.0}}], r"team.agents\[1\].sampling.temperature"),
])
def test_vllm_refuses_temperatures_it_would_reject_or_change(tiny_config_data, sampling, agents, field,
                                                            vllm_can_run_here):
    data = tiny_config_data(team={"training": "lora", "sampling": sampling, "agents": agents},
                            rollout={"backend": "vllm"})
    with vllm_can_run_here(), pytest.raises(ConfigError, match=rf"^{field}: must be in \[0.01, 2.0\]") as err:
        config_from_dict(data)
    assert "rollout.backend='vllm'" in str(err.value) and "\n" not in str(err.value)
    data["rollout"]["backend"] = "transformers"
    config_from_dict(data)  # transformers samples at any temperature > 0


def test_sleep_mode_with_more_than_one_engine_is_refused_at_load_time(tiny_config_data, vllm_can_run_here):
    full = tiny_config_data(team={"training": "full"}, rollout={"backend": "vllm", "sleep_between_rollouts": True})
    with vllm_can_run_here(), pytest.raises(ConfigError) as err:
        config_from_dict(full)  # a fully fine-tuned team of two: an engine each
    message = str(err.value)
    assert message.startswith("rollout.sleep_between_rollouts: vLLM allows one sleep-mode engine per process and "
                              "this team needs 2") and "\n" not in message
    with vllm_can_run_here():  # LoRA agents on one base: one engine
        assert config_from_dict({**full, "team": {**full["team"], "training": "lora"}}).rollout.sleep_between_rollouts


def test_transformers_backend_samples_in_this_process(tiny_config):
    from teamrl.backends.local import LocalBackend

    assert type(Trainer(tiny_config(steps=1)).agents) is LocalBackend


# ------------------------------------------------------------------------------------------------
# vLLM outputs -> Generation
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def outputs(vllm_standin):
    """``outputs(completions, ...)``: a stand-in RequestOutput of those completions; ``outputs.completion(ids,
    logprobs)`` one CompletionOutput, with the sampled ids and per position {sampled id: Logprob, a top-k entry}."""
    vllm = vllm_standin

    def completion(token_ids: list[int], logprobs: list[float] | None = None):
        values = logprobs if logprobs is not None else [-0.1 * (k + 1) for k in range(len(token_ids))]
        return vllm.CompletionOutput(index=0, text="", token_ids=token_ids, cumulative_logprob=None, logprobs=[
            {token: vllm.Logprob(value), 99: vllm.Logprob(-9.0)}  # the top-k entry is ignored
            for token, value in zip(token_ids, values)])

    def request_output(*completions):
        return vllm.RequestOutput(request_id="0", prompt=None, prompt_token_ids=[3], outputs=list(completions))

    request_output.completion = completion
    return request_output


def test_outputs_become_a_generation_laid_out_like_generate(outputs):
    tokenizer = tiny_tokenizer(WORDS)
    a, b, c, d = (tokenizer.convert_tokens_to_ids(w) for w in "abcd")
    prompt_ids = torch.tensor([[PAD, a, b], [c, d, EOS]])  # left-padded; a chat prompt may end with EOS
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion = outputs.completion
    answers = [
        outputs(completion([c, EOS]), completion([d, d, d, d])),   # stopped; length-capped
        outputs(completion([EOS]), completion([a, EOS, b], [-1.0, -2.0, -3.0])),
    ]
    gen = generation_from_outputs(answers, prompt_ids, prompt_mask, 2, [EOS], tokenizer)

    assert gen.prompt_ids.tolist() == [[PAD, a, b]] * 2 + [[c, d, EOS]] * 2  # 2 consecutive rows per prompt
    assert gen.prompt_mask.tolist() == [[0, 1, 1]] * 2 + [[1, 1, 1]] * 2
    assert gen.completion_ids.tolist() == [[c, EOS, PAD, PAD], [d, d, d, d], [EOS, PAD, PAD, PAD], [a, EOS, b, PAD]]
    # up to and including the first EOS; nothing after it is trained, even a token vLLM returned
    assert gen.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    expected = torch.tensor([[-0.1, -0.2, 0, 0], [-0.1, -0.2, -0.3, -0.4], [-0.1, 0, 0, 0], [-1.0, -2.0, 0, 0]])
    torch.testing.assert_close(gen.sampling_logprobs, expected)
    assert gen.texts == ["c", "d d d d", "", "a"]
    assert gen.num_tokens == 9


def test_padding_of_a_short_row_is_never_trained_when_pad_is_not_eos(outputs):
    tokenizer = tiny_tokenizer(WORDS)
    a = tokenizer.convert_tokens_to_ids("a")
    answers = [outputs(outputs.completion([a, a, a]), outputs.completion([a]))]  # the second hit max_model_len
    gen = generation_from_outputs(answers, torch.tensor([[a]]), torch.tensor([[1]]), 2, [EOS], tokenizer)
    assert gen.completion_ids.tolist() == [[a, a, a], [a, PAD, PAD]]
    assert gen.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_missing_logprobs_give_zeros_and_a_wrong_count_is_an_error(outputs):
    tokenizer = tiny_tokenizer(WORDS)
    a = tokenizer.convert_tokens_to_ids("a")
    bare = outputs.completion([a, EOS])
    bare.logprobs = None  # as vLLM answers a request with logprobs=None
    gen = generation_from_outputs([outputs(bare)], torch.tensor([[a]]), torch.tensor([[1]]), 1, [EOS], tokenizer)
    assert gen.sampling_logprobs.tolist() == [[0.0, 0.0]] and gen.completion_mask.tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="expected 2 completions for each of 1 prompts, got 1"):
        generation_from_outputs([outputs(bare)], torch.tensor([[a]]), torch.tensor([[1]]), 2, [EOS], tokenizer)


def test_vllm_lora_rank_is_the_smallest_allowed_one_that_fits():
    assert [vllm_lora_rank(r) for r in (1, 8, 9, 64, 300, 512)] == [8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="team.lora.r"):
        vllm_lora_rank(513)


# ------------------------------------------------------------------------------------------------
# the arguments teamrl gives vLLM (test_vllm_contract.py checks them against the real vLLM)
# ------------------------------------------------------------------------------------------------


def test_engine_kwargs_for_a_full_model_and_for_lora_adapters():
    full = engine_kwargs("/m", torch.bfloat16, gpu_memory_utilization=0.25, max_model_len=0, sleep_mode=False)
    assert full == {"model": "/m", "skip_tokenizer_init": True, "dtype": "bfloat16", "gpu_memory_utilization": 0.25,
                    "logprobs_mode": "processed_logprobs", "enable_sleep_mode": False}
    lora = engine_kwargs("/m", torch.float32, gpu_memory_utilization=0.5, max_model_len=512, sleep_mode=True,
                         lora_rank=20, num_adapters=3)
    assert lora == {**full, "dtype": "float32", "gpu_memory_utilization": 0.5, "enable_sleep_mode": True,
                    "max_model_len": 512, "enable_lora": True, "max_lora_rank": 32, "max_loras": 3, "max_cpu_loras": 3}


def test_engines_split_the_configured_share_of_the_gpu():
    assert engine_memory_share(0.5, 1) == 0.5 and engine_memory_share(0.5, 2) == 0.25


def test_sampling_and_lora_request_kwargs(vllm_standin, tmp_path):
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=12)
    kwargs = sampling_kwargs(sampling, 4, [1, 2], seed=7)
    assert kwargs == {"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 12, "stop_token_ids": [1, 2],
                      "logprobs": 0, "detokenize": False, "seed": 7}
    vllm_standin.SamplingParams(**kwargs)  # the stand-in's copy of vLLM's checks accepts them
    request = vllm_standin.LoRARequest(**lora_request_kwargs("first-v1", 1, tmp_path))
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("first-v1", 1, str(tmp_path))


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


@pytest.mark.parametrize("make, error", [
    (lambda v, d: v.LLM(d, enable_lora=True, max_lora_rank=4), "max_lora_rank"),
    (lambda v, d: v.LLM(d, logprobs_mode="logprobs"), "logprobs_mode"),
    (lambda v, d: v.LLM(d, gpu_memory_utilization=0.96), "Free memory on device"),
    (lambda v, d: [v.LLM(d, enable_sleep_mode=True, gpu_memory_utilization=0.1) for _ in range(2)], "Sleep mode"),
    (lambda v, d: v.SamplingParams(temperature=2.5), "temperature must be in"),
    (lambda v, d: v.SamplingParams(logprobs=-2), "logprobs"),
    (lambda v, d: v.LoRARequest("a", 0, "/adapter"), "id must be > 0"),
])
def test_the_stand_in_refuses_what_vllm_refuses(fake_vllm, tmp_path, make, error):
    import vllm  # the stand-in, as the sampler imports it
    from vllm.lora.request import LoRARequest

    vllm.LoRARequest = LoRARequest  # monkeypatched module: gone after the test
    tiny_model(16).save_pretrained(tmp_path)
    with pytest.raises((ValueError, AssertionError), match=error):
        make(vllm, str(tmp_path))
    assert vllm.SamplingParams(temperature=0.001).temperature == 0.01  # vLLM raises it, with a warning


def test_lora_team_trains_with_adapters_synced_after_every_update(fake_vllm, vllm_trainer):
    trainer = vllm_trainer(steps=3, team={"training": "lora", "lora": {"r": 4}},
                            rollout={"gpu_memory_utilization": 0.3})
    sampler = trainer.agents.sampler

    metrics = trainer.train_step()
    assert math.isfinite(metrics["loss"]) and metrics["tokens/generated"] > 0
    (engine,) = fake_vllm  # one engine: both adapters sit on one base
    assert engine.multiprocessing == "0" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    kwargs = engine.kwargs
    assert kwargs["enable_lora"] and kwargs["max_loras"] == 2 and kwargs["max_lora_rank"] == 8
    # rollout.vllm_dtype auto: a float32 team samples in bfloat16 (vLLM in float32: twice the memory, no fast kernels)
    assert kwargs["skip_tokenizer_init"] and kwargs["dtype"] == "bfloat16" and kwargs["gpu_memory_utilization"] == 0.3
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["max_model_len"] is None
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
    assert all(isinstance(p, type(params[0])) for p in params)
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
    trainer.evaluate(max_items=2)  # no update since: nothing is rewritten, the prefix cache is kept
    assert {a.lora_int_id for a in engine.calls[-1][2]} == {5, 6}
    assert engine.events[-2:] == ["generate", "generate"]
    assert len(fake_vllm) == 1 and not engine.loaded


@pytest.mark.parametrize("team_dtype,vllm_dtype,engine", [("float32", "auto", "bfloat16"),
                                                           ("float16", "auto", "float16"),
                                                           ("float32", "float32", "float32"),
                                                           ("bfloat16", "auto", "bfloat16")])
def test_vllm_runs_in_16_bits_unless_asked_otherwise(vllm_trainer, fake_vllm, team_dtype, vllm_dtype, engine, caplog):
    """Also a bfloat16 team trained fully, whose weights are float32 (master weights, teamrl.models.precision)."""
    trainer = vllm_trainer(steps=1, team={"dtype": team_dtype}, rollout={"vllm_dtype": vllm_dtype})
    trainer.agents.sample([["target 9"], ["target 9"]], 2, 0)
    assert [e.kwargs["dtype"] for e in fake_vllm] == [engine, engine]  # two fully fine-tuned agents: two engines
    warned = [r.getMessage() for r in caplog.records if "rollout.vllm_dtype" in r.getMessage()]
    assert bool(warned) == (engine != team_dtype)


def test_full_fine_tuning_pushes_weights_into_engines_that_share_the_gpu(fake_vllm, vllm_trainer):
    # The default share, 0.5, is what both engines take together: at 0.5 each the second would not start.
    trainer = vllm_trainer(steps=2, team={"training": "full"}, rollout={"max_model_len": 256})
    trainer.train_step()
    assert len(fake_vllm) == 2  # each agent owns its model: an engine each
    for engine in fake_vllm:
        assert engine.kwargs["gpu_memory_utilization"] == 0.25 and engine.kwargs["max_model_len"] == 256
        assert not engine.kwargs["enable_lora"] and not engine.kwargs["enable_sleep_mode"]
        assert engine.calls[0][2] is None
        assert not engine.loaded  # started from the current weights: nothing to push yet
    trainer.train_step()
    names = set(trainer.team[0].model.state_dict())
    for engine in fake_vllm:
        (pushed,) = engine.loaded  # once, after the update, every weight by its transformers name
        assert set(pushed) == names
        # the prompts' cached keys and values were computed with the old weights
        assert engine.events == ["generate", "apply_model", "reset_prefix_cache", "generate"]


def test_a_weight_push_resets_the_prefix_cache(tiny_config, fake_vllm, tmp_path):
    """After a push the engine samples what a fresh engine on the new weights samples (vLLM keeps the old
    weights' keys and values of every cached prompt until its prefix cache is reset)."""
    trainer = Trainer(tiny_config(steps=1))  # fully fine-tuned: weights go in with load_weights
    prompts = [[agent.prompt(obs[i]) for obs in (trainer.env.observe(it) for it in trainer.items[:3])]
               for i, agent in enumerate(trainer.team)]
    rollout = RolloutConfig(backend="vllm", gpu_memory_utilization=0.2)
    sampler = VLLMSampler(rollout, workdir=tmp_path)
    sampler.generate_team(trainer.team, prompts, 2, seed=3)  # caches every prompt
    with torch.no_grad():
        for agent in trainer.team:
            for p in agent.parameters:
                p.add_(torch.randn_like(p) * 0.1)
    after_push = sampler.generate_team(trainer.team, prompts, 2, seed=3)
    fresh = VLLMSampler(rollout, workdir=tmp_path).generate_team(trainer.team, prompts, 2, seed=3)
    for pushed, started_on_them in zip(after_push, fresh):
        assert torch.equal(pushed.completion_ids, started_on_them.completion_ids)


def test_sleep_mode_sleeps_the_engine_between_rollouts(fake_vllm, vllm_trainer):
    trainer = vllm_trainer(steps=2, team={"training": "lora"}, rollout={"sleep_between_rollouts": True})
    trainer.train_step()
    trainer.train_step()
    (engine,) = fake_vllm  # LoRA agents on one base: the one sleep-mode engine vLLM allows in a process
    assert engine.kwargs["enable_sleep_mode"]
    # every push (here the adapters' first versions, then the update's) is followed by a reset of the prefix cache
    assert engine.events == ["reset_prefix_cache", "generate", "sleep1",
                             "wake_up", "reset_prefix_cache", "generate", "sleep1"]


def test_the_sampler_refuses_sleep_mode_for_several_engines_before_starting_any(tiny_config, fake_vllm, tmp_path):
    trainer = Trainer(tiny_config(steps=1))  # two fully fine-tuned agents: two engines
    sampler = VLLMSampler(RolloutConfig(backend="vllm", sleep_between_rollouts=True), workdir=tmp_path)
    with pytest.raises(ConfigError, match=r"^rollout\.sleep_between_rollouts: vLLM allows one sleep-mode engine"):
        sampler.generate_team(trainer.team, [["a"], ["b"]], 1)
    assert not fake_vllm


def test_config_picks_the_vllm_backend(fake_vllm, vllm_trainer):
    trainer = vllm_trainer(steps=1)
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
    # vLLM in the team's float32, so that the log-probs compare within 0.02 (by default it samples in bfloat16)
    sampler = VLLMSampler(RolloutConfig(backend="vllm", gpu_memory_utilization=0.3, vllm_dtype="float32"),
                          workdir=tmp_path)
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


def test_fsdp_ranks_gather_what_rank_zeros_vllm_engine_serves(fake_vllm, tmp_path, vllm_trainer):
    """distributed.backend: fsdp with vLLM rollouts, as a group of one in this process: rank 0's engine starts from
    the gathered base, samples what the unsharded run's engine samples, and after an update gets the adapters as
    the shards now hold them. (The stand-in's samples hash the weights' bytes, so the two runs' second rollouts,
    from weights equal within 1e-7, would differ: one step is compared.)"""
    import torch.distributed as dist
    from safetensors.torch import load_file

    def run(backend: str):
        trainer = vllm_trainer(steps=1, items_per_step=2, algorithm={"num_generations": 4},
                               team={"training": "lora", "onednn_linear": False}, optim={"lr": 1e-3},
                               distributed={"backend": backend}, run_dir=str(tmp_path / backend),
                               rollout={"gpu_memory_utilization": 0.3})  # both runs' engines fit the fake GPU
        with trainer:
            metrics = trainer.train_step()
            states = [state.parameters for state in trainer.agents.states()]
            trainer.agents.sample([["target 9"], ["target 9"]], 2, 0)  # the next rollout pushes the update
            (engine,) = fake_vllm
            sampler = trainer.agents.sampler
            pushed = [load_file(str(Path(sampler._adapters[name].lora_path) / "adapter_model.safetensors"))
                      for name in trainer.agent_names]
            base = AutoModelForCausalLM.from_pretrained(engine.kwargs["model"]).state_dict()
        return metrics, states, pushed, engine, base

    single, single_states, _, single_engine, single_base = run("local")
    fake_vllm.clear()
    try:
        sharded, states, pushed, engine, base = run("fsdp")
    finally:
        dist.destroy_process_group()
    assert engine.kwargs["dtype"] == "bfloat16"
    assert base.keys() == single_base.keys() and not any("lora" in name for name in base)  # the base, gathered whole
    assert all(torch.equal(base[k], single_base[k]) for k in base)
    assert [[a.lora_name for a in call[2]] for call in engine.calls] == \
        [[a.lora_name for a in call[2]] for call in single_engine.calls]  # every update published, as unsharded
    assert sharded["reward/mean"] == single["reward/mean"]  # the engines sampled alike
    assert sharded["loss"] == pytest.approx(single["loss"], abs=1e-5)
    for mine, one in zip(states, single_states):
        assert max(float((mine[k] - one[k]).abs().max()) for k in one) < 1e-5
    for adapter, state, name in zip(pushed, states, ("first", "second")):  # what the shards hold after the update
        assert {k.replace(f".agent_{name}.", "."): v for k, v in state.items()}.keys() == adapter.keys()
        assert all(torch.equal(state_value, adapter[k.replace(f".agent_{name}.", ".")])
                   for k, state_value in state.items())
