"""MAGRPO: Multi-Agent Group Relative Policy Optimization (Liu et al., arXiv 2508.04652), in one file.

One training step for a batch of items:

1. Rollout (:func:`rollout`). At turn 1 every agent samples G completions of its own observation of
   each item. Joint actions pair them ('aligned': the g-th of every agent, G joint actions; 'cross':
   every combination, G^n, or a balanced random sample of ``max_joint_actions`` of them). Each joint
   action gets one joint reward r. For T > 1, every joint action
   (unless early termination stopped it) is a node from which the environment gives each agent its next
   observation, and every agent again samples G completions: an aligned tree with G^T leaves.
2. Returns (:func:`~teamrl.algorithms.advantages.tree_returns`): R = r at a leaf of the last turn,
   R = r + gamma * mean(R of the children) at an inner node, and a joint action early termination
   stopped at turn t is an absorbing state: R = r * sum_{k=0}^{T-t} gamma^k when a turn's reward scores
   the state the team holds, R = r when it pays the turn's progress (the environment's ``turn_reward``).
3. Advantages, paper Eq. 1 (:func:`~teamrl.algorithms.advantages.sample_advantages`): over the
   joint actions that share a parent node, A_g = R_g - mean(R) (or a registered variant). The advantage
   is centralised: every agent's part of joint action g gets the same A_g ('cross': an agent's sample
   gets the mean over the joint actions it is in; a baseline that leaves the sample out, 'rloo' or
   'max', compares its mean return over them with its other samples').
4. Update, paper Eq. 2 (:func:`update_agent`): each agent, with its own optimiser, maximises
   mean_g A_g * log pi_theta_i(a_i^g | o_i) over its completions of every turn, with optional PPO-style
   clipping over several passes and a KL penalty to its reference. :mod:`teamrl.algorithms.fast_update`
   computes the same update faster (shared prompt passes, threads, LoRA agents pooled on one base).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from teamrl.algorithms.advantages import (
    joint_action_combos,
    normalize_per_agent,
    sample_advantages,
    tree_returns,
)
from teamrl.algorithms.base import TrainsTheAgentsOnly, register_algorithm
from teamrl.algorithms.logprobs import completion_logprobs
from teamrl.algorithms.losses import contributes, loss_normalizer, update_loss
from teamrl.config import AlgorithmConfig, TrainConfig
from teamrl.envs.base import Environment, Item, Step
from teamrl.envs.checks import checked_individual_rewards, checked_observations, checked_rewards
from teamrl.rewards.base import RewardResult
from teamrl.rollout.generate import Generation, derive_seed, generate_team
from teamrl.team import Agent, Team

if TYPE_CHECKING:
    from teamrl.backend import AgentBackend


@dataclass
class Turn:
    """Everything one turn of the rollout tree produced."""

    parents: torch.Tensor
    """(E,) flat index of the previous turn's joint action each expansion point grew from (item index at turn 1)."""
    items: list[Item]
    histories: list[tuple[Step, ...]]
    observations: list[list[str]]
    """``observations[e][i]``: agent i's observation at expansion point e."""
    generations: list[Generation]
    """generations[i]: agent i's E x G completions, G consecutive rows per expansion point."""
    combos: torch.Tensor
    """(M, n): joint action m takes sample combos[m, i] of agent i."""
    results: list[RewardResult]
    """Joint reward of each of the E x M joint actions."""
    rewards: torch.Tensor
    """(E, M, K): the reward channel(s) learners use (K=1 joint, K=n individual)."""
    terminated: torch.Tensor
    """(E, M) bool: the joint actions early termination stopped before the last turn (absorbing states)."""
    generation_seconds: float = 0.0

    def joint_action(self, e: int, m: int) -> tuple[str, ...]:
        """The completions making up joint action m of expansion point e."""
        num_samples = self.generations[0].completion_ids.shape[0] // len(self.parents)
        return tuple(gen.texts[e * num_samples + int(g)] for gen, g in zip(self.generations, self.combos[m]))


@dataclass
class Rollout:
    """A step's rollout tree, turn by turn."""

    turns: list[Turn] = field(default_factory=list)
    turn_reward: str = "state"
    """The environment's :attr:`~teamrl.envs.base.Environment.turn_reward`: what a stopped joint action is worth."""
    num_turns: int | None = None
    """T, the horizon stopped joint actions are valued up to (the tree ends earlier when every one stopped);
    None: the tree's depth."""


