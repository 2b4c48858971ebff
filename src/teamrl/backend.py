"""How the Trainer reaches a team's agents: one interface, wherever the agents live.

The algorithm sees a team only through :class:`AgentBackend`: it samples each agent's completions of its
own observations, scores completions under the current policies, updates every agent from its
completions and their advantages, and hands over or takes back each agent's state for checkpoints.
Three implementations:

- :class:`LocalBackend`: the agents in this process, sampled with transformers, updated with torch;
- :class:`~teamrl.rollout.vllm_backend.VLLMBackend`: the same, sampled by vLLM on the GPU;
- :class:`~teamrl.distributed.RayTeam`: each agent in its own Ray actor, on its own CPUs, GPUs or node.

:func:`make_backend` picks one from the config (``rollout.backend``, ``distributed.backend``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from teamrl.algorithms import fast_update, magrpo
from teamrl.algorithms.logprobs import token_logprobs
from teamrl.checkpoint import AgentState, agent_state, restore_agent_state
from teamrl.config import TrainConfig
from teamrl.rollout.generate import Generation, generate_team, seeded
from teamrl.team import Agent, Team

if TYPE_CHECKING:
    from teamrl.envs.base import Environment


class AgentBackend(Protocol):
    """A team's agents, in seat order, wherever they live."""

    names: list[str]
    """Every agent's name, in seat order."""

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        """For every agent i, ``num_samples`` completions of each of its own observations ``observations[i]``,
        prompted in its role; ``seed`` fixes the tokens (the same ones in every implementation)."""
        ...

    def logprobs(self, generations: Sequence[Generation], reference: bool = False) -> list[torch.Tensor]:
        """For every agent i, the (B, C) log-probs of ``generations[i]``'s completion tokens under its
        current policy (temperature-scaled, as sampled), or with ``reference`` under its frozen reference
        policy, without gradients."""
        ...

    def update(self, generations: Sequence[list[Generation]], advantages: Sequence[list[torch.Tensor]],
               seeds: Sequence[int], loss: str = "policy_gradient") -> list[dict[str, float]]:
        """Every agent's update of a step (agent i: its completions of every turn, their advantages, the
        seed of whatever its update draws); each agent's statistics and the learning rate it leaves.
        ``loss``: the registered loss (:data:`~teamrl.algorithms.losses.LOSSES`) it minimises, whose per-row
        values ``advantages`` holds."""
        ...

    def states(self) -> list[AgentState]:
        """Every agent's trained parameters and optimiser and schedule state, for a checkpoint."""
        ...

    def load_states(self, states: Sequence[AgentState], source: str | Path) -> None:
        """Resume every agent from its state, read from checkpoint ``source``."""
        ...

    def save(self, directory: str | Path, metadata: dict | None = None) -> Path:
        """Write the team as :meth:`Team.save_pretrained` does (loadable with :meth:`Team.from_pretrained`)."""
        ...


