"""Evaluation metrics of a team: pass@k, accuracy@k, normalised return, throughput, reward levels, and the
paired difference of two methods' rewards.

All functions are pure and take plain Python numbers (NumPy scalars work too); each raises
``TypeError``/``ValueError`` naming the offending argument instead of returning a meaningless value.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any


def _count(name: str, value: object) -> int:
    """``value`` as a non-negative integer, or an error naming ``name``."""
    try:
        count = operator.index(value)  # ints and NumPy integers; floats are rejected, not truncated
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if count < 0:
        raise ValueError(f"{name} must be non-negative, got {count}")
    return count


def _finite(name: str, value: object) -> float:
    """``value`` as a finite float, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return number


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021).

    pass@k = 1 - C(n - c, k) / C(n, k): the probability that at least one of ``k`` samples drawn
    without replacement from the ``n`` is correct. Computed as the product
    1 - prod_{i = n-c+1}^{n} (1 - k / i), which never forms the (huge) binomial coefficients;
    it is 1.0 exactly when n - c < k (every k-subset holds a correct sample).

    Raises:
        TypeError: an argument is not an integer.
        ValueError: a negative argument, ``k`` < 1, ``k`` > ``n`` or ``c`` > ``n``.
    """
    n, c, k = _count("n", n), _count("c", c), _count("k", k)
    if k < 1:
        raise ValueError(f"k must be at least 1, got k={k}")
    if k > n:
        raise ValueError(f"k must not exceed n (the number of samples), got k={k}, n={n}")
    if c > n:
        raise ValueError(f"c (correct samples) must not exceed n (the number of samples), got c={c}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_at_k_many(num_samples: int | Sequence[int], num_correct: Sequence[int], k: int) -> list[float]:
    """``pass_at_k`` of each problem: ``num_correct[i]`` correct out of ``num_samples[i]`` samples.

    ``num_samples`` is one count for every problem or a sequence as long as ``num_correct``.
    Average the result for a benchmark's pass@k.
    """
    try:
        counts = [operator.index(num_samples)] * len(num_correct)  # one count (int or NumPy integer)
    except TypeError:
        counts = list(num_samples)  # type: ignore[arg-type]
        if len(counts) != len(num_correct):
            raise ValueError(f"num_samples and num_correct must have the same length, "
                             f"got {len(counts)} and {len(num_correct)}") from None
    return [pass_at_k(n, c, k) for n, c in zip(counts, num_correct)]


def accuracy_at_k(pass_rates: Sequence[float], k: int) -> float:
    """Expected best test pass-rate among ``k`` of the ``n = len(pass_rates)`` samples of a problem.

    The ``k`` samples are a uniformly random subset drawn without replacement, as for pass@k (with
    pass rates of 0 and 1 only, accuracy@k equals pass@k). Exact, by order statistics: with the
    rates sorted ascending r_(1) <= ... <= r_(n), the i-th smallest is the maximum of a k-subset
    when the subset holds it and k - 1 of the i - 1 below it, so

        accuracy@k = sum_i r_(i) * C(i - 1, k - 1) / C(n, k).

    Ties need no care: whichever tied sample is "the" maximum, its value is the same. Each weight
    is a ratio of exact integers, rounded once.

    Raises:
        ValueError: ``pass_rates`` is empty or holds a value outside [0, 1]; ``k`` is not in 1..n.
    """
    rates = sorted(_finite(f"pass_rates[{i}]", rate) for i, rate in enumerate(pass_rates))
    if not rates:
        raise ValueError("pass_rates must hold at least one sample's pass rate, got none")
    if not (rates[0] >= 0.0 and rates[-1] <= 1.0):
        raise ValueError(f"pass_rates must lie in [0, 1], got values from {rates[0]} to {rates[-1]}")
    n, k = len(rates), _count("k", k)
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..n (n = len(pass_rates) = {n}), got k={k}")
    subsets = math.comb(n, k)
    # Rates below index k - 1 are never a k-subset's maximum (their weight C(i - 1, k - 1) is 0).
    return sum(rates[i] * (math.comb(i, k - 1) / subsets) for i in range(k - 1, n))


def normalised_return(returns: float | Sequence[float], max_return: float) -> float:
    """Mean return divided by the highest return the reward can give (1.0 = every episode perfect).

    ``returns`` is one return or a sequence of them (their mean is normalised).

    Raises:
        ValueError: ``returns`` is empty or not finite; ``max_return`` is not a positive finite number.
    """
    values = [returns] if isinstance(returns, Real) else list(returns)
    if not values:
        raise ValueError("returns must hold at least one return, got none")
    total = sum(_finite(f"returns[{i}]", value) for i, value in enumerate(values))
    maximum = _finite("max_return", max_return)
    if maximum <= 0:
        raise ValueError(f"max_return must be positive, got {maximum}")
    return total / len(values) / maximum


def tokens_per_second(tokens: int, seconds: float) -> float:
    """Throughput: ``tokens`` generated (by the whole team) over ``seconds`` of wall-clock time.

    Raises:
        ValueError: ``tokens`` is negative, or ``seconds`` is not a positive finite number.
    """
    count = _count("tokens", tokens)
    duration = _finite("seconds", seconds)
    if duration <= 0:
        raise ValueError(f"seconds must be positive, got {duration}")
    return count / duration


def summarise_levels(reward_parts_list: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Mean of each reward part over joint actions, a part absent from an action counting as 0.

    Gated rewards leave the parts they never reached out of ``RewardResult.parts``; counting those
    as 0 makes each mean the average contribution of that level, so the means add up to the mean
    total reward. Parts appear in the order they are first seen.

    Raises:
        ValueError: ``reward_parts_list`` is empty.
        TypeError: an item is not a mapping (pass ``result.parts``, not the ``RewardResult``).
    """
    if not reward_parts_list:
        raise ValueError("reward_parts_list must hold at least one action's reward parts, got none")
    sums: dict[str, float] = {}
    for index, parts in enumerate(reward_parts_list):
        if not isinstance(parts, Mapping):
            raise TypeError(f"reward_parts_list[{index}] must map part names to values, "
                            f"got {type(parts).__name__}")
        for name, value in parts.items():
            sums[name] = sums.get(name, 0.0) + _finite(f"reward_parts_list[{index}][{name!r}]", value)
    return {name: total / len(reward_parts_list) for name, total in sums.items()}


