"""MAGRPO: Multi-Agent Group Relative Policy Optimization (Liu et al., arXiv 2508.04652), in one file.

One training step for a batch of items:

1. Rollout (:func:`~teamrl.rollout.tree.sample_tree`, shared by every algorithm). At turn 1 every agent samples
   G completions of its own observation of each item. Joint actions pair them ('aligned': the g-th of every
   agent, G joint actions; 'cross': every combination, G^n, or a balanced random sample of
   ``max_joint_actions`` of them). Each joint action gets one joint reward r. For T > 1, every joint action
   (unless early termination stopped it) is a node from which the environment gives each agent its next
   observation, and every agent again samples G completions: an aligned tree with G^T leaves.
2. Returns (:func:`~teamrl.algorithms.advantages.tree_returns`): R = r at a leaf of the last turn,
   R = r + gamma * mean(R of the children) at an inner node, and a joint action early termination
   stopped at turn t is an absorbing state: R = r * sum_{k=0}^{T-t} gamma^k when a turn's reward scores
   the state the team holds, R = r when it pays the turn's progress (the environment's ``turn_reward``).
3. Advantages, paper Eq. 1 (:func:`advantages`, :func:`~teamrl.algorithms.advantages.sample_advantages`): over
   the joint actions that share a parent node, A_g = R_g - mean(R) (or a registered variant). The advantage
   is centralised: every agent's part of joint action g gets the same A_g ('cross': an agent's sample
   gets the mean over the joint actions it is in; a baseline that leaves the sample out, 'rloo' or
   'max', compares its mean return over them with its other samples').
4. Update, paper Eq. 2 (:meth:`MAGRPO.learn` -> the agents' backend -> :func:`~teamrl.algorithms.update.update_agent`):
   each agent, with its own optimiser, maximises mean_g A_g * log pi_theta_i(a_i^g | o_i) over its completions
   of every turn, with optional PPO-style clipping over several passes and a KL penalty to its reference.
   :mod:`teamrl.algorithms.fast_update` computes the same update faster (shared prompt passes, threads, LoRA
   agents pooled on one base).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from teamrl._deprecated import moved_names
from teamrl.algorithms.advantages import (
    episode_advantages,
    normalize_per_agent,
    rollout_metrics,
    sample_advantages,
    tree_returns,
)
from teamrl.algorithms.base import AgentBackend, TrainsTheAgentsOnly, register_algorithm
from teamrl.config import AlgorithmConfig, TrainConfig
from teamrl.rollout.tree import RolloutTree

if TYPE_CHECKING:
    from teamrl.envs.base import Environment
    from teamrl.rollout.episodes import ProgramRollout


# Registered bottom-up: magrpo first, as `teamrl compare --algorithms all` lists them.
@register_algorithm("maremax", advantage="max")
@register_algorithm("marloo", advantage="rloo")
@register_algorithm("mareinforce", advantage="none")
@register_algorithm("magrpo")
class MAGRPO(TrainsTheAgentsOnly):
    """The learning half of a MAGRPO step (:class:`~teamrl.algorithms.base.Algorithm`): returns and Eq. 1's
    advantages over the tree (:func:`advantages`), then every agent's Eq. 2 update through its backend.

    MAREINFORCE, MARLOO and MAReMax are this class under their own names: the same step with the advantage
    estimator the name fixes (registered with it: raw return, leave-one-out mean, best of the others), as
    ``config.advantage_estimator`` resolves it."""

    #: The settings of other algorithms, refused at load when set (:class:`~teamrl.algorithms.base.Algorithm`).
    ignores = ("critic", "preference", "dpo", "reward_model")
    #: It learns from a program task's episodes (:meth:`learn_episodes`); see :func:`teamrl.config.check_program`.
    learns_from_programs = True

    def __init__(self, config: TrainConfig, env: Environment, agents: AgentBackend):
        self.config = config.algorithm

    def learn(self, tree: RolloutTree, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        names = agents.names
        per_agent, returns = advantages(tree, len(names), self.config)
        metrics = rollout_metrics(tree, returns, per_agent)
        generations = [[turn.generations[i] for turn in tree.turns] for i in range(len(names))]
        for name, stats in zip(names, agents.update(generations, per_agent, seeds)):
            metrics.update({f"{name}/{key}": value for key, value in stats.items()})
        return metrics

    def learn_episodes(self, rollout: ProgramRollout, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        """Learn from a program task's episodes (:mod:`teamrl.rollout.episodes`): Eq. 1 over the G episodes of each
        item, and every agent's Eq. 2 update on each of its calls with its episode's advantage (an agent an episode
        never called learns nothing from it). See docs/algorithm.md#programs-trajectories-as-joint-actions."""
        names = agents.names
        per_agent = program_advantages(rollout, self.config)
        metrics = program_metrics(rollout, per_agent, names)
        for name, stats in zip(names, agents.update([[gen] for gen in rollout.generations], per_agent, seeds)):
            metrics.update({f"{name}/{key}": value for key, value in stats.items()})
        return metrics


def advantages(tree: RolloutTree, num_agents: int,
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


def program_advantages(rollout: ProgramRollout, config: AlgorithmConfig) -> list[list[torch.Tensor]]:
    """Per agent, one (rows,) tensor: the advantage of the episode each of its calls was made in (Eq. 1 over the G
    episodes of an item, :func:`~teamrl.algorithms.advantages.episode_advantages`)."""
    flat = episode_advantages(rollout.rewards, config.advantage_estimator).reshape(-1)
    per_agent = [[flat[rows]] for rows in rollout.episode_of_row]
    if config.normalize_advantages == "agent":
        per_agent = [normalize_per_agent([turns])[0] if turns[0].numel() else turns for turns in per_agent]
    return per_agent


def program_metrics(rollout: ProgramRollout, per_agent: list[list[torch.Tensor]],
                    names: Sequence[str]) -> dict[str, float]:
    """A program step's joint reward, advantage and per-agent call statistics, for logging."""
    rewards = rollout.rewards.reshape(-1)
    every = torch.cat([a for turns in per_agent for a in turns])
    episodes = rewards.numel()
    metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if episodes > 1 else 0.0,
               "advantage/mean": float(every.mean()) if every.numel() else 0.0,
               "advantage/abs_mean": float(every.abs().mean()) if every.numel() else 0.0,
               "episodes": float(episodes)}
    metrics["reward/episode/mean"] = metrics["return/mean"] = metrics["reward/mean"]
    for name, generation in zip(names, rollout.generations):
        metrics[f"{name}/calls_per_episode"] = generation.completion_ids.shape[0] / episodes
    return metrics


# Names this module held before the rollout tree and the update got modules of their own (issue #47).
__getattr__ = moved_names(__name__, {
    "Turn": "teamrl.rollout.tree:Turn", "Rollout": "teamrl.rollout.tree:RolloutTree",
    "SampleFn": "teamrl.rollout.tree:SampleFn", "rollout": "teamrl.rollout.tree:sample_tree",
    "team_sampler": "teamrl._deprecated:team_sampler",
    "update_agent": "teamrl.algorithms.update:update_agent", "micro_batches": "teamrl.algorithms.update:micro_batches",
    "clip_gradients": "teamrl.algorithms.update:clip_gradients", "UpdateStats": "teamrl.algorithms.update:UpdateStats",
    "NonFiniteUpdate": "teamrl.algorithms.update:NonFiniteUpdate",
})
