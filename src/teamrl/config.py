"""Run configuration: dataclasses with documented defaults, loaded from YAML plus ``key=value`` overrides.

Every field carries its documentation in ``metadata["help"]`` (``teamrl config`` prints them): one line
saying what the field is and what it takes, with a pointer to the docs where there is more to say (the
reasons and measurements behind a default live there, not here). Loading checks every key and type and
each field's constraints up front, so a bad config fails with one line that names the field, never with a
traceback half-way through a run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from teamrl.registry import ADVANTAGES, AGGREGATIONS, ALGORITHMS
from teamrl.run_dir import is_run_config

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config value is missing, unknown, of the wrong type or out of range. The message names the field."""


def _doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING) -> Any:
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class SamplingConfig:
    """How an agent samples its completions."""

    temperature: float = _doc("Softmax temperature; the policy being trained is the temperature-scaled one.", 1.0)
    top_p: float = _doc("Nucleus sampling mass (1.0 = off).", 1.0)
    top_k: int = _doc("Sample only from the k most likely tokens (0 = off).", 0)
    max_new_tokens: int = _doc("Longest completion, in tokens.", 64)

    def validate(self, path: str) -> None:
        require(self.temperature > 0, f"{path}.temperature", "must be > 0", self.temperature)
        require(0 < self.top_p <= 1, f"{path}.top_p", "must be in (0, 1]", self.top_p)
        require(self.top_k >= 0, f"{path}.top_k", "must be >= 0 (0 turns it off)", self.top_k)
        require(self.max_new_tokens >= 1, f"{path}.max_new_tokens", "must be >= 1", self.max_new_tokens)


@dataclass
class LoraSettings:
    """The LoRA adapter each agent trains on top of its (frozen) base model."""

    r: int = _doc("Adapter rank.", 8)
    alpha: int = _doc("LoRA scaling numerator (scale = alpha / r).", 16)
    dropout: float = _doc("Dropout on the adapter input during updates.", 0.0)
    target_modules: Any = _doc(
        "Modules that get adapters: a list of module names, or 'all-linear' (PEFT's shorthand).", "all-linear"
    )

    def validate(self, path: str) -> None:
        require(self.r >= 1, f"{path}.r", "must be >= 1", self.r)
        require(self.alpha > 0, f"{path}.alpha", "must be > 0", self.alpha)
        require(0 <= self.dropout < 1, f"{path}.dropout", "must be in [0, 1)", self.dropout)
        ok = isinstance(self.target_modules, str) or (
            isinstance(self.target_modules, list) and all(isinstance(m, str) for m in self.target_modules)
        )
        require(ok, f"{path}.target_modules", "must be a string or a list of strings", self.target_modules)


@dataclass
class AgentConfig:
    """One member of the team."""

    name: str = _doc("Agent name, used in logs, checkpoints and the saved team.")
    model: str | None = _doc(
        "This agent's own base model (heterogeneous teams); empty = the team's `model`.", None
    )
    system_prompt: str | None = _doc(
        "The agent's role, sent as the system message; empty = the environment's default role for this seat.",
        None,
    )
    sampling: dict = _doc(
        "Per-agent overrides of `team.sampling`, e.g. {temperature: 0.7, max_new_tokens: 128}.", factory=dict
    )
    lr: float | None = _doc("This agent's learning rate; empty = `optim.lr`.", None)
    enable_thinking: bool | None = _doc("This agent's chat-template thinking option; empty = `team.enable_thinking`.",
                                        None)