SampleFn = Callable[[Sequence[list[str]], int, int], list[Generation]]
"""``sample(observations, num_samples, seed)``: for every agent i in seat order, ``num_samples``
completions of each of its own observations ``observations[i]``, prompted in its role; ``seed`` fixes the
tokens. :func:`team_sampler` samples a :class:`~teamrl.team.Team` in this process; a
:class:`~teamrl.distributed.RayTeam` samples in its agent actors."""


def team_sampler(team: Team) -> SampleFn:
    """The :data:`SampleFn` of a team in this process: one batched generate call per agent (per base model,
    when LoRA agents share one)."""

    def sample(observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        return generate_team(team, team.prompts(observations), num_samples, seed=seed)

    return sample


def rollout(sample: SampleFn, env: Environment, items: Sequence[Item], config: AlgorithmConfig, *,
            seed: int = 0) -> Rollout:
    """Sample the MAGRPO tree for ``items``: per turn, every agent's G completions of each of its
    observations at once (``sample``, seeded from ``seed`` and the turn)."""
    num_samples, individual = config.num_generations, config.learners == "individual"
    frontier = [(item, ()) for item in items]
    parents = torch.arange(len(items))
    tree = Rollout(turn_reward=env.turn_reward, num_turns=config.num_turns)
    for turn in range(config.num_turns):
        observations = [checked_observations(env, "observe", item, env.observe(item)) if not history
                        else checked_observations(env, "next_observations", item, env.next_observations(item, history))
                        for item, history in frontier]
        start = time.perf_counter()
        generations = sample([[obs[i] for obs in observations] for i in range(env.num_agents)], num_samples,
                             derive_seed(seed, turn))
        seconds = time.perf_counter() - start
        # Capped cross mode: one balanced random design per turn, shared by the turn's nodes and seeded like
        # the tokens (a resumed run or a Ray actor draws the same); each node's design is still uniform.
        combos = joint_action_combos(env.num_agents, num_samples, config.joint_mode, config.max_joint_actions,
                                     derive_seed(seed, turn, "joint_actions"))
        stopped = torch.zeros(len(frontier), len(combos), dtype=torch.bool)
        record = Turn(parents, [f[0] for f in frontier], [f[1] for f in frontier], observations, generations,
                      combos, [], torch.empty(0), stopped, seconds)
        requests = [(item, record.joint_action(e, m), history)
                    for e, (item, history) in enumerate(frontier) for m in range(len(combos))]
        # Checked before anything learns from them: a NaN reward would make every weight NaN.
        record.results = checked_rewards(env, requests, env.joint_rewards(requests))
        channels = (checked_individual_rewards(env, requests, env.individual_rewards_many(requests)) if individual
                    else [[result.total] for result in record.results])
        record.rewards = torch.tensor(channels, dtype=torch.float32).view(len(frontier), len(combos), -1)
        tree.turns.append(record)

        next_frontier, next_parents = [], []
        if turn + 1 < config.num_turns:  # the last turn's joint actions are ordinary leaves, never "stopped"
            threshold = config.early_termination_threshold
            for flat, ((item, actions, history), result) in enumerate(zip(requests, record.results)):
                if threshold is not None and result.total >= threshold:
                    stopped.view(-1)[flat] = True
                    continue
                step = Step(tuple(observations[flat // len(combos)]), tuple(actions), result)
                next_frontier.append((item, (*history, step)))
                next_parents.append(flat)
        if not next_frontier:
            break
        frontier, parents = next_frontier, torch.tensor(next_parents)
    return tree


@register_algorithm("magrpo")
@register_algorithm("mareinforce")
@register_algorithm("marloo")
@register_algorithm("maremax")
class MAGRPO(TrainsTheAgentsOnly):
    """The learning half of a MAGRPO step (:class:`~teamrl.algorithms.base.Algorithm`): returns and Eq. 1's
    advantages over the tree (:func:`advantages`), then every agent's Eq. 2 update through its backend.

    MAREINFORCE, MARLOO and MAReMax are this class under their own names: the same step with the advantage
    estimator the name fixes (:data:`~teamrl.config.FIXED_ADVANTAGES`: raw return, leave-one-out mean,
    best of the others), as ``config.advantage_estimator`` resolves it."""

    def __init__(self, config: TrainConfig, env: Environment, agents: AgentBackend):
        self.config = config.algorithm

    def learn(self, tree: Rollout, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        names = agents.names
        per_agent, returns = advantages(tree, len(names), self.config)
        metrics = rollout_metrics(tree, returns, per_agent)
        generations = [[turn.generations[i] for turn in tree.turns] for i in range(len(names))]
        for name, stats in zip(names, agents.update(generations, per_agent, seeds)):
            metrics.update({f"{name}/{key}": value for key, value in stats.items()})
        return metrics



def advantages(tree: Rollout, num_agents: int,
               config: AlgorithmConfig) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per agent and turn, the (E*G,) advantage of each of its completions; and the returns of each turn."""
    returns = tree_returns([t.rewards for t in tree.turns], [t.parents for t in tree.turns], config.discount,
                           [t.terminated for t in tree.turns], config.num_turns, tree.turn_reward)
    per_agent: list[list[torch.Tensor]] = [[] for _ in range(num_agents)]
    for turn, turn_returns in zip(tree.turns, returns):
        for i in range(num_agents):
            channel = turn_returns[:, :, min(i, turn_returns.shape[2] - 1)]  # the shared reward, or agent i's own
            per_agent[i].append(sample_advantages(channel, turn.combos, i, config.num_generations,
                                                  config.advantage_estimator).reshape(-1))  # Eq. 1, per point
    if config.normalize_advantages == "agent":
        per_agent = normalize_per_agent(per_agent)
    return per_agent, returns


def update_agent(
    agent: Agent,
    generations: list[Generation],
    advantages: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: AlgorithmConfig,
    *,
    micro_batch_size: int = 0,
    max_grad_norm: float | None = None,
    loss: str = "policy_gradient",
) -> dict[str, float]:
    """Paper Eq. 2 for one agent: ``num_iterations`` steps of its own optimiser on its completions of every
    turn (``generations[t]``, with their advantages ``advantages[t]``), ``micro_batch_size`` rows per
    forward pass. :mod:`teamrl.algorithms.fast_update` computes the same, faster (``optim.fast_update``).
    ``loss`` names another loss of :data:`~teamrl.algorithms.losses.LOSSES` to minimise instead, whose
    per-row values ``advantages`` then holds (e.g. 'dpo')."""
    objective = update_loss(loss)
    batches = [(gen.rows(start, stop).trimmed(), adv[start:stop].to(gen.completion_ids.device))
               for gen, adv in zip(generations, advantages)
               for start, stop in micro_batches(len(adv), micro_batch_size, objective.rows_per_example)]
    # A zero advantage gives exactly zero gradient: without a KL term, its forward pass is skipped.
    batches = [(gen, adv) for gen, adv in batches if contributes(objective, adv, config.kl_coef)]
    normalizer = loss_normalizer([gen.completion_mask for gen in generations], config.logprob_aggregation,
                                 objective.rows_per_example)
    temperature = agent.sampling.temperature
    reference: list[torch.Tensor | None] = [None] * len(batches)
    if config.kl_coef > 0:
        with torch.no_grad(), agent.reference() as frozen:
            reference = [completion_logprobs(frozen, gen, temperature) for gen, _ in batches]
    old: list[torch.Tensor | None] = [None] * len(batches)
    stats = UpdateStats(config.num_iterations)
    agent.activate()
    agent.model.train()
    for _ in range(config.num_iterations):  # PPO-style passes over one rollout; 1: plain policy gradient
        optimizer.zero_grad(set_to_none=True)
        for b, (gen, adv) in enumerate(batches):
            logprobs = completion_logprobs(agent.model, gen, temperature)  # log pi_theta_i(a_i^g | o_i)
            if old[b] is None:
                old[b] = logprobs.detach()  # before the first step, the policy is the one that sampled
            # Eq. 2: -mean_g A_g * ratio, clipped, + KL to the reference (or the loss named by ``loss``)
            batch_loss, batch_stats = objective.compute(logprobs, old[b], adv, gen.completion_mask, config=config,
                                                        normalizer=normalizer, ref_logprobs=reference[b])
            batch_loss.backward()
            stats.add(float(batch_loss.detach()), batch_stats)
        stats.end_step(clip_gradients(agent.parameters, max_grad_norm, f"agent {agent.name!r}"))
        optimizer.step()
        scheduler.step()
    agent.model.eval()
    return stats.result()


def micro_batches(size: int, micro_batch_size: int, rows_per_example: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of consecutive row ranges; each runs as its own forward pass without the padding
    columns none of its rows needs (``Generation.rows(...).trimmed()``). A range holds whole examples of
    ``rows_per_example`` rows (``micro_batch_size`` rounded up to a multiple of it)."""
    step = -(-micro_batch_size // rows_per_example) * rows_per_example or size
    return [(start, min(start + step, size)) for start in range(0, size, step)]


class NonFiniteUpdate(ValueError):
    """An update's gradients hold a NaN or an infinity: its optimiser step was not taken."""


def clip_gradients(parameters: Sequence[torch.nn.Parameter], max_grad_norm: float | None, owner: str) -> float:
    """Scale the gradients to a total norm of at most ``max_grad_norm`` (None: leave them); their norm
    before, 0 where no parameter has one (every micro-batch skipped). Every optimiser step of an agent or
    critic comes right after this call, so it is where a non-finite update is stopped.

    Raises:
        NonFiniteUpdate: the norm is not finite (NaN or inf); ``owner`` names whose update it is.
    """
    if not any(p.grad is not None for p in parameters):
        return 0.0
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm or float("inf")))
    if not math.isfinite(norm):
        raise NonFiniteUpdate(f"{owner}: the gradients of its update are not finite (norm {norm}), so its optimiser "
                              f"step was not taken; a learning rate too high (optim.lr) is the usual cause")
    return norm


class UpdateStats:
    """An agent's update statistics: per optimiser step, the micro-batches' summed loss, their clip
    fraction and KL weighted by trained tokens, and the gradient norm; each averaged over the steps."""

    def __init__(self, num_iterations: int):
        self.num_iterations = num_iterations
        self.totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "tokens": 0.0}
        self._step = self._new_step()

    @staticmethod
    def _new_step() -> dict[str, float]:
        return {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "tokens": 0.0}

    def add(self, loss: float, stats: dict[str, float]) -> None:
        """A micro-batch's loss and :func:`~teamrl.algorithms.losses.policy_loss` statistics."""
        self._step["loss"] += loss
        self._step["clipped"] += stats["clip_fraction"] * stats["tokens"]
        self._step["kl"] += stats.get("kl", 0.0) * stats["tokens"]
        self._step["tokens"] += stats["tokens"]

    def end_step(self, grad_norm: float) -> None:
        """The optimiser step over the micro-batches added since the last one."""
        step, iterations = self._step, self.num_iterations
        tokens = max(step["tokens"], 1)
        self.totals["loss"] += step["loss"] / iterations
        self.totals["grad_norm"] += grad_norm / iterations
        self.totals["clip_fraction"] += step["clipped"] / tokens / iterations
        self.totals["kl"] += step["kl"] / tokens / iterations
        self.totals["tokens"] = step["tokens"]
        self._step = self._new_step()

    def result(self) -> dict[str, float]:
        """``loss``, ``clip_fraction``, ``kl``, ``grad_norm`` and ``tokens`` (trained in the last step)."""
        return dict(self.totals)


def rollout_metrics(tree: Rollout, returns: list[torch.Tensor],
                    agent_advantages_: list[list[torch.Tensor]]) -> dict[str, float]:
    """Per-turn joint reward and return statistics (returns as :func:`advantages` computed them, early-terminated
    joint actions valued as absorbing states), how many joint actions early termination stopped, and
    advantage statistics, for logging; and ``reward/episode/mean``, the undiscounted sum of an episode's joint
    rewards down the tree (a turn-1 joint action's reward plus the mean of its children's, and so on), the
    training counterpart of held-out evaluation's ``reward/mean`` over episodes of ``num_turns`` turns."""
    metrics: dict[str, float] = {}
    joint_rewards = [torch.tensor([r.total for r in turn.results]).view(*turn.rewards.shape[:2], 1)
                     for turn in tree.turns]
    episode = tree_returns(joint_rewards, [t.parents for t in tree.turns], 1.0, [t.terminated for t in tree.turns],
                           tree.num_turns, tree.turn_reward)[0]
    for t, (turn, turn_returns) in enumerate(zip(tree.turns, returns), start=1):
        joint = torch.tensor([r.total for r in turn.results])
        metrics[f"reward/turn{t}/mean"] = float(joint.mean())
        metrics[f"reward/turn{t}/std"] = float(joint.std()) if joint.numel() > 1 else 0.0
        metrics[f"return/turn{t}/mean"] = float(turn_returns.mean())
        metrics[f"turn{t}/joint_actions"] = float(joint.numel())
        metrics[f"turn{t}/terminated"] = float(turn.terminated.sum())
    every = torch.cat([a for per_turn in agent_advantages_ for a in per_turn])
    metrics["advantage/mean"] = float(every.mean())
    metrics["advantage/std"] = float(every.std()) if every.numel() > 1 else 0.0
    metrics["advantage/abs_mean"] = float(every.abs().mean())
    metrics["reward/mean"] = metrics["reward/turn1/mean"]
    metrics["return/mean"] = metrics["return/turn1/mean"]
    metrics["reward/episode/mean"] = float(episode.mean())
    return metrics
