"""benchmarks/comlrl_learning_curve.py and the worker's learning-curve mode: each library's own settings, the
training clock that leaves evaluations out, and the runs in teamrl compare's format. No CoMLRL or models."""

from __future__ import annotations

import argparse

import pytest

from teamrl.config import load_config
from teamrl.evaluation import compare

BENCHMARK = "comlrl_learning_curve"


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script


@pytest.fixture
def worker(bench):
    import side_by_side_worker  # a sibling of the benchmark, on sys.path while it is loaded

    return side_by_side_worker


def _args(**overrides):
    return argparse.Namespace(**{"minutes": 15.0, "eval_every_minutes": 3.0, "eval_items": 32, "eval_samples": 2,
                                 "eval_seed": 1234, "threads": None, **overrides})


def test_each_library_trains_at_its_own_settings_and_both_are_scored_alike(bench):
    specs = bench.specs(_args(), seed=2)
    preset = load_config("demo_tldr_cpu")
    ours, theirs = specs["teamrl"], specs["comlrl"]
    assert ours.teamrl_preset == "demo_tldr_cpu" and ours.teamrl_training == preset.team.training == "lora"
    assert ours.teamrl_lr == preset.optim.lr and ours.items == preset.items_per_step
    assert ours.num_generations == preset.algorithm.num_generations
    assert ours.temperature == preset.team.sampling.temperature  # the evaluation samples as each library does
    assert (theirs.lr, theirs.num_generations, theirs.items, theirs.temperature, theirs.max_new_tokens) == (
        5e-6, 4, 1, 0.7, 64)
    assert theirs.teamrl_preset is None
    for field in ("seed", "minutes", "eval_every_minutes", "eval_items", "eval_samples", "eval_seed",
                  "max_text_chars", "turns"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_the_teamrl_worker_trains_the_preset_as_it_ships(bench, worker, tmp_path):
    spec = bench.specs(_args(), seed=1)["teamrl"]
    (tmp_path / "model").mkdir()
    config = worker.teamrl_trainer_config(spec, tmp_path / "model", tmp_path / "run")
    preset = load_config("demo_tldr_cpu")
    # 15 minutes: three times the preset's 5 minutes of steps, so that its learning-rate schedule spans them
    assert config.team.model == str(tmp_path / "model") and config.seed == 1 and config.steps == 3 * preset.steps
    assert config.optim == preset.optim and config.algorithm == preset.algorithm
    assert config.team.lora == preset.team.lora and config.team.sampling == preset.team.sampling


def test_the_clock_counts_training_only_and_evaluates_on_its_schedule(worker, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(worker.time, "perf_counter", lambda: now[0])
    rewards = iter([1.0, 1.5, 2.0, 2.5])

    def evaluate():
        now[0] += 100.0  # an evaluation takes 100 s, which must not count as training
        return {"reward/mean": next(rewards), "reward/se": 0.1}

    clock = worker.TrainingClock(budget_seconds=250.0, every_seconds=120.0, evaluate=evaluate)
    spent = []
    for _ in range(5):
        now[0] += 50.0  # a 50 s update
        spent.append(clock.step_done())
        if spent[-1]:
            break
    assert spent == [False, False, False, False, True]
    assert [(p["step"], p["train_seconds"], p["reward/mean"]) for p in clock.curve] == [
        (0, 0.0, 1.0), (3, 150.0, 1.5), (5, 250.0, 2.0)]
    assert clock.result()["step_times"] == [50.0] * 5 and clock.result()["train_seconds"] == 250.0


def test_the_teamrl_steps_scale_with_the_budget(bench):
    assert bench.teamrl_steps(24, 15.0) == 72 and bench.teamrl_steps(24, 5.0) == 24
    assert bench.teamrl_steps(24, 0.2) == 1 and bench.teamrl_steps(24, 1.0) == 5  # rounded up, at least one
    assert bench.specs(_args(), seed=0)["comlrl"].steps == bench.MAX_STEPS


def test_a_clock_whose_training_ends_early_evaluates_the_last_step_once(worker, monkeypatch):
    monkeypatch.setattr(worker.time, "perf_counter", lambda: 0.0)
    clock = worker.TrainingClock(budget_seconds=1e9, every_seconds=0.0, evaluate=lambda: {"reward/mean": 1.0})
    clock.step_done()
    clock.finish()
    clock.finish()
    assert [point["step"] for point in clock.curve] == [0, 1]


def test_a_worker_curve_reads_as_a_compare_run(bench):
    spec = bench.specs(_args(), seed=0)["comlrl"]
    result = {"curve": [{"step": 0, "train_seconds": 0.0, "reward/mean": 1.0},
                        {"step": 4, "train_seconds": 400.0, "reward/mean": 1.7}],
              "step_times": [100.0] * 4, "peak_rss_gb": 3.2}
    run = bench.as_compare_run("comlrl", spec, result)
    summary = compare.summarise("comlrl", [run])
    assert summary.gain == pytest.approx(0.7) and summary.seconds_per_step == 100.0
    assert summary.minutes_to[0.5] == [400.0 / 60] and summary.peak_memory_gib == pytest.approx(3.2e9 / 2**30)
    report = compare.render_markdown({"comlrl": [run]})
    assert "lr=5e-06" in report and f"Machine: {compare.machine()}." in report


def test_a_held_out_evaluation_reports_its_standard_error_over_items(worker):
    # two items, two episodes each: item means 1.0 and 2.0, so the SE over items is stdev / sqrt(2) = 0.5
    held_out = worker.HeldOut(per_turn=[1.5], first_turn_by_item=[[0.5, 1.5], [2.0, 2.0]])
    assert held_out.curve_point() == {"reward/mean": 1.5, "reward/se": pytest.approx(0.5)}
