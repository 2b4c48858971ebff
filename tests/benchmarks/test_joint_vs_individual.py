"""The pure parts of benchmarks/joint_vs_individual.py: the summary over seeds and the markdown tables.

The training runs themselves (the bundled model, minutes each) are not run here.
"""

from __future__ import annotations

import pytest

BENCHMARK = "joint_vs_individual"


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script


def _run(learners, seed, before, after, **after_parts):
    return {"learners": learners, "seed": seed, "steps": 20, "max_reward": 3.0, "seconds": 360.0,
            "before": {"reward/mean": before, "reward/std": 0.1, "reward/length": 0.5},
            "after": {"reward/mean": after, "reward/std": 0.1, **after_parts}}


RUNS = [
    _run("joint", 0, 1.5, 2.0, **{"reward/length": 0.5, "reward/ratio": 0.9}),
    _run("joint", 1, 1.0, 2.5, **{"reward/length": 0.5, "reward/ratio": 0.7}),
    _run("individual", 0, 1.5, 1.0, **{"reward/length": 0.5}),  # stopped at level 1: no ratio part
    _run("individual", 1, 1.0, 1.5, **{"reward/length": 0.5, "reward/ratio": 0.4}),
]


def test_summary_is_mean_and_sample_spread_over_seeds_per_kind_of_learner(bench):
    summary = bench.summarise(RUNS)
    assert list(summary) == ["joint", "individual"]
    joint, individual = summary["joint"], summary["individual"]
    # joint: before [1.5, 1.0], after [2.0, 2.5], gain [0.5, 1.5]; the sample std of two values is |a - b| / sqrt 2
    assert joint["before_mean"] == pytest.approx(1.25) and joint["before_std"] == pytest.approx(0.5 / 2 ** 0.5)
    assert joint["after_mean"] == pytest.approx(2.25) and joint["gain_mean"] == pytest.approx(1.0)
    assert joint["gain_std"] == pytest.approx(1.0 / 2 ** 0.5) and joint["seeds"] == 2
    # individual: gain [-0.5, 0.5]; the ratio part missing from seed 0 counts as 0
    assert individual["gain_mean"] == pytest.approx(0.0)
    assert individual["after_reward/ratio"] == pytest.approx(0.2) and joint["after_reward/ratio"] == pytest.approx(0.8)


def test_one_seed_has_no_spread(bench):
    assert bench.summarise(RUNS[:1])["joint"]["gain_std"] == 0.0


def test_markdown_tables(bench):
    table = bench.markdown(RUNS, bench.summarise(RUNS))
    assert "Held-out joint reward (max 3)" in table
    assert "| joint | 2 | 1.250 ± 0.354 | 2.250 ± 0.354 | 1.000 ± 0.707 |" in table
    assert "| individual | 0 | 20 | 1.500 | 1.000 | -0.500 | 6.0 |" in table
    assert "| learners | length | ratio |" in table and "| individual | 0.500 | 0.200 |" in table