class LocalBackend:
    """The agents in this process: sampled with transformers (:func:`generate_team`), updated with torch
    (:func:`train_agents`), one AdamW and schedule per agent."""

    def __init__(self, team: Team, config: TrainConfig):
        self.team = team
        self.config = config
        self.names = [agent.name for agent in team]
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
        for agent, agent_config in zip(team, config.team.agents):
            optimizer, scheduler = make_optimizer(agent.parameters, config, agent_config.lr)
            self.optimizers.append(optimizer)
            self.schedulers.append(scheduler)

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        return generate_team(self.team, self.team.prompts(observations), num_samples, seed=seed,
                             compile=self.config.rollout.compile)

    def logprobs(self, generations: Sequence[Generation], reference: bool = False) -> list[torch.Tensor]:
        return [policy_logprobs(agent, gen, reference) for agent, gen in zip(self.team, generations)]

    def update(self, generations: Sequence[list[Generation]], advantages: Sequence[list[torch.Tensor]],
               seeds: Sequence[int], loss: str = "policy_gradient") -> list[dict[str, float]]:
        return train_agents(list(self.team), generations, advantages, self.optimizers, self.schedulers,
                            self.config, seeds, loss)

    def states(self) -> list[AgentState]:
        return [agent_state(*live) for live in zip(self.team, self.optimizers, self.schedulers)]

    def load_states(self, states: Sequence[AgentState], source: str | Path) -> None:
        for agent, optimizer, scheduler, state in zip(self.team, self.optimizers, self.schedulers, states):
            restore_agent_state(agent, optimizer, scheduler, state, source)

    def save(self, directory: str | Path, metadata: dict | None = None) -> Path:
        return self.team.save_pretrained(directory, metadata=metadata)


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int, final: float = 0.0):
    """Linear warm-up over ``warmup`` optimiser steps, then constant, or linear or cosine decay to ``final`` (a
    fraction of the learning rate) at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return final + (1.0 - final) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(parameters: list[torch.nn.Parameter], config: TrainConfig, lr: float | None = None):
    """An agent's AdamW (at ``lr``, default ``optim.lr``) and its schedule over the run's optimiser steps."""
    optim = config.optim
    optimizer = torch.optim.AdamW(parameters, lr=lr or optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)
    total = config.steps * config.algorithm.num_iterations
    return optimizer, make_scheduler(optimizer, optim.lr_scheduler, optim.warmup_steps, total,
                                     optim.final_lr_fraction)


def train_agents(agents: Sequence[Agent], generations: Sequence[list[Generation]],
                 advantages: Sequence[list[torch.Tensor]], optimizers: Sequence[torch.optim.Optimizer],
                 schedulers: Sequence[Any], config: TrainConfig, seeds: Sequence[int],
                 loss: str = "policy_gradient") -> list[dict[str, float]]:
    """The agents' updates of a step (paper Eq. 2, :func:`magrpo.update_agent`, or the same computed by
    :mod:`~teamrl.algorithms.fast_update` with ``optim.fast_update``; or the registered ``loss``, which both
    run) with the run's settings; each agent's
    stats and the learning rate it leaves. The same call runs here and, for its one agent, in a Ray agent
    actor. Each update runs under its agent's own ``seeds[k]``, which seeds whatever it draws (dropout), so
    the result depends on the step alone: not on the process it runs in, nor on what ran before it. (Agents
    that pool their micro-batches, :func:`fast_update.update_pools`, run under the first one's seed: a pool
    draws nothing, pools form only without dropout.)"""
    optim = config.optim
    stats: dict[int, dict[str, float]] = {}
    if optim.fast_update:
        for pool in fast_update.update_pools(agents, optim.parallel_micro_batches):
            with seeded(seeds[pool[0]], agents[pool[0]].parameters[0].device):
                stats.update(zip(pool, fast_update.update_agents(
                    [agents[k] for k in pool], [generations[k] for k in pool], [advantages[k] for k in pool],
                    [optimizers[k] for k in pool], [schedulers[k] for k in pool], config.algorithm,
                    micro_batch_size=optim.micro_batch_size, max_grad_norm=optim.max_grad_norm,
                    parallel_micro_batches=optim.parallel_micro_batches, loss=loss)))
    else:
        for k, agent in enumerate(agents):
            with seeded(seeds[k], agent.parameters[0].device):
                stats[k] = magrpo.update_agent(agent, generations[k], advantages[k], optimizers[k], schedulers[k],
                                               config.algorithm, micro_batch_size=optim.micro_batch_size,
                                               max_grad_norm=optim.max_grad_norm, loss=loss)
    return [{**stats[k], "lr": schedulers[k].get_last_lr()[0]} for k in range(len(agents))]


def policy_logprobs(agent: Agent, gen: Generation, reference: bool = False) -> torch.Tensor:
    """(B, C) log-probs of ``gen``'s completion tokens under ``agent``'s current policy (temperature-scaled,
    as sampled), or with ``reference`` under its frozen reference (:meth:`Agent.reference`), without gradients."""
    agent.activate()
    with torch.no_grad(), (agent.reference() if reference else contextlib.nullcontext(agent.model)) as model:
        return token_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask,
                              temperature=agent.sampling.temperature)


def make_backend(config: TrainConfig, env: Environment, team: Team | None = None) -> AgentBackend:
    """The backend ``config`` asks for: the agents in Ray actors (``distributed.backend: ray``), or in this
    process sampled by vLLM (``rollout.backend: vllm``) or transformers. ``team``: agents already built
    (Python API), for a backend in this process."""
    if config.distributed.backend == "ray":
        if team is not None:
            raise ValueError("distributed.backend: 'ray' builds every agent in its own actor from the config; "
                             "pass no team object, or use 'local'")
        from teamrl.distributed import RayTeam

        return RayTeam(config, env)
    if config.distributed.backend == "fsdp":
        if team is not None:
            raise ValueError("distributed.backend: 'fsdp' builds and shards the team on every rank from the config; "
                             "pass no team object, or use 'local'")
        from teamrl.distributed.fsdp import FSDPBackend

        return FSDPBackend.from_config(config, env)
    if team is None:
        team = Team.from_config(config.team, env, seed=config.seed, need_reference=config.algorithm.uses_reference)
    if config.rollout.backend == "vllm":
        from teamrl.rollout.vllm_backend import VLLMBackend

        return VLLMBackend(team, config)
    return LocalBackend(team, config)
