"""The agents in this process: :class:`LocalBackend`, sampled with transformers and updated with torch, and the
update of a step's agents (:func:`train_agents`) that every backend runs (a Ray agent actor for its one agent).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from teamrl.algorithms import fast_update
from teamrl.algorithms.logprobs import token_logprobs
from teamrl.algorithms.update import make_optimizer, update_agent
from teamrl.checkpoint import AgentState, agent_state, restore_agent_state
from teamrl.config import TrainConfig
from teamrl.rollout.continuous import ContinuousBatcher, TokenEngine
from teamrl.rollout.generate import Generation, sample_team, seeded
from teamrl.team import Agent, Team


class LocalBackend:
    """The agents in this process: sampled with transformers (:func:`~teamrl.rollout.generate.sample_team`),
    updated with torch (:func:`train_agents`), one AdamW and schedule per agent."""

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

    def token_engine(self, max_rows: int = 64) -> TokenEngine:
        """What samples a program task's calls, one at a time from many episodes (:mod:`teamrl.serve.gateway`): the
        continuous batcher over these agents."""
        return ContinuousBatcher(self.team, max_rows=max_rows)

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        return sample_team(self.team, observations, num_samples, seed, compile=self.config.rollout.compile)

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


def train_agents(agents: Sequence[Agent], generations: Sequence[list[Generation]],
                 advantages: Sequence[list[torch.Tensor]], optimizers: Sequence[torch.optim.Optimizer],
                 schedulers: Sequence[Any], config: TrainConfig, seeds: Sequence[int],
                 loss: str = "policy_gradient") -> list[dict[str, float]]:
    """The agents' updates of a step (paper Eq. 2, :func:`update_agent`, or the same computed by
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
                stats[k] = update_agent(agent, generations[k], advantages[k], optimizers[k], schedulers[k],
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
