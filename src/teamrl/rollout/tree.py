"""A step's rollout tree: every agent's G completions of each of its observations, turn by turn, the joint
actions they make and their joint rewards (MAGRPO's first half, shared by every algorithm).

At turn 1 every agent samples G completions of its own observation of each item. Joint actions pair them
('aligned': the g-th of every agent, G joint actions; 'cross': every combination, G^n, or a balanced random
sample of ``max_joint_actions`` of them: :func:`joint_action_combos`). Each joint action gets one joint
reward r. For T > 1, every joint action (unless early termination stopped it) is a node from which the
environment gives each agent its next observation, and every agent again samples G completions: an aligned
tree has G^T leaves. What an algorithm learns from the tree is its own (:mod:`teamrl.algorithms`).

Sampling tokens is not done here: the tree only calls a :data:`SampleFn`, a backend's
(:meth:`~teamrl.algorithms.base.AgentBackend.sample`) or a team's (:func:`~teamrl.rollout.generate.sample_team`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from teamrl.config import AlgorithmConfig
from teamrl.envs.base import Environment, Item, Step
from teamrl.envs.checks import checked_individual_rewards, checked_observations, checked_rewards
from teamrl.rewards.base import RewardResult
from teamrl.rollout.generate import Generation, derive_seed


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
class RolloutTree:
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
tokens. :func:`~teamrl.rollout.generate.sample_team` samples a :class:`~teamrl.team.Team` in this process; a
:class:`~teamrl.backends.ray.RayTeam` samples in its agent actors."""


def sample_tree(sample: SampleFn, env: Environment, items: Sequence[Item], config: AlgorithmConfig, *,
                seed: int = 0) -> RolloutTree:
    """Sample the MAGRPO tree for ``items``: per turn, every agent's G completions of each of its
    observations at once (``sample``, seeded from ``seed`` and the turn)."""
    num_samples, individual = config.num_generations, config.learners == "individual"
    frontier = [(item, ()) for item in items]
    parents = torch.arange(len(items))
    tree = RolloutTree(turn_reward=env.turn_reward, num_turns=config.num_turns)
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
