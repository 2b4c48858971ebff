"""The value every reward function returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RewardResult:
    """A joint reward and the parts it is made of.

    ``total`` is what the learner optimises. ``parts`` maps a part's name (a reward level, a bonus)
    to its contribution, so runs can log why a joint action scored what it did; the parts of a gated
    reward that were never reached are absent rather than zero. ``counts`` holds what the environment
    counted on the way that is not a share of the reward (tests passed and run, digit pairs that hit
    the target): logged and reported beside the parts, never summed into a total or a per-level table.
    """

    total: float
    parts: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