@dataclass
class TeamConfig:
    """Who is in the team and how their weights are held."""

    model: str = _doc(
        "Base model: 'tiny', 'bundled', a hub id, a directory or a .gguf (docs/training.md#team-fields).",
        "tiny",
    )
    training: Literal["lora", "full"] = _doc(
        "'lora' (an adapter per agent on a shared frozen base) or 'full' (a whole model per agent).", "lora"
    )
    lora: LoraSettings = _doc("Adapter settings when training='lora'.", factory=LoraSettings)
    agents: list[AgentConfig] = _doc(
        "The agents, in the environment's seat order (agent i plays the environment's role i).",
        factory=lambda: [AgentConfig(name="agent0"), AgentConfig(name="agent1")],
    )
    sampling: SamplingConfig = _doc("Sampling settings shared by all agents.", factory=SamplingConfig)
    use_chat_template: bool = _doc("Wrap each observation in the tokenizer's chat template, role as system message.",
                                   True)
    enable_thinking: bool = _doc(
        "The chat template's enable_thinking option (Qwen3 thinks by default; off: an empty thinking block) "
        "(docs/training.md#chat-template-options).", False
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _doc(
        "Base weights' dtype: float32, bfloat16 or float16 (docs/performance.md#bfloat16-on-cpu).", "float32"
    )
    device: str = _doc("Torch device for every agent ('cpu', 'cuda', 'cuda:1', ...).", "cpu")
    onednn_linear: bool = _doc(
        "On CPU, run large linear layers on oneDNN's kernel (docs/performance.md#onednn-linear-layers).", True
    )

    def validate(self, path: str) -> None:
        self.sampling.validate(f"{path}.sampling")
        self.lora.validate(f"{path}.lora")
        require(len(self.agents) >= 1, f"{path}.agents", "needs at least one agent", self.agents)
        names = [a.name for a in self.agents]
        require(len(set(names)) == len(names), f"{path}.agents", "agent names must be unique", names)
        for i, agent in enumerate(self.agents):
            require(bool(agent.name) and agent.name.isidentifier(), f"{path}.agents[{i}].name",
                    "must be a non-empty identifier (letters, digits, _)", agent.name)
            require(agent.lr is None or agent.lr > 0, f"{path}.agents[{i}].lr", "must be > 0", agent.lr)
            self.agent_sampling(i).validate(f"{path}.agents[{i}].sampling")
            _check_model_spec(agent.model or self.model,
                              f"{path}.agents[{i}].model" if agent.model else f"{path}.model")

    def num_models(self) -> int:
        """How many models the team holds: one per agent when fully fine-tuned, one per base with LoRA
        (agents on the same base share it), as :meth:`teamrl.team.Team.from_config` builds them."""
        if self.training == "full":
            return len(self.agents)
        return len({agent.model or self.model for agent in self.agents})

    def agent_enable_thinking(self, index: int) -> bool:
        """Agent ``index``'s ``enable_thinking``: its own, else the team's."""
        own = self.agents[index].enable_thinking
        return self.enable_thinking if own is None else own

    def agent_sampling(self, index: int) -> SamplingConfig:
        """The team's sampling settings with agent ``index``'s overrides applied."""
        overrides = self.agents[index].sampling
        return _build(SamplingConfig, {**dataclasses.asdict(self.sampling), **overrides},
                      f"team.agents[{index}].sampling")


@dataclass
class EnvConfig:
    """The task: which environment and its options."""

    name: str = _doc("The task: a registered environment (`teamrl envs`), 'dataset' (a task from data, prompts and "
                     "a reward function: docs/environments.md) or your class as module:Class.", "digit_sum")
    kwargs: dict = _doc("Keyword arguments passed to the environment's constructor.", factory=dict)
    folders: list[str] = _doc(
        "Folders your modules (module:Class, and module:function in kwargs) are imported from, besides the config "
        "file's folder and the working directory; a run's config.yaml records them.", factory=list)


@dataclass
class CriticConfig:
    """The learned critic of the actor-critic algorithms ('iac', 'maac'; docs/algorithm.md#actor-critic)."""

    model: str | None = _doc(
        "The critic's base model; empty = the team's (iac: each agent's own). Trained as `team.training` says.", None
    )
    lr: float = _doc("The critic's learning rate (its own AdamW; the agents' betas, decay and schedule).", 1e-3)
    value_clip: float | None = _doc(
        "PPO value clipping: later passes keep V within old V +- value_clip (reward units); empty = off.", 0.2
    )
    gae_lambda: float = _doc("GAE's lambda over the tree: 1 = Monte-Carlo (A = R - V), 0 = one-step TD.", 1.0)
    normalize_advantages: bool = _doc(
        "Whiten each agent's advantages over the step (mean 0, std 1), as PPO and CoMLRL do by default.", True
    )

    def validate(self, path: str) -> None:
        require(self.lr > 0, f"{path}.lr", "must be > 0", self.lr)
        require(self.value_clip is None or self.value_clip > 0, f"{path}.value_clip",
                "must be > 0 (or empty for no clipping)", self.value_clip)
        require(0 <= self.gae_lambda <= 1, f"{path}.gae_lambda", "must be in [0, 1]", self.gae_lambda)
        if self.model:
            _check_model_spec(self.model, f"{path}.model")


@dataclass
class PreferenceConfig:
    """How 'madpo' and 'marlhf' pair the joint actions of a group into preferences."""

    pairs: Literal["best_worst", "all"] = _doc(
        "Pairs per group: 'best_worst' (its best against its worst joint action) or 'all' ordered pairs.",
        "best_worst",
    )
    min_gap: float = _doc("A pair needs winner's value - loser's > min_gap; ties never pair (docs/algorithm.md).", 0.0)

    def validate(self, path: str) -> None:
        require(self.min_gap >= 0, f"{path}.min_gap", "must be >= 0 (ties never make a pair)", self.min_gap)


@dataclass
class DPOConfig:
    """The multi-agent DPO loss of 'madpo'."""

    beta: float = _doc("DPO's beta: scale of the implicit reward beta * log(pi / pi_ref); larger = closer to pi_ref.",
                       0.1)
    coupling: Literal["joint", "independent"] = _doc(
        "'joint': DPO on the team's joint log-ratio; 'independent': each agent's own (docs/algorithm.md#madpo).",
        "joint",
    )

    def validate(self, path: str) -> None:
        require(self.beta > 0, f"{path}.beta", "must be > 0", self.beta)


@dataclass
class RewardModelConfig:
    """The joint reward model of 'marlhf', learned from preferences between joint actions."""

    model: str = _doc("Its base model (a spec as team.model takes); empty = team.model.", "")
    steps: int = _doc("Training steps that only collect preferences and train the reward model; then RL begins.", 10)
    refresh_every: int = _doc("After those steps, label a rollout and train the reward model every N steps; 0 = never.",
                              0)
    epochs: int = _doc("Reward-model optimiser steps on each labelled step's pairs.", 1)
    lr: float = _doc("The reward model's AdamW learning rate.", 1e-4)

    def validate(self, path: str) -> None:
        require(self.steps >= 1, f"{path}.steps", "must be >= 1: the reward model needs preferences first", self.steps)
        require(self.refresh_every >= 0, f"{path}.refresh_every", "must be >= 0 (0 = never)", self.refresh_every)
        require(self.epochs >= 1, f"{path}.epochs", "must be >= 1", self.epochs)
        require(self.lr > 0, f"{path}.lr", "must be > 0", self.lr)
        if self.model:
            _check_model_spec(self.model, f"{path}.model")


@dataclass
class AlgorithmConfig:
    """MAGRPO (arXiv 2508.04652), its variants and the other algorithms (docs/algorithm.md)."""

    name: str = _doc("Training algorithm: a registered one (docs/algorithm.md#algorithms) or your class as "
                     "module:Class.", "magrpo")
    num_generations: int = _doc("G: completions each agent samples per observation (the group size).", 4)
    joint_mode: Literal["aligned", "cross"] = _doc(
        "Joint actions: 'aligned' (the agents' g-th completions, G) or 'cross' (every combination, G^n).", "aligned"
    )
    max_joint_actions: int | None = _doc(
        "Cross mode: at most this many joint actions per node; above it, a balanced unbiased sample of the G^n "
        "(docs/algorithm.md#cross-mode-capping-the-joint-actions); empty = no cap.", None
    )
    num_turns: int = _doc("T: turns per episode. Turn t>1 observations carry the environment's feedback.", 1)
    discount: float = _doc("gamma in R_t = r_t + gamma * mean(R_{t+1} of the node's children).", 1.0)
    advantage: str | None = _doc(
        "Advantage: 'mean' (Eq. 1), 'std', 'rloo', 'none', 'max', one you registered, or module:function; "
        "empty = the algorithm's own (docs/algorithm.md).", None,
    )
    normalize_advantages: Literal["none", "agent"] = _doc(
        "'agent': divide each agent's advantages by their root mean square over the step (docs/algorithm.md#options); "
        "'none': as the estimator gives them.", "none"
    )
    logprob_aggregation: str = _doc(
        "Aggregation: 'token_sum' (Eq. 2), 'sequence_mean', 'token_mean', one you registered, or module:function "
        "(docs/algorithm.md#options).", "token_sum",
    )
    num_iterations: int = _doc("Optimisation passes over one rollout; later ones are off-policy, ratio clipped.", 1)
    epsilon_low: float = _doc("Clip the probability ratio below at 1 - epsilon_low.", 0.2)
    epsilon_high: float = _doc("Clip the probability ratio above at 1 + epsilon_high.", 0.2)
    kl_coef: float = _doc("Weight of the k3 KL penalty to the reference policy; 0 = off (docs/algorithm.md#options).",
                          0.0)
    early_termination_threshold: float | None = _doc(
        "Multi-turn: a joint action reaching this reward stops early; empty = off (docs/algorithm.md).", None
    )
    learners: Literal["joint", "individual"] = _doc(
        "Reward each agent learns from: 'joint' (MAGRPO) or 'individual' (docs/algorithm.md#options).", "joint"
    )
    critic: CriticConfig = _doc("The critic of 'iac' and 'maac' (docs/algorithm.md#actor-critic).",
                                factory=CriticConfig)
    preference: PreferenceConfig = _doc("'madpo', 'marlhf': pairing joint actions into preferences.",
                                        factory=PreferenceConfig)
    dpo: DPOConfig = _doc("'madpo': the DPO loss.", factory=DPOConfig)
    reward_model: RewardModelConfig = _doc("'marlhf': the learned joint reward model.", factory=RewardModelConfig)

    @property
    def advantage_estimator(self) -> str:
        """The advantage estimator the run uses: the one the algorithm's name fixes, ``advantage``, or 'mean'."""
        return self._registered_with("advantage") or self.advantage or "mean"

    @property
    def uses_reference(self) -> bool:
        """Whether the update reads each agent's frozen reference policy (the KL penalty, or an algorithm
        registered with ``uses_reference``: MADPO's log-ratios)."""
        return self.kl_coef > 0 or bool(self._registered_with("uses_reference"))

    def _registered_with(self, prop: str) -> Any:
        return ALGORITHMS.properties(self.name).get(prop)

    def validate(self, path: str) -> None:
        # The algorithm, estimator and aggregation named must be registered (or importable as module:name): the
        # registries import the shipped modules, and a user's, here (teamrl.registry).
        require_registered(ALGORITHMS, self.name, f"{path}.name")
        if self.advantage is not None:
            require_registered(ADVANTAGES, self.advantage, f"{path}.advantage")
        require_registered(AGGREGATIONS, self.logprob_aggregation, f"{path}.logprob_aggregation")
        fixed = self._registered_with("advantage")
        require(self.advantage in (None, fixed) if fixed else True, f"{path}.advantage",
                f"{path}.name={self.name!r} is MAGRPO with advantage {fixed!r}; leave {path}.advantage empty "
                f"(or {fixed!r}), or use {path}.name='magrpo' with the advantage you want", self.advantage)
        require(self.num_generations >= 2, f"{path}.num_generations",
                "must be >= 2: a group-relative advantage needs at least two samples", self.num_generations)
        require(self.num_turns >= 1, f"{path}.num_turns", "must be >= 1", self.num_turns)
        require(self.max_joint_actions is None or self.joint_mode == "cross", f"{path}.max_joint_actions",
                "caps cross mode's G^n joint actions; aligned mode has G of them: leave it empty or set "
                f"{path}.joint_mode='cross'", self.max_joint_actions)
        require(self.max_joint_actions is None or (isinstance(self.max_joint_actions, int)
                                                  and self.max_joint_actions >= self.num_generations),
                f"{path}.max_joint_actions", f"must be empty or an int >= num_generations ({self.num_generations}): "
                "every sample must be in a joint action", self.max_joint_actions)
        require(self.normalize_advantages in ("none", "agent"), f"{path}.normalize_advantages",
                "must be 'none' or 'agent'", self.normalize_advantages)
        require(0 <= self.discount <= 1, f"{path}.discount", "must be in [0, 1]", self.discount)
        require(self.num_iterations >= 1, f"{path}.num_iterations", "must be >= 1", self.num_iterations)
        require(0 <= self.epsilon_low < 1, f"{path}.epsilon_low", "must be in [0, 1)", self.epsilon_low)
        require(self.epsilon_high >= 0, f"{path}.epsilon_high", "must be >= 0", self.epsilon_high)
        require(self.kl_coef >= 0, f"{path}.kl_coef", "must be >= 0", self.kl_coef)
        self.critic.validate(f"{path}.critic")
        self.preference.validate(f"{path}.preference")
        self.dpo.validate(f"{path}.dpo")
        self.reward_model.validate(f"{path}.reward_model")


@dataclass
class OptimConfig:
    """Optimiser and schedule, one AdamW per agent."""

    lr: float = _doc("Learning rate (each agent may override it).", 1e-4)
    weight_decay: float = _doc("AdamW weight decay.", 0.0)
    betas: list[float] = _doc("AdamW betas.", factory=lambda: [0.9, 0.999])
    max_grad_norm: float | None = _doc("Clip each agent's gradient to this global norm. Empty = no clipping.", 1.0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = _doc(
        "Schedule after warm-up: constant, or linear or cosine decay to `final_lr_fraction` x `lr` at the last step.",
        "constant",
    )
    final_lr_fraction: float = _doc(
        "Where a linear or cosine schedule ends, as a fraction of `lr` (0 = decay to 0; 0 with constant).", 0.0
    )
    warmup_steps: int = _doc("Linear warm-up from 0 to `lr` over this many optimiser steps.", 0)
    micro_batch_size: int = _doc(
        "Sequences per forward/backward pass; 0 = a whole turn (docs/performance.md#micro-batch-size).", 4
    )
    parallel_micro_batches: int = _doc(
        "Micro-batches a CPU LoRA update runs at once (docs/performance.md#parallel-micro-batches).", 2
    )
    fast_update: bool = _doc("Same update, faster (algorithms/fast_update.py); false: magrpo.py's plain loop.", True)

    def validate(self, path: str) -> None:
        require(self.lr > 0, f"{path}.lr", "must be > 0", self.lr)
        require(self.weight_decay >= 0, f"{path}.weight_decay", "must be >= 0", self.weight_decay)
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"{path}.betas",
                "must be two numbers in [0, 1)", self.betas)
        require(self.max_grad_norm is None or self.max_grad_norm > 0, f"{path}.max_grad_norm",
                "must be > 0 (or empty for no clipping)", self.max_grad_norm)
        require(self.warmup_steps >= 0, f"{path}.warmup_steps", "must be >= 0", self.warmup_steps)
        require(0 <= self.final_lr_fraction <= 1, f"{path}.final_lr_fraction",
                "must be in [0, 1] (a fraction of lr)", self.final_lr_fraction)
        require(self.final_lr_fraction == 0 or self.lr_scheduler != "constant", f"{path}.final_lr_fraction",
                "only a decaying schedule has an end: set lr_scheduler to linear or cosine, or leave it 0",
                self.final_lr_fraction)
        require(self.micro_batch_size >= 0, f"{path}.micro_batch_size", "must be >= 0", self.micro_batch_size)
        require(self.parallel_micro_batches >= 1, f"{path}.parallel_micro_batches", "must be >= 1 (1 = one at a time)",
                self.parallel_micro_batches)


@dataclass
class LoggingConfig:
    """What a run records."""

    sample_every: int = _doc("Write sample joint outputs to samples.jsonl every N steps (0 = never).", 10)
    tensorboard: bool = _doc("Also write TensorBoard event files (needs the `tensorboard` extra).", False)
    wandb_project: str | None = _doc("Also log to this Weights & Biases project (needs the `wandb` extra).", None)
    progress_bar: bool = _doc("Show a progress bar on the console.", True)

    def validate(self, path: str) -> None:
        require(self.sample_every >= 0, f"{path}.sample_every", "must be >= 0", self.sample_every)


#: Held-out evaluations an automatic schedule (``eval.every_steps`` empty) spreads over a run, after step 0's.
AUTO_EVALUATIONS = 4


@dataclass
class EvalConfig:
    """Held-out evaluation during training: the team scored on the environment's 'eval' split (eval.jsonl)."""

    every_steps: int | None = _doc(
        "Evaluate at step 0, every N steps and at the last step; empty = about 4 times a run; 0 = off.", None
    )
    items: int = _doc("Held-out items per evaluation (the 'eval' split's first ones); each costs about as much as "
                      "a training step's item.", 8)
    samples: int = _doc("Joint actions sampled per held-out item.", 2)
    seed: int = _doc("Sampling seed of every evaluation, apart from `seed`: each one, and each run, draws alike.", 0)

    def validate(self, path: str) -> None:
        require(self.every_steps is None or self.every_steps >= 0, f"{path}.every_steps",
                "must be >= 0 (0 = off, empty = about 4 times a run)", self.every_steps)
        require(self.items >= 1, f"{path}.items", "must be >= 1", self.items)
        require(self.samples >= 1, f"{path}.samples", "must be >= 1", self.samples)

    def interval(self, steps: int) -> int:
        """Steps between evaluations in a run of ``steps`` steps (0: no evaluation)."""
        if self.every_steps is None:
            return max(1, math.ceil(steps / AUTO_EVALUATIONS))
        return self.every_steps


@dataclass
class CheckpointConfig:
    """When the run saves what it needs to resume."""

    save_every: int = _doc("Save a checkpoint every N steps (and always at the last step). 0 = only the last.", 50)
    keep_last: int = _doc("How many checkpoints to keep on disk (older ones are deleted).", 2)

    def validate(self, path: str) -> None:
        require(self.save_every >= 0, f"{path}.save_every", "must be >= 0", self.save_every)
        require(self.keep_last >= 1, f"{path}.keep_last", "must be >= 1", self.keep_last)


@dataclass
class RolloutConfig:
    """Which engine samples the rollouts. The update always runs in transformers (it recomputes log-probs)."""

    backend: Literal["transformers", "vllm"] = _doc(
        "Rollout engine: 'transformers' (this process) or 'vllm' (GPU; docs/vllm.md#enabling-it).",
        "transformers",
    )
    gpu_memory_utilization: float = _doc(
        "vLLM: share of the GPU's memory all engines take together, in (0, 1]; n engines get 1/n of it each; the "
        "rest trains.", 0.5
    )
    max_model_len: int = _doc("vLLM: prompt + completion tokens the KV cache holds; 0 = the model's own limit.", 0)
    sleep_between_rollouts: bool = _doc(
        "vLLM: free the engine's GPU memory while the agents update; one engine only, i.e. LoRA agents on one base "
        "(docs/vllm.md#enabling-it).", False
    )
    vllm_dtype: Literal["auto", "bfloat16", "float16", "float32"] = _doc(
        "vLLM: the engines' dtype; 'auto' = team.dtype when 16-bit, else bfloat16 (docs/vllm.md#enabling-it).", "auto"
    )
    compile: bool = _doc(
        "transformers: let generate() torch.compile the decoding step on CUDA (its default with a static cache); "
        "false asks it not to (docs/performance.md#compiling-the-decoding-step).", False
    )

    def engine_dtype(self, team_dtype: str) -> str:
        """The dtype vLLM runs in for a team whose ``team.dtype`` is ``team_dtype`` (see ``vllm_dtype``)."""
        if self.vllm_dtype != "auto":
            return self.vllm_dtype
        return team_dtype if team_dtype in ("bfloat16", "float16") else "bfloat16"

    def validate(self, path: str) -> None:
        require(0 < self.gpu_memory_utilization <= 1, f"{path}.gpu_memory_utilization", "must be in (0, 1]",
                self.gpu_memory_utilization)
        require(self.max_model_len >= 0, f"{path}.max_model_len", "must be >= 0 (0 = the model's limit)",
                self.max_model_len)
        if self.backend == "vllm":
            import importlib.util

            import torch

            # The GPU first: without one, installing vllm would not help.
            require(torch.cuda.is_available(), f"{path}.backend",
                    "'vllm' runs on an NVIDIA GPU and torch sees no CUDA device here; use 'transformers', or "
                    "on a GPU machine pip install \"teamrl[vllm]\"", self.backend)
            require(importlib.util.find_spec("vllm") is not None, f"{path}.backend",
                    "'vllm' needs the vllm package: pip install \"teamrl[vllm]\", or use 'transformers'",
                    self.backend)


#: The temperatures vLLM samples at as asked: ``SamplingParams`` rejects more than 2 (vLLM 0.33) and raises values
#: below 0.01 to 0.01.
VLLM_TEMPERATURE_RANGE = (0.01, 2.0)


def vllm_sleep_mode_rule(engines: int) -> str:
    """Why ``rollout.sleep_between_rollouts`` cannot serve a team that needs ``engines`` vLLM engines."""
    return (f"vLLM allows one sleep-mode engine per process and this team needs {engines} (one per model it holds); "
            "set it to false, or train LoRA adapters on one shared base (one engine)")


@dataclass
class DistributedConfig:
    """Where the agents live: in this process, or each in its own Ray actor on a machine or a cluster."""

    backend: Literal["local", "ray", "fsdp"] = _doc(
        "Where agents run: 'local' (this process), 'ray' (a Ray actor each) or 'fsdp' (every model sharded across "
        "the processes of a torchrun job) (docs/distributed.md).", "local"
    )
    address: str | None = _doc(
        "Ray: cluster to join, as ray.init takes it; empty = Ray's default (docs/distributed.md#config).",
        None,
    )
    cpus_per_agent: float = _doc(
        "Ray: CPUs each agent actor reserves; fractions share a CPU (docs/distributed.md#config).", 0.5
    )
    gpus_per_agent: float = _doc(
        "Ray: GPUs each agent actor reserves (0.5 = two per GPU); > 0 needs team.device='cuda'.", 0.0
    )
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = _doc(
        "Ray placement: 'pack', 'spread', 'strict_pack' or 'strict_spread' (docs/distributed.md#config).",
        "pack",
    )

    def validate(self, path: str) -> None:
        require(self.cpus_per_agent > 0, f"{path}.cpus_per_agent", "must be > 0 (fractions such as 0.5 share a CPU)",
                self.cpus_per_agent)
        require(self.gpus_per_agent >= 0, f"{path}.gpus_per_agent", "must be >= 0", self.gpus_per_agent)
        if self.backend == "ray":
            import importlib.util

            require(importlib.util.find_spec("ray") is not None, f"{path}.backend",
                    "'ray' needs the ray package: pip install \"teamrl[ray]\", or use 'local'", self.backend)


@dataclass
class TrainConfig:
    """A whole training run."""

    env: EnvConfig = _doc("The task.", factory=EnvConfig)
    team: TeamConfig = _doc("The agents and their models.", factory=TeamConfig)
    algorithm: AlgorithmConfig = _doc("MAGRPO settings.", factory=AlgorithmConfig)
    optim: OptimConfig = _doc("Optimiser settings.", factory=OptimConfig)
    steps: int = _doc("Training steps; each step is one rollout of `items_per_step` items and one update.", 100)
    items_per_step: int = _doc("Dataset items per step (each gets its own groups of G).", 2)
    seed: int = _doc("Seed for model init (tiny), data order and sampling.", 0)
    run_dir: str = _doc("Where metrics, samples, checkpoints and the final team go.", "runs/teamrl")
    logging: LoggingConfig = _doc("Logging settings.", factory=LoggingConfig)
    eval: EvalConfig = _doc("Held-out evaluation during training (eval.jsonl, reward_curve.png).",
                            factory=EvalConfig)
    checkpoint: CheckpointConfig = _doc("Checkpoint settings.", factory=CheckpointConfig)
    rollout: RolloutConfig = _doc("Rollout engine settings.", factory=RolloutConfig)
    distributed: DistributedConfig = _doc("Where the agents run (this process, or Ray actors).",
                                          factory=DistributedConfig)
    imports: list[str] = _doc(
        "Your modules to import before the config is checked, so that the estimators, aggregations, algorithms and "
        "environments they register can be named (docs/algorithm.md#your-own-estimators-and-algorithms).",
        factory=list,
    )

    def validate(self, path: str = "") -> None:
        from teamrl.imports import ImportPathError, import_module

        for i, module in enumerate(self.imports):
            try:
                import_module(module, f"imports[{i}]")
            except ImportPathError as err:
                raise ConfigError(str(err)) from None
        require(self.steps >= 1, "steps", "must be >= 1", self.steps)
        require(self.items_per_step >= 1, "items_per_step", "must be >= 1", self.items_per_step)
        self.team.validate("team")
        self.algorithm.validate("algorithm")
        self.optim.validate("optim")
        self.logging.validate("logging")
        self.eval.validate("eval")
        self.checkpoint.validate("checkpoint")
        self.rollout.validate("rollout")
        self.distributed.validate("distributed")
        algorithm_class = ALGORITHMS.lookup(self.algorithm.name)
        for name in getattr(algorithm_class, "ignores", ()):  # set, but the algorithm would never read it
            default = field_default(AlgorithmConfig, name)
            require(getattr(self.algorithm, name) == default, f"algorithm.{name}",
                    f"algorithm.name={self.algorithm.name!r} does not use it; leave it out (its default: {default!r})",
                    getattr(self.algorithm, name))
        check_algorithm = getattr(algorithm_class, "check_config", None)
        if check_algorithm is not None:  # what the algorithm itself cannot run with
            check_algorithm(self)
        if self.env.name == PROGRAM_TASK:
            check_program(self, algorithm_class)
        if self.distributed.backend == "ray":
            # Ray decides which devices an actor sees: GPU 0 of its own, or none.
            device = "cuda" if self.distributed.gpus_per_agent > 0 else "cpu"
            require(self.team.device == device, "team.device",
                    f"must be {device!r} with distributed.backend='ray' and gpus_per_agent="
                    f"{self.distributed.gpus_per_agent:g} (Ray gives each agent actor its own devices)",
                    self.team.device)
            require(self.rollout.backend == "transformers", "rollout.backend",
                    "must be 'transformers' with distributed.backend='ray' (the agent actors sample themselves)",
                    self.rollout.backend)
        if self.rollout.backend == "vllm":
            self._check_vllm_limits()
        if self.distributed.backend == "fsdp":
            self._check_fsdp_limits()

    def _check_fsdp_limits(self) -> None:
        """What ``distributed.backend: fsdp`` shards (teamrl.backends.fsdp): checked here, before a GPU is used."""
        require(getattr(ALGORITHMS.lookup(self.algorithm.name), "trains_only_the_agents", False), "algorithm.name",
                "must be an algorithm that trains the agents alone with distributed.backend='fsdp' (magrpo and its "
                "variants, centralized, madpo): the others train a critic or reward model of their own, which it does "
                "not shard; or use 'local' or 'ray'", self.algorithm.name)
        require(not (self.team.training == "full" and self.algorithm.uses_reference), "algorithm.kl_coef",
                "must be 0 with distributed.backend='fsdp' and team.training='full' (the KL reference would be a "
                "second, unsharded copy of each model); train LoRA adapters, whose reference is their base",
                self.algorithm.kl_coef)

    def _check_vllm_limits(self) -> None:
        """What vLLM refuses, or silently changes, for this team: checked here so that it fails at load time."""
        low, high = VLLM_TEMPERATURE_RANGE
        for i, agent in enumerate(self.team.agents):
            where = f"team.agents[{i}].sampling" if "temperature" in agent.sampling else "team.sampling"
            temperature = self.team.agent_sampling(i).temperature
            require(low <= temperature <= high, f"{where}.temperature",
                    f"must be in [{low}, {high}] with rollout.backend='vllm' (vLLM rejects more than {high} and "
                    f"samples below {low} at {low}, not at the temperature the update trains)", temperature)
        engines = self.team.num_models()
        require(not (self.rollout.sleep_between_rollouts and engines > 1), "rollout.sleep_between_rollouts",
                vllm_sleep_mode_rule(engines), self.rollout.sleep_between_rollouts)


PROGRAM_TASK = "program"
"""``env.name`` of a task that is a program (:class:`~teamrl.envs.program.ProgramTask`)."""


def check_program(config: TrainConfig, algorithm_class: type) -> None:
    """What a program task cannot be trained with, refused in one line (docs/programs.md#what-carries-over): a
    program's episode is one trajectory per run, so only MAGRPO's aligned mode over whole episodes applies."""
    algorithm = config.algorithm
    name = algorithm.name
    require(getattr(algorithm_class, "learns_from_programs", False), "algorithm.name",
            "cannot learn from a program's episodes (a critic needs per-turn states, preferences and centralized "
            "a task of their own): use magrpo, mareinforce, marloo or maremax, whose group baseline over the G "
            "episodes of an item is what carries over", name)
    require(algorithm.joint_mode == "aligned", "algorithm.joint_mode",
            "must be 'aligned' with env.name='program': an episode's calls depend on each other, so one agent's "
            "calls cannot be paired with another episode's (cross mode)", algorithm.joint_mode)
    require(algorithm.num_turns == 1, "algorithm.num_turns",
            "must be 1 with env.name='program': the program plays a whole episode, however many calls it makes; "
            "the turn tree would need the program replayed from every turn", algorithm.num_turns)
    require(algorithm.learners == "joint", "algorithm.learners",
            "must be 'joint' with env.name='program': the program returns one joint reward per episode",
            algorithm.learners)
    require(algorithm.early_termination_threshold is None, "algorithm.early_termination_threshold",
            "has no turns to stop after with env.name='program' (one episode, one reward): leave it empty",
            algorithm.early_termination_threshold)
    require(config.distributed.backend == "local", "distributed.backend",
            "must be 'local' with env.name='program': the gateway answers the program's calls with the agents of "
            "this process", config.distributed.backend)


# --------------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or start from the defaults), apply ``a.b=value`` overrides, validate.

    Override values are parsed as YAML, so ``algorithm.num_generations=8`` gives an int and
    ``team.agents=[{name: a}, {name: b}]`` a list.
    """
    data: dict[str, Any] = {}
    if path is not None:
        file = resolve_config_path(path)
        if not file.is_file():
            raise ConfigError(f"config file {str(file)!r} does not exist (shipped presets: {', '.join(presets())})")
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(file)!r} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(file)!r} must hold a mapping of fields, got {type(data).__name__}")
        if file.parent.resolve() != PRESETS_DIR.resolve():
            from teamrl.imports import add_search_folder

            add_search_folder(file.parent)  # users' modules the config names (module:function) sit beside it
        if is_run_config(file):  # the run is where its config.yaml is now, wherever it was written
            data["run_dir"] = str(file.parent)
    _drop_kwargs_of_another_env(data, overrides or [])
    _drop_settings_of_another_algorithm(data, overrides or [])
    for override in overrides or []:
        _apply_override(data, override)
    return config_from_dict(data)


PRESETS_DIR = Path(__file__).parent / "presets"


def presets() -> list[str]:
    """Names of the configs shipped with teamrl (``teamrl train NAME`` runs one)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_summary(name: str) -> str:
    """The first sentence of preset ``name``'s opening comment, wherever its lines break (``teamrl presets``)."""
    comment = []
    for line in (PRESETS_DIR / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    text = " ".join(comment)
    end = re.search(r"\.(\s|$)", text)  # a full stop, not the dot of Qwen2.5 or FILE.jsonl
    return text[: end.start() + 1] if end else text


def resolve_config_path(path: str | os.PathLike) -> Path:
    """A config file path, or the file of a shipped preset when ``path`` is a preset's name."""
    file = Path(path)
    if not file.exists() and (PRESETS_DIR / f"{file.name}.yaml").is_file() and file.suffix == "":
        return PRESETS_DIR / f"{file.name}.yaml"
    return file


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from plain data (as read from YAML)."""
    config = _build(TrainConfig, data, "")
    config.validate()
    return config


def config_to_dict(config: Any) -> dict[str, Any]:
    """Plain-data form of a config, suitable for YAML/JSON and for :func:`config_from_dict`."""
    return dataclasses.asdict(config)


def describe_fields(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, help) for every field, nested configs expanded."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            rows.extend(describe_fields(hints[f.name], name + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(d) for d in default]
        rows.append((name, repr(default), f.metadata.get("help", "")))
    return rows


def _drop_kwargs_of_another_env(data: dict[str, Any], overrides: list[str]) -> None:
    """Leave out the config file's ``env.kwargs`` when an ``env.name=`` override names another environment,
    with a one-line note: they were written for the file's environment (``tldr``'s ``source`` means nothing to
    ``digit_sum``). The overrides' own ``env.kwargs...`` then give the new environment's."""
    names = [_override_value(raw) for key, _, raw in (o.partition("=") for o in overrides) if key == "env.name"]
    env = data.get("env")
    if not names or not isinstance(env, dict) or not env.get("kwargs"):
        return
    file_name = env.get("name", EnvConfig.name)
    if names[-1] == file_name:
        return
    dropped = env.pop("kwargs")
    log.warning("env.name=%s: left out the config file's env.kwargs (%s), written for %s; %s's come from "
                "env.kwargs.FIELD=VALUE overrides", names[-1], ", ".join(map(str, dropped)), file_name, names[-1])


def _drop_settings_of_another_algorithm(data: dict[str, Any], overrides: list[str]) -> None:
    """Leave out the config file's ``algorithm.*`` settings that an ``algorithm.name=`` override's algorithm does not
    read (its class's ``ignores``: a critic's for MAGRPO, MAGRPO's estimator for a critic) or fixes otherwise
    (``marloo``'s estimator is rloo), each with a one-line note: the file chose them for its own algorithm (every
    preset picks MAGRPO's estimator), and the new name makes another choice. The same setting given as an override
    is still refused: it was said for this run."""
    overridden = [(key, _override_value(raw)) for key, _, raw in (o.partition("=") for o in overrides)]
    names = [value for key, value in overridden if key == "algorithm.name"]
    algorithm = data.get("algorithm")
    if not names or not isinstance(names[-1], str) or names[-1] not in ALGORITHMS or not isinstance(algorithm, dict):
        return
    name, said = names[-1], {key for key, _ in overridden}
    fixed = ALGORITHMS.properties(name).get("advantage")
    if fixed is not None and algorithm.get("advantage") not in (None, fixed) and "algorithm.advantage" not in said:
        log.warning("algorithm.name=%s: left out the config file's algorithm.advantage (%s); %s's is %s", name,
                    algorithm.pop("advantage"), name, fixed)
    for field_name in getattr(ALGORITHMS.lookup(name), "ignores", ()):
        if field_name in algorithm and f"algorithm.{field_name}" not in said:
            log.warning("algorithm.name=%s: left out the config file's algorithm.%s (%s): %s does not use it", name,
                        field_name, algorithm.pop(field_name), name)


def _override_value(raw: str) -> Any:
    """An override's value, parsed as YAML (a string that is not YAML stays as it is)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like field.subfield=value")
    value = _override_value(raw)
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a group of fields")
        node = child
    node[parts[-1]] = value


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping of fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            raise ConfigError(f"{where}: unknown field; valid fields here are: {', '.join(known)}")
        kwargs[key] = _coerce(value, hints[key], where)
    missing = [n for n, f in known.items()
                if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"{path}.{missing[0]}" if path else missing[0]
        raise ConfigError(f"{where}: required field is missing")
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {hint}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            value = _yaml11_float(value)  # PyYAML reads "1e-4" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"config field {where} has an unsupported type {hint}")  # a bug in teamrl, not user input


def _yaml11_float(text: str) -> float | str:
    """``text`` as a float when it is a plain decimal/scientific number, else unchanged."""
    try:
        return float(text) if text.strip().lstrip("+-")[:1].isdigit() or text.strip()[:1] == "." else text
    except ValueError:
        return text


def require(ok: bool, where: str, rule: str, value: Any) -> None:
    """Raise a :class:`ConfigError` saying ``where: rule (got value)`` unless ``ok``: how every check of a
    config value reads (algorithms' ``check_config`` use it too)."""
    if not ok:
        raise ConfigError(f"{where}: {rule} (got {value!r})")


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of config class ``cls`` (a fresh one where it is made by a factory)."""
    found = cls.__dataclass_fields__[name]
    return found.default if found.default is not dataclasses.MISSING else found.default_factory()


def require_registered(registry: Any, name: str, where: str) -> None:
    """``name`` selects an entry of ``registry`` (a :class:`~teamrl.registry.Registry`): registered, or a
    ``module:name`` import path to one; else one ConfigError naming the field and what is registered."""
    from teamrl.imports import ImportPathError
    from teamrl.registry import RegistryError

    try:
        registry.resolve(name)
    except (RegistryError, ImportPathError) as err:
        raise ConfigError(str(err)) from None


def _check_model_spec(spec: str, where: str) -> None:
    """A spec that is clearly a filesystem path must exist; hub ids are checked when loading."""
    looks_like_path = spec.startswith(("/", "./", "../", "~")) or spec.endswith(".gguf")
    if looks_like_path and not Path(spec).expanduser().exists():
        raise ConfigError(f"{where}: model path {spec!r} does not exist; give an existing directory or .gguf file")