def paired_difference(rewards_a: Mapping[Any, Sequence[float]], rewards_b: Mapping[Any, Sequence[float]],
                      ) -> tuple[float, float, int]:
    """How much method A's reward exceeds method B's on the same items: ``(difference, standard error, items)``.

    ``rewards_x`` maps each item to the rewards of x's joint actions on it. Each item counts once, by its
    mean reward under A minus its mean under B (the joint actions of one item are not independent of each
    other, and pairing by item takes out how hard each item is); the standard error is the sample standard
    deviation of those differences over the square root of the number of items (0.0 with one item).

    Raises:
        ValueError: the two methods did not answer the same items, or an item has no reward.
    """
    if set(rewards_a) != set(rewards_b):
        raise ValueError(f"the methods answered different items ({len(rewards_a)} and {len(rewards_b)}); "
                         f"compare methods evaluated on the same items")
    if not rewards_a:
        raise ValueError("no items to compare")
    differences = []
    for item, rewards in rewards_a.items():
        if not rewards or not rewards_b[item]:
            raise ValueError(f"item {item!r} has no reward for one of the methods")
        differences.append(sum(rewards) / len(rewards) - sum(rewards_b[item]) / len(rewards_b[item]))
    count = len(differences)
    mean = sum(differences) / count
    if count < 2:
        return mean, 0.0, count
    variance = sum((d - mean) ** 2 for d in differences) / (count - 1)
    return mean, math.sqrt(variance / count), count
