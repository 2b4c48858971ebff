"""Preference pairs of joint actions and the Bradley-Terry loss, against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from teamrl.algorithms.madpo import pair_rows
from teamrl.algorithms.preferences import bradley_terry_loss, pairwise_accuracy, preference_pairs


def _pairs(values, rule, min_gap=0.0) -> list[tuple[int, int, int]]:
    return [tuple(row) for row in preference_pairs(torch.tensor(values), rule, min_gap).tolist()]


def test_best_worst_pairs_each_groups_best_with_its_worst_and_skips_ties():
    values = [[0.2, 0.9, 0.9, 0.1],  # best: the first of the two 0.9s (index 1); worst: index 3
              [0.5, 0.5, 0.5, 0.5],  # all tied: no preference, no pair
              [0.3, 0.0, 0.35, 0.3]]  # best 2, worst 1, gap 0.35
    assert _pairs(values, "best_worst") == [(0, 1, 3), (2, 2, 1)]
    assert _pairs(values, "best_worst", min_gap=0.34) == [(0, 1, 3), (2, 2, 1)]
    assert _pairs(values, "best_worst", min_gap=0.35) == [(0, 1, 3)]  # the gap must exceed min_gap
    assert _pairs(values, "best_worst", min_gap=0.8) == []


def test_all_pairs_are_every_ordered_pair_with_a_gap_above_the_margin():
    assert _pairs([[1.0, 0.0, 1.0]], "all") == [(0, 0, 1), (0, 2, 1)]  # 0 and 2 tie: neither is preferred
    assert _pairs([[0.0, 0.25, 1.0], [2.0, 2.0, 2.0]], "all") == [(0, 1, 0), (0, 2, 0), (0, 2, 1)]
    assert _pairs([[0.0, 0.25, 1.0]], "all", min_gap=0.5) == [(0, 2, 0), (0, 2, 1)]


def test_an_unknown_rule_names_the_config_field():
    with pytest.raises(ValueError, match="algorithm.preference.pairs"):
        preference_pairs(torch.zeros(1, 2), "random")


def test_pairs_map_to_each_agents_rows_in_cross_mode():
    # Two agents, G=2, 'cross': joint action m takes sample combos[m, i] of agent i; group e's rows start at e*G.
    combos = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1]])
    pairs = torch.tensor([[1, 3, 0], [0, 1, 0]])
    preferred, rejected = pair_rows(pairs, combos, 0, 2)
    assert preferred.tolist() == [3, 0] and rejected.tolist() == [2, 0]  # pair 2: agent 0 played the same sample
    preferred, rejected = pair_rows(pairs, combos, 1, 2)
    assert preferred.tolist() == [3, 1] and rejected.tolist() == [2, 0]


def test_bradley_terry_loss_accuracy_and_gradient_by_hand():
    chosen = torch.tensor([2.0, 0.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, rejected)
    # mean(-log sigma(1), -log sigma(0)) = mean(log(1 + e^-1), log 2) = mean(0.313262, 0.693147)
    assert float(loss) == pytest.approx((math.log(1 + math.exp(-1)) + math.log(2)) / 2, rel=1e-6)
    assert float(loss) == pytest.approx(0.503204, abs=1e-6)
    loss.backward()
    # d/ds_w of -log sigma(s_w - s_l) is -(1 - sigma(s_w - s_l)), halved by the mean: the preferred score goes up.
    assert chosen.grad.tolist() == pytest.approx([-(1 - 1 / (1 + math.exp(-1))) / 2, -0.25], rel=1e-6)
    assert rejected.grad.tolist() == pytest.approx([(1 - 1 / (1 + math.exp(-1))) / 2, 0.25], rel=1e-6)
    assert pairwise_accuracy(chosen, rejected) == 0.5  # the tie counts as wrong
    assert float(bradley_terry_loss(torch.zeros(0), torch.zeros(0))) == 0.0
