"""Preferences between joint actions, as small pure functions: which joint actions of a group pair up into
(preferred, rejected), and the Bradley-Terry loss a reward model learns from such pairs.

A group is the M joint actions of one expansion point (an item at turn 1, a joint action's node at a later
turn), the same groups as Eq. 1's advantages; within a group, joint actions are compared by a value: their
return (:mod:`teamrl.algorithms.madpo`) or their joint reward (:mod:`teamrl.algorithms.marlhf`). Joint
actions of different groups are never compared: they answer different observations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAIR_RULES = ("best_worst", "all")


def preference_pairs(values: torch.Tensor, rule: str, min_gap: float = 0.0) -> torch.Tensor:
    """(P, 3) long rows (group, preferred, rejected) of the pairs of joint actions that ``rule`` makes from the
    (E, M) ``values`` of E groups of M joint actions.

    A pair needs ``values[e, w] - values[e, l] > min_gap``, so ties (and, with ``min_gap`` > 0, near ties)
    never pair: they carry no preference.

    * ``best_worst``: one pair per group, its best joint action against its worst (the first of equal ones).
    * ``all``: every ordered pair of the group, in order of (group, preferred, rejected).
    """
    if rule not in PAIR_RULES:
        raise ValueError(f"algorithm.preference.pairs: unknown rule {rule!r}; use {' or '.join(PAIR_RULES)}")
    groups = torch.arange(values.shape[0])
    if rule == "best_worst":
        best, worst = values.argmax(dim=1), values.argmin(dim=1)
        gap = values[groups, best] - values[groups, worst]
        return torch.stack([groups, best, worst], dim=1)[gap > min_gap]
    gaps = values.unsqueeze(2) - values.unsqueeze(1)  # gaps[e, w, l] = values[e, w] - values[e, l]
    return (gaps > min_gap).nonzero()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """mean over pairs of -log sigma(s_preferred - s_rejected): the negative log-likelihood of the pairs'
    preferences under the Bradley-Terry model P(w > l) = sigma(s_w - s_l) of the scores ``chosen`` and
    ``rejected`` (0 without pairs)."""
    if chosen.numel() == 0:
        return chosen.sum()
    return -F.logsigmoid(chosen - rejected).mean()


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """The fraction of pairs whose preferred joint action scores strictly higher (a tie counts as wrong)."""
    return float((chosen > rejected).float().mean()) if chosen.numel() else 0.0
