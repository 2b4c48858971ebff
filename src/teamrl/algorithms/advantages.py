"""Returns over the rollout tree and group-relative advantages (paper Eq. 1), as small pure functions.

Shapes: a turn's rewards are (E, M, K): E expansion points (an item at turn 1, a non-terminal joint
action of the previous turn later), M joint actions per point (G aligned, G^n cross) — the group —
and K reward channels (1 for the joint reward; one per agent for independent learners).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from teamrl.registry import registrar

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {}
register_advantage = registrar(ADVANTAGES)
"""``@register_advantage(name)``: make an estimator (returns over the last dim -> advantages) selectable."""


@register_advantage("mean")
def mean_baseline(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g - mean(R): the paper's Eq. 1."""
    return returns - returns.mean(dim=-1, keepdim=True)


@register_advantage("std")
def std_normalised(returns: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(R_g - mean(R)) / (std(R) + eps), GRPO's default; std is the unbiased sample std, as in TRL."""
    return mean_baseline(returns) / (returns.std(dim=-1, keepdim=True) + eps)


@register_advantage("rloo")
def leave_one_out(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g - mean of the other G-1 returns (RLOO), i.e. G/(G-1) times the mean-baseline advantage."""
    size = returns.shape[-1]
    return mean_baseline(returns) * size / (size - 1)


@register_advantage("none")
def no_baseline(returns: torch.Tensor) -> torch.Tensor:
    """A_g = R_g: plain REINFORCE on the return."""
    return returns.clone()


def group_advantages(returns: torch.Tensor, mode: str) -> torch.Tensor:
    """Advantages of (E, M, K) returns, each group being the M joint actions of one expansion point."""
    if mode not in ADVANTAGES:
        raise ValueError(f"algorithm.advantage: unknown mode {mode!r}; registered: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[mode](returns.transpose(1, 2)).transpose(1, 2)


def tree_returns(rewards: list[torch.Tensor], parents: list[torch.Tensor], discount: float) -> list[torch.Tensor]:
    """R = r at a leaf, R = r + discount * mean(R of the node's children) at an inner node.

    Args:
        rewards: per turn, (E_t, M, K) rewards of every joint action.
        parents: per turn t >= 1, (E_t,) the flat index (into turn t-1's E_{t-1} * M joint actions) of
            the joint action each expansion point of turn t grew from. A joint action no point grew
            from (last turn, or early termination) is a leaf.
    Returns:
        per turn, (E_t, M, K) returns.
    """
    returns = [r.clone() for r in rewards]
    for turn in range(len(rewards) - 1, 0, -1):
        previous = returns[turn - 1]
        flat = previous.view(-1, previous.shape[-1])
        flat.index_add_(0, parents[turn], discount * returns[turn].mean(dim=1))
    return returns


def joint_action_combos(num_agents: int, num_samples: int, mode: str) -> torch.Tensor:
    """(M, n): which of its G samples each agent contributes to joint action m."""
    if mode == "aligned":
        return torch.arange(num_samples).unsqueeze(1).expand(num_samples, num_agents).contiguous()
    if mode == "cross":
        return torch.tensor(list(itertools.product(range(num_samples), repeat=num_agents)))
    raise ValueError(f"algorithm.joint_mode: unknown mode {mode!r}; use 'aligned' or 'cross'")


def agent_advantages(joint: torch.Tensor, combos: torch.Tensor, agent: int, num_samples: int) -> torch.Tensor:
    """(E, G) advantage of each of ``agent``'s samples: the mean over the joint actions it belongs to.

    Aligned, each sample is in exactly one joint action and gets its advantage unchanged (the
    centralised advantage of Eq. 1); cross, it is averaged over the G^(n-1) joint actions it is part of.
    """
    membership = F.one_hot(combos[:, agent], num_samples).to(joint.dtype)  # (M, G)
    return joint @ membership / membership.sum(dim=0)
