"""Actor-critic for LLM teams: IAC (independent critics) and MAAC (one centralised critic).

Both learn from the rollout tree MAGRPO samples (:func:`teamrl.rollout.tree.sample_tree`). Where MAGRPO's
baseline is the mean return of a joint action's siblings (Eq. 1), theirs is a learned value of the state
the joint action was taken from, V(s_e), one per expansion point e of the tree:

* ``iac``: agent i has its own critic V_i(o_i) of its own observation (:class:`IAC`);
* ``maac``: one centralised critic V(o_1, ..., o_n) of every agent's observation, whose advantage every
  agent learns from (:class:`MAAC`).

One step (:meth:`ActorCritic.learn`):

1. Values (:meth:`~teamrl.algorithms.critic.Critic.values`): V_old(s_e) of every expansion point of every
   turn, before any update.
2. Advantages, GAE(lambda) over the tree (:func:`gae_advantages`):
   delta_{e,m} = r_{e,m} + gamma V_old(s_{e'}) - V_old(s_e), with s_{e'} the expansion point joint action
   m of e grew into (V = 0 after the last turn; a joint action early termination stopped is valued as the
   absorbing state of :func:`~teamrl.algorithms.advantages.tree_returns`, whose future is known exactly);
   A_{e,m} = delta_{e,m} + gamma lambda mean(A of the joint actions of e'). lambda = 1 (the default) is
   Monte-Carlo, A = R - V_old(s_e) with the tree's returns R; lambda = 0 is one-step TD.
   Agent i's part of joint action m gets A_{e,m} (``cross``: its sample the mean over the joint actions it
   is in, :func:`~teamrl.algorithms.advantages.agent_advantages`); then whitened per agent
   (``critic.normalize_advantages``, on by default: under an untrained critic, V = 0, the unwhitened
   advantages are the raw returns).
3. Actors: every agent's policy-gradient update through its backend with these advantages, exactly as
   MAGRPO's (:meth:`~teamrl.backend.AgentBackend.update`: Eq. 2's loss, ratio clipping over
   ``num_iterations`` passes, KL, micro-batches).
4. Critics (:meth:`~teamrl.algorithms.critic.Critic.fit`): ``num_iterations`` passes of the clipped value
   loss (:func:`~teamrl.algorithms.critic.value_loss`) toward the lambda-returns y = A + V_old(s_e)
   (lambda = 1: the returns R).

With individual rewards (``learners: individual``) agent i's advantage comes from its own reward
channel: IAC's critic i predicts agent i's return, MAAC's critic predicts every agent's (one output each).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from teamrl.algorithms.advantages import absorbing_factor, agent_advantages, rollout_metrics, tree_returns
from teamrl.algorithms.base import register_algorithm
from teamrl.algorithms.critic import build_critics
from teamrl.config import TrainConfig
from teamrl.envs.base import Environment
from teamrl.rollout.generate import derive_seed, seeded
from teamrl.rollout.tree import RolloutTree

if TYPE_CHECKING:
    from teamrl.algorithms.base import AgentBackend
    from teamrl.checkpoint import AgentState


def gae_advantages(rewards: list[torch.Tensor], parents: list[torch.Tensor], values: list[torch.Tensor],
                   discount: float, gae_lambda: float, terminated: list[torch.Tensor] | None = None,
                   num_turns: int | None = None, turn_reward: str = "state") -> list[torch.Tensor]:
    """GAE(lambda) over the rollout tree, turn t = 1..T.

    Args:
        rewards: per turn, (E_t, M, K) rewards of every joint action.
        parents: per turn, (E_t,) the flat index into the previous turn's E_{t-1} * M joint actions of the
            one each expansion point grew from (as :func:`~teamrl.algorithms.advantages.tree_returns`).
        values: per turn, (E_t, K) V(s_e) of each expansion point.
        discount: gamma.
        gae_lambda: lambda; 1 gives A = R - V(s_e), R the tree's returns.
        terminated: per turn, (E_t, M) bool, the joint actions early termination stopped: an absorbing
            state, so their delta is r * sum_{k=0}^{T-t} gamma^k - V(s_e) ('state' rewards, held to the
            horizon) or r - V(s_e) ('increment' rewards: nothing more after the stop).
        num_turns: T, the horizon stopped joint actions are valued up to; None: the tree's depth.
        turn_reward: 'state' or 'increment' (:func:`~teamrl.algorithms.advantages.tree_returns`).
    Returns:
        per turn, (E_t, M, K) advantages.
    """
    horizon = len(rewards) if num_turns is None else num_turns
    deltas = []
    for turn, (reward, value) in enumerate(zip(rewards, values)):
        reward = reward.clone()
        if terminated is not None:
            reward[terminated[turn]] *= absorbing_factor(horizon - turn, discount, turn_reward)
        following = torch.zeros_like(reward)  # V of the state each joint action led to; 0 where none
        if turn + 1 < len(rewards):
            following.view(-1, following.shape[-1])[parents[turn + 1]] = values[turn + 1]
        deltas.append(reward + discount * following - value.unsqueeze(1))
    # A = delta + gamma lambda mean(A of the children) is tree_returns' recursion on the deltas.
    return tree_returns(deltas, parents, discount * gae_lambda)


def whiten(advantages: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """``advantages`` (one tensor per turn) shifted and scaled together to mean 0 and (population) std 1."""
    every = torch.cat(advantages)
    mean, std = every.mean(), every.std(unbiased=False)
    return [(a - mean) / (std + eps) for a in advantages]


class ActorCritic:
    """An actor-critic step (:class:`~teamrl.algorithms.base.Algorithm`). ``centralised`` (:class:`MAAC`) or not
    (:class:`IAC`) decides which critics there are and what each reads."""

    centralised: ClassVar[bool]
    #: A critic's advantages replace the group's: the group estimator and its scaling (the critic whitens per
    #: agent: critic.normalize_advantages), and the preference algorithms' settings, are refused when set.
    ignores: ClassVar[tuple[str, ...]] = ("advantage", "normalize_advantages", "preference", "dpo", "reward_model")

    def __init__(self, config: TrainConfig, env: Environment, agents: AgentBackend):
        self.config = config.algorithm
        self.micro_batch_size, self.max_grad_norm = config.optim.micro_batch_size, config.optim.max_grad_norm
        self.names = list(agents.names)
        channels = len(self.names) if config.algorithm.learners == "individual" else 1
        critic_model = config.algorithm.critic.model
        if self.centralised:  # one critic, an output per reward channel; agent i reads channel i (or the one)
            self.channels = [list(range(channels))]
            self.sources = [(0, min(i, channels - 1)) for i in range(len(self.names))]
            specs = [("critic", critic_model or config.team.model, channels)]
        else:  # critic i predicts agent i's channel, on agent i's own base by default
            self.channels = [[min(i, channels - 1)] for i in range(len(self.names))]
            self.sources = [(i, 0) for i in range(len(self.names))]
            specs = [(f"critic.{name}", critic_model or agent.model or config.team.model, 1)
                     for name, agent in zip(self.names, config.team.agents)]
        self.critics = build_critics(specs, config, env, agents)

    def views(self, observations: Sequence[str]) -> list[str]:
        """What each critic reads of one expansion point, where agent i observes ``observations[i]``: IAC's
        critic i its agent's observation; MAAC's critic all of them, each introduced by its agent's name."""
        if self.centralised:
            return ["\n\n".join(f"{name}: {obs}" for name, obs in zip(self.names, observations))]
        return list(observations)

    def learn(self, tree: RolloutTree, agents: AgentBackend, seeds: Sequence[int]) -> dict[str, float]:
        config, turns = self.config, tree.turns
        parents, terminated = [t.parents for t in turns], [t.terminated for t in turns]
        sizes = [len(t.parents) for t in turns]
        texts = [list(views) for views in zip(*(self.views(obs) for t in turns for obs in t.observations))]
        old_values, advantages, targets = [], [], []
        for critic, critic_texts, channels in zip(self.critics, texts, self.channels):
            values = critic.values(critic_texts, self.micro_batch_size)  # step 1
            rewards = [t.rewards[..., channels] for t in turns]
            critic_advantages = gae_advantages(rewards, parents, list(values.split(sizes)), config.discount,
                                               config.critic.gae_lambda, terminated, config.num_turns,
                                               tree.turn_reward)  # step 2
            old_values.append(values)
            advantages.append(critic_advantages)
            targets.append(torch.cat([a + v.unsqueeze(1) for a, v in zip(critic_advantages, values.split(sizes))]))
        per_agent = [[agent_advantages(advantages[c][t][..., k], turn.combos, i, config.num_generations).reshape(-1)
                      for t, turn in enumerate(turns)] for i, (c, k) in enumerate(self.sources)]
        if config.critic.normalize_advantages:
            per_agent = [whiten(turn_advantages) for turn_advantages in per_agent]

        returns = tree_returns([t.rewards for t in turns], parents, config.discount, terminated, config.num_turns,
                               tree.turn_reward)
        metrics = rollout_metrics(tree, returns, per_agent)
        generations = [[turn.generations[i] for turn in turns] for i in range(len(self.names))]
        for name, stats in zip(self.names, agents.update(generations, per_agent, seeds)):  # step 3
            metrics.update({f"{name}/{key}": value for key, value in stats.items()})
        for critic, critic_texts, values, critic_targets in zip(self.critics, texts, old_values, targets):  # step 4
            with seeded(derive_seed(seeds[0], critic.name), critic.model.head.weight.device):  # LoRA dropout
                stats = critic.fit(critic_texts, values, critic_targets, num_iterations=config.num_iterations,
                                   value_clip=config.critic.value_clip, micro_batch_size=self.micro_batch_size,
                                   max_grad_norm=self.max_grad_norm)
            stats["value_mean"] = float(values.mean())
            stats["explained_variance"] = explained_variance(values, critic_targets)
            metrics.update({f"{critic.name}/{key}": value for key, value in stats.items()})
        return metrics

    def states(self) -> dict[str, AgentState]:
        return {critic.name: critic.state() for critic in self.critics}

    def load_states(self, states: dict[str, AgentState], source: str | Path) -> None:
        for critic in self.critics:
            critic.load_state(states[critic.name], source)


def explained_variance(values: torch.Tensor, targets: torch.Tensor) -> float:
    """1 - Var(y - V) / Var(y) over every target y of the step and the value V of its state, before the update:
    1 for a perfect critic, 0 for one no better than a constant (0 where the targets do not vary)."""
    residual = targets - values.unsqueeze(1)
    variance = float(targets.var(unbiased=False))
    return 1.0 - float(residual.var(unbiased=False)) / variance if variance > 0 else 0.0


@register_algorithm("iac")
class IAC(ActorCritic):
    """Independent actor-critic: agent i's critic V_i(o_i) reads agent i's observation alone."""

    centralised = False


@register_algorithm("maac")
class MAAC(ActorCritic):
    """Multi-agent actor-critic: one centralised critic V(o_1, ..., o_n) of every agent's observation."""

    centralised = True
