"""Returns over the rollout tree and group-relative advantages (paper Eq. 1), as small pure functions.

Shapes: a turn's rewards are (E, M, K): E expansion points (an item at turn 1, a non-terminal joint
action of the previous turn later), M joint actions per point (G aligned, G^n cross) — the group —
and K reward channels (1 for the joint reward; one per agent for independent learners). An agent's
advantages are (E, G), one per sample it drew at each point (:func:`sample_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from teamrl._deprecated import moved_names
from teamrl.registry import ADVANTAGES

if TYPE_CHECKING:
    from teamrl.rollout.tree import RolloutTree

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
register_advantage = ADVANTAGES.register
"""``@register_advantage(name, leave_the_sample_out=False)``: make an estimator (returns over the last dim ->
advantages) selectable as ``algorithm.advantage: name``. ``leave_the_sample_out=True``: its baseline for sample g
is built from the other samples' returns only (as 'rloo' and 'max'), so :func:`sample_advantages` gives it one
return per sample."""


@register_advantage("mean")
def mean_baseline(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g - mean(R): the paper's Eq. 1."""
    return returns - returns.mean(dim=-1, keepdim=True)


@register_advantage("std")
def std_normalised(returns: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(R_g - mean(R)) / (std(R) + eps), GRPO's default; std is the unbiased sample std, as in TRL."""
    return mean_baseline(returns) / (returns.std(dim=-1, keepdim=True) + eps)


@register_advantage("rloo", leave_the_sample_out=True)
def leave_one_out(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g - mean of the other G-1 returns (RLOO), i.e. G/(G-1) times the mean-baseline advantage."""
    size = returns.shape[-1]
    return mean_baseline(returns) * size / (size - 1)


@register_advantage("none")
def no_baseline(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g: plain REINFORCE on the return."""
    return returns.clone()


@register_advantage("max", leave_the_sample_out=True)
def best_of_others(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g - max of the other G-1 returns: MAReMax's max baseline, left out of its own sample.

    Only a sample that beats every sibling is pushed up (by its margin over the runner-up); a tie for the
    best gets 0. Leaving R_g out keeps the baseline independent of sample g, so the gradient stays an
    unbiased estimate of the return's; CoMLRL's R_g - max_k R_k (every sample counted) gives the best
    sample exactly 0 and the gradient of E[min(R_g, max of the others)] instead (docs/reports/comlrl-algorithms.md).
    That holds when R_g is the only return that depends on sample g: in cross mode each sample is in
    G^(n-1) joint actions, and :func:`sample_advantages` hands this function one value per sample.
    """
    size = returns.shape[-1]
    if size < 2:
        raise ValueError(f"the max baseline needs at least 2 returns per group (got {size})")
    top2 = returns.topk(2, dim=-1).values
    best, runner_up = top2[..., :1], top2[..., 1:]
    # The best of the others is the group's best, except for the sample that holds it (a tie: the same value).
    others_best = torch.where(returns == best, runner_up, best)
    return returns - others_best


def sample_advantages(returns: torch.Tensor, combos: torch.Tensor, agent: int, num_samples: int,
                      mode: str) -> torch.Tensor:
    """(E, G) advantage of each of ``agent``'s samples, from the (E, M) returns of one reward channel.

    Sample g's value is its mean return over the joint actions it is in (one when aligned; its G^(n-1)
    pairings with the partners' samples in cross mode). A baseline the group shares ('mean', 'none';
    'std' also divides by the group's spread) runs over the M joint actions, as Eq. 1 reads, and sample
    g gets the mean advantage of its joint actions: for 'mean' and 'none' the same as over the samples'
    values. A baseline that leaves sample g out ('rloo', 'max') has to leave out every joint action it
    is in, or it depends on sample g (leaving out one joint action at a time, 'max' is biased and 'rloo'
    shrunk toward 0), so it runs over the agent's other samples' values. Then E[A_g | sample g] = E[R | sample g]
    - a constant: an unbiased gradient ('mean' gives (G-1)/G E[R | sample g] - a constant, its own share
    counted; 'std''s spread depends on sample g, as in GRPO).
    """
    estimate = ADVANTAGES.lookup(mode)
    if ADVANTAGES.properties(mode).get("leave_the_sample_out"):
        return estimate(agent_advantages(returns, combos, agent, num_samples))
    return agent_advantages(estimate(returns), combos, agent, num_samples)


def episode_advantages(returns: torch.Tensor, mode: str) -> torch.Tensor:
    """(E, G) advantage of each of G episodes of a program on each of E items, from their (E, G) joint returns: Eq. 1
    over the G episodes of an item (aligned mode with whole trajectories as the joint actions: each episode is in one
    group, so an estimator that leaves the sample out sees the others' returns only, as :func:`sample_advantages`
    gives it them)."""
    return ADVANTAGES.lookup(mode)(returns)


def absorbing_factor(turns_left: int, discount: float, turn_reward: str = "state") -> float:
    """What a reward r of the turn early termination stopped is worth, as a multiple of r, with ``turns_left``
    turns from that one to the horizon (it included): sum_{k=0}^{turns_left-1} discount^k when a 'state'
    reward is earned again on every turn the team stays (:func:`tree_returns`), 1 for an 'increment'."""
    if turns_left < 1:
        raise ValueError(f"turns_left must be >= 1 (got {turns_left})")
    if turn_reward not in ("state", "increment"):
        raise ValueError(f"turn_reward: 'state' or 'increment' (got {turn_reward!r}); set the environment's "
                         f"turn_reward to one of them")
    return float(sum(discount**k for k in range(turns_left))) if turn_reward == "state" else 1.0


def tree_returns(rewards: list[torch.Tensor], parents: list[torch.Tensor], discount: float,
                 terminated: list[torch.Tensor] | None = None, num_turns: int | None = None,
                 turn_reward: str = "state") -> list[torch.Tensor]:
    """Returns over the rollout tree, turn t = 1..T:

    * a joint action of the last turn T (or any other leaf): R = r;
    * an inner node: R = r + discount * mean(R of its children);
    * a joint action early termination stopped at turn t < T: R = r * sum_{k=0}^{T-t} discount^k when
      the reward is a 'state' value, R = r when it is an 'increment' (``turn_reward``, the environment's
      :attr:`~teamrl.envs.base.Environment.turn_reward`).

    An early-terminated joint action is an absorbing state: the episode stays where the team stopped, and
    it earns on each remaining turn what staying there earns. Which that is depends on what a turn's
    reward measures. A 'state' reward scores what the team holds (a program's grade), so staying earns it
    again every turn: valued as a plain leaf (R = r), the stop would collect one turn's reward against its
    siblings' several and rank below siblings that solved nothing (issue #22's example in
    docs/algorithm.md); repeated, it gets exactly what a sibling holding the same reward to the end gets.
    An 'increment' reward pays the progress of the turn (shaped rewards, whose turns add up to the final
    score), so staying earns 0 and R = r: repeating it would count the same progress once per remaining
    turn (a half-built team stopping at 0.5 with two turns left was valued 1.5, above the 1.0 of finishing
    and above any episode's return). Either way a stop is worth what continuing without change is worth,
    never more than reaching further. A cap cannot replace the distinction: a stop at reward r is worth
    r * sum gamma^k for a state and r for an increment, so any cap either undervalues a state held to the
    end or lets a partial increment tie with finishing.

    Args:
        rewards: per turn, (E_t, M, K) rewards of every joint action.
        parents: per turn t >= 1, (E_t,) the flat index (into turn t-1's E_{t-1} * M joint actions) of
            the joint action each expansion point of turn t grew from. A joint action no point grew
            from is a leaf.
        discount: gamma.
        terminated: per turn, (E_t, M) bool, the joint actions early termination stopped (leaves valued
            as absorbing states). None: no joint action was stopped.
        num_turns: T, the horizon terminated joint actions are valued up to; the tree itself may end
            before T when every joint action of a turn was stopped. None: the tree's depth.
        turn_reward: 'state' (default) or 'increment', what a stopped joint action's reward stands for.
    Returns:
        per turn, (E_t, M, K) returns.
    Raises:
        ValueError: ``num_turns`` is shorter than the tree, ``terminated`` does not match the rewards,
            or a stopped joint action has children.
    """
    horizon = len(rewards) if num_turns is None else num_turns
    if horizon < len(rewards):
        raise ValueError(f"num_turns: the tree has {len(rewards)} turns, more than the horizon {horizon}")
    returns = [r.clone() for r in rewards]
    if terminated is not None:
        if len(terminated) != len(rewards):
            raise ValueError(f"terminated: one mask per turn is needed ({len(rewards)}), got {len(terminated)}")
        for turn, (turn_returns, stopped) in enumerate(zip(returns, terminated)):
            if stopped.shape != turn_returns.shape[:2]:
                raise ValueError(f"terminated[{turn}]: shape {tuple(stopped.shape)} does not match the turn's "
                                 f"joint actions {tuple(turn_returns.shape[:2])}")
            if turn + 1 < len(rewards) and stopped.reshape(-1)[parents[turn + 1]].any():
                raise ValueError(f"terminated[{turn}]: a stopped joint action has children at turn {turn + 2}")
            turn_returns[stopped] *= absorbing_factor(horizon - turn, discount, turn_reward)
    for turn in range(len(rewards) - 1, 0, -1):
        previous = returns[turn - 1]
        flat = previous.view(-1, previous.shape[-1])
        flat.index_add_(0, parents[turn], discount * returns[turn].mean(dim=1))
    return returns


def normalize_per_agent(per_agent: list[list[torch.Tensor]], floor: float = 1e-4) -> list[list[torch.Tensor]]:
    """Each agent's advantages (one tensor per turn) divided by that agent's own root mean square over the step
    (every turn's completions together; at least ``floor``), not re-centred.

    Why: 'std' scales by the spread of the joint returns of a group, which every agent shares; in cross
    mode (or with individual rewards) agents' advantages differ in spread (an agent whose samples barely
    change the joint reward gets tiny advantages), and this puts each agent's update on the same scale,
    as the critic's per-agent whitening does for 'maac' and 'iac'. The root mean square, not the spread around
    the mean: a group baseline has already centred the advantages (then the two agree), and an estimator without
    a baseline ('none') leaves them all one sign, whose spread may be near zero (constant rewards of 0.5 would
    be divided by ~0 and become thousands); their root mean square is their size. ``floor`` keeps a step whose
    advantages are all (nearly) zero near zero.

    What it costs: the scale is computed from the step's own samples, so each agent's update direction within a
    step is unchanged but the step's gradient is no longer an unbiased estimate of the return's gradient (each
    sample's weight depends on the others', as with GRPO's 'std'); measured against the unscaled update, the
    direction over a step agrees closely (cosine 0.93-0.995 with one item a step, issue #51's audit), not exactly.
    """
    scaled = []
    for turns in per_agent:
        rms = torch.cat(turns).pow(2).mean().sqrt().clamp(min=floor)
        scaled.append([a / rms for a in turns])
    return scaled


def agent_advantages(joint: torch.Tensor, combos: torch.Tensor, agent: int, num_samples: int) -> torch.Tensor:
    """(E, G) value of each of ``agent``'s samples: the mean of the (E, M) per-joint-action ``joint``
    (advantages, or returns) over the joint actions it belongs to.

    Aligned, each sample is in exactly one joint action and gets its value unchanged (the
    centralised advantage of Eq. 1); cross, it is averaged over the G^(n-1) joint actions it is part of.
    """
    membership = F.one_hot(combos[:, agent], num_samples).to(joint.dtype)  # (M, G)
    return joint @ membership / membership.sum(dim=0)


def rollout_metrics(tree: RolloutTree, returns: list[torch.Tensor],
                    agent_advantages_: list[list[torch.Tensor]]) -> dict[str, float]:
    """Per-turn joint reward and return statistics of a step's rollout ``tree`` (``returns`` as the algorithm
    computed them, e.g. :func:`~teamrl.algorithms.magrpo.advantages`; early-terminated joint actions valued as
    absorbing states), how many joint actions early termination stopped, and advantage statistics, for logging; and
    ``reward/episode/mean``, the undiscounted sum of an episode's joint rewards down the tree (a turn-1 joint
    action's reward plus the mean of its children's, and so on), the training counterpart of held-out
    evaluation's ``reward/mean`` over episodes of ``num_turns`` turns."""
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


# The joint-action designs moved to the rollout tree's module (issue #47).
__getattr__ = moved_names(__name__, {"joint_action_combos": "teamrl.rollout.tree:joint_action_combos",
                                     "balanced_joint_design": "teamrl.rollout.tree:balanced_joint_design"})
