"""Returns over the rollout tree and group-relative advantages (paper Eq. 1), as small pure functions.

Shapes: a turn's rewards are (E, M, K): E expansion points (an item at turn 1, a non-terminal joint
action of the previous turn later), M joint actions per point (G aligned, G^n cross) — the group —
and K reward channels (1 for the joint reward; one per agent for independent learners). An agent's
advantages are (E, G), one per sample it drew at each point (:func:`sample_advantages`).
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


@register_advantage("max")
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


LEAVE_THE_SAMPLE_OUT = frozenset({"rloo", "max"})
"""Estimators whose baseline for sample g is built from the other samples' returns only (add a registered
name here if its baseline does the same): :func:`sample_advantages` gives them one return per sample."""


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
    if mode not in ADVANTAGES:
        raise ValueError(f"algorithm.advantage: unknown mode {mode!r}; registered: {', '.join(ADVANTAGES)}")
    estimate = ADVANTAGES[mode]
    if mode in LEAVE_THE_SAMPLE_OUT:
        return estimate(agent_advantages(returns, combos, agent, num_samples))
    return agent_advantages(estimate(returns), combos, agent, num_samples)


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


def joint_action_combos(num_agents: int, num_samples: int, mode: str, max_joint_actions: int | None = None,
                        seed: int = 0) -> torch.Tensor:
    """(M, n): which of its G samples each agent contributes to joint action m.

    'aligned': M = G. 'cross': every combination, M = G^n, unless ``max_joint_actions`` caps it below G^n;
    then M = cap combinations drawn by :func:`balanced_joint_design` (seeded by ``seed``, so a resumed run
    or a Ray actor draws the same design).
    """
    if mode == "aligned":
        return torch.arange(num_samples).unsqueeze(1).expand(num_samples, num_agents).contiguous()
    if mode == "cross":
        if max_joint_actions is not None and max_joint_actions < num_samples**num_agents:
            return balanced_joint_design(num_agents, num_samples, max_joint_actions, seed)
        return torch.tensor(list(itertools.product(range(num_samples), repeat=num_agents)))
    raise ValueError(f"algorithm.joint_mode: unknown mode {mode!r}; use 'aligned' or 'cross'")


def balanced_joint_design(num_agents: int, num_samples: int, size: int, seed: int) -> torch.Tensor:
    """(size, n) distinct joint actions out of the G^n, in which each agent's every sample appears
    floor(size/G) or ceil(size/G) times (a Latin-hypercube-like design).

    Why balanced: :func:`agent_advantages` values a sample by the mean over the joint actions it is in, so
    every sample must be in at least one (size >= G), and equal counts give every sample the same precision.
    Why unbiased: the design is drawn, then each agent's sample labels are relabelled by an independent
    uniform permutation. Its law is thus invariant under relabelling any agent's samples, a group that acts
    transitively on the partners' G^(n-1) combinations; so for a sample g, every partner combination p has
    the same E[1{p in g's joint actions} / (g's count)], and these sum to 1: the expected value of g
    (its mean return over a random subset of its partners' combinations) is its full-cross value, and
    the group mean over the design is the full-cross mean. Linear estimators ('mean', 'none', 'rloo') stay
    unbiased for the full-cross advantage; 'std' and 'max' are nonlinear, as with any finite group.

    Construction: each column a random permutation of a balanced multiset of labels; duplicate rows are
    removed by swapping one agent's labels between two rows (a swap keeps every column's counts), then the
    labels are relabelled per agent.
    """
    total = num_samples**num_agents
    if not num_samples <= size <= total:
        raise ValueError(f"algorithm.max_joint_actions: a capped design needs G={num_samples} <= cap <= G^n={total}"
                         f" (got {size})")
    rng = torch.Generator().manual_seed(seed)
    base = torch.arange(size) % num_samples  # each label floor or ceil(size/G) times
    design = torch.stack([base[torch.randperm(size, generator=rng)] for _ in range(num_agents)], dim=1)
    _remove_duplicate_rows(design, num_samples, rng)
    relabel = torch.stack([torch.randperm(num_samples, generator=rng) for _ in range(num_agents)], dim=1)
    return relabel.gather(0, design)


def _remove_duplicate_rows(design: torch.Tensor, num_samples: int, rng: torch.Generator) -> None:
    """Make ``design``'s rows distinct in place by column-wise swaps (each column keeps its multiset)."""
    size, num_agents = design.shape
    weights = num_samples ** torch.arange(num_agents - 1, -1, -1)
    for _ in range(1000 * size):
        keys = design @ weights
        unique, counts = keys.unique(return_counts=True)
        if len(unique) == size:
            return
        duplicated = unique[counts > 1]
        rows = torch.nonzero(torch.isin(keys, duplicated)).flatten()
        r = int(rows[torch.randint(len(rows), (1,), generator=rng)])
        s = int(torch.randint(size, (1,), generator=rng))
        j = int(torch.randint(num_agents, (1,), generator=rng))
        new_r, new_s = design[r].clone(), design[s].clone()
        new_r[j], new_s[j] = design[s, j], design[r, j]
        key_r, key_s = int(new_r @ weights), int(new_s @ weights)
        others = torch.cat([keys[:min(r, s)], keys[min(r, s) + 1:max(r, s)], keys[max(r, s) + 1:]])
        # Accept a swap that does not add a duplicate: r's new row and s's new row are both free.
        if key_r != key_s and not torch.isin(torch.tensor([key_r, key_s]), others).any():
            design[r], design[s] = new_r, new_s
    raise RuntimeError(f"could not draw {size} distinct balanced joint actions; lower algorithm.max_joint_actions")


def normalize_per_agent(per_agent: list[list[torch.Tensor]], eps: float = 1e-4) -> list[list[torch.Tensor]]:
    """Each agent's advantages (one tensor per turn) divided by that agent's own population std over the
    step (every turn's completions together), not re-centred (the group baseline already centred them).

    Why: 'std' scales by the spread of the joint returns of a group, which every agent shares; in cross
    mode (or with individual rewards) agents' advantages differ in spread (an agent whose samples barely
    change the joint reward gets tiny advantages), and this puts each agent's update on the same scale,
    as the critic's per-agent whitening does for 'maac' and 'iac'.
    """
    scaled = []
    for turns in per_agent:
        std = torch.cat(turns).std(unbiased=False)
        scaled.append([a / (std + eps) for a in turns])
    return scaled


def agent_advantages(joint: torch.Tensor, combos: torch.Tensor, agent: int, num_samples: int) -> torch.Tensor:
    """(E, G) value of each of ``agent``'s samples: the mean of the (E, M) per-joint-action ``joint``
    (advantages, or returns) over the joint actions it belongs to.

    Aligned, each sample is in exactly one joint action and gets its value unchanged (the
    centralised advantage of Eq. 1); cross, it is averaged over the G^(n-1) joint actions it is part of.
    """
    membership = F.one_hot(combos[:, agent], num_samples).to(joint.dtype)  # (M, G)
    return joint @ membership / membership.sum(dim=0)
