"""A tiny cooperative game that needs no network and no big model: two agents write digits that must sum up.

Each item has a target t. Agent 0 writes a row of ``length`` digits, agent 1 writes another; position j
scores 1 - |digit_0[j] + digit_1[j] - t| / 10 (at least 0, and 0 unless both wrote a digit there), so
only an exact pair earns the full point. The joint reward is the mean over positions: it depends on both
agents' outputs and neither can earn any of it alone — whatever one agent writes, the reward is set by
whether the other complements it. The team must agree on a convention (who writes which digit), which
is exactly what joint training has to discover. The closeness credit keeps the reward dense enough for
a tiny random model to find the convention in seconds.

In multi-turn episodes each agent then sees its partner's row and the number of hits, and tries again.

The prompt-only baselines' prompts use the game's own words (the 'tiny' model's vocabulary): a single
agent reads ``target T first second`` and writes both rows (its first ``length`` digits are row 0,
the next ``length`` row 1); an agent shown its partner's row reads ``target T partner ROW [you ROW] SEAT``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from teamrl.envs.base import Environment, Item, Step, register_env
from teamrl.rewards.base import RewardResult

DIGITS = [str(d) for d in range(10)]
_SEATS = ("first", "second")


@register_env("digit_sum")
class DigitSumGame(Environment):
    """Two agents write ``length`` digits each; a position scores when the pair sums to the item's target.

    Args:
        targets: the target sums items are drawn from (each in 0..18).
        length: digits per agent; only the first ``length`` whitespace tokens of a completion count.
        num_train: number of training items; ``num_eval`` of held-out items.
        max_turns: longest episode the game supports.
        seed: seed for drawing the items' targets.
    """

    num_agents = 2
    roles = ("You write the first row of digits.", "You write the second row of digits.")
    single_agent_role = "You write both rows of digits: the first row, then the second."

    def __init__(self, targets: Sequence[int] = (9,), length: int = 4, num_train: int = 64,
                 num_eval: int = 16, max_turns: int = 4, seed: int = 0):
        bad = [t for t in targets if not 0 <= int(t) <= 18]
        if not targets or bad:
            raise ValueError(f"env.kwargs.targets: every target must be in 0..18 (got {list(targets)})")
        if length < 1:
            raise ValueError(f"env.kwargs.length: must be >= 1 (got {length})")
        self.targets = [int(t) for t in targets]
        self.length = length
        self.max_turns = max_turns
        rng = random.Random(seed)
        self.splits = {
            split: [{"id": f"{split}-{i}", "target": rng.choice(self.targets)} for i in range(n)]
            for split, n in (("train", num_train), ("eval", num_eval))
        }


    def observe(self, item: Item) -> list[str]:
        return [f"target {item['target']} {seat}" for seat in _SEATS]

    def digits(self, completion: str) -> list[int | None]:
        """The first ``length`` whitespace tokens of a completion as digits (None where not a digit)."""
        tokens = completion.split()[: self.length]
        return [int(tok) if tok in DIGITS else None for tok in tokens]

    def joint_reward(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> RewardResult:
        first, second = (self.digits(a) for a in actions)
        pairs = [(a, b) for a, b in zip(first, second) if a is not None and b is not None]
        credit = sum(max(0.0, 1 - abs(a + b - item["target"]) / 10) for a, b in pairs)
        hits = sum(1 for a, b in pairs if a + b == item["target"])
        return RewardResult(credit / self.length, counts={"hits": float(hits), "digit_pairs": float(len(pairs))})

    def individual_rewards(self, item: Item, actions: Sequence[str], history: Sequence[Step] = ()) -> list[float]:
        """Each agent alone: the fraction of its positions holding a digit that could reach the target.

        This is the kind of hand-made per-role reward joint training avoids: each agent can max it out
        without ever complementing its partner.
        """
        rewards = []
        for action in actions:
            row = self.digits(action)
            rewards.append(sum(1 for d in row if d is not None and d <= item["target"]) / self.length)
        return rewards

    def next_observations(self, item: Item, history: Sequence[Step]) -> list[str]:
        last = history[-1]
        hits = int(last.reward.counts["hits"])
        observations = []
        for seat, (own, partner) in enumerate(zip(last.actions, reversed(last.actions))):
            observations.append(
                f"target {item['target']} partner {_clean(self.digits(partner))} "
                f"you {_clean(self.digits(own))} hits {hits} {_SEATS[seat]}"
            )
        return observations

    def single_agent_observation(self, item: Item) -> str:
        return f"target {item['target']} {' '.join(_SEATS)}"

    def split_single_agent_output(self, item: Item, completion: str) -> list[str]:
        """The first ``length`` whitespace tokens are row 0, the next ``length`` row 1."""
        tokens = completion.split()
        return [" ".join(tokens[seat * self.length:(seat + 1) * self.length]) for seat in range(self.num_agents)]

    def teammates_observation(self, item: Item, seat: int, observation: str,
                              teammates: Sequence[tuple[int, str]], own: str | None = None) -> str:
        """``target T partner ROW [you ROW] SEAT``, as in :meth:`next_observations` (``observation`` is
        rebuilt from ``item``, in the game's words)."""
        partners = " ".join(f"partner {_clean(self.digits(text))}" for _, text in teammates)
        you = f" you {_clean(self.digits(own))}" if own is not None else ""
        return f"target {item['target']} {partners}{you} {_SEATS[seat]}"

    def vocabulary(self) -> list[str]:
        words = "target first second partner you hits nothing ?".split()
        return DIGITS + [str(t) for t in sorted(set(self.targets)) if t > 9] + words


def _clean(row: list[int | None]) -> str:
    return " ".join("?" if d is None else str(d) for d in row) or "nothing"
