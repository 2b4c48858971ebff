"""benchmarks/learning_curve.py: variants, the evaluation schedule of a run, minutes to a gain and the tables.

One run of the worker trains the tests' tiny digit_sum team (seconds); the bundled model is not used.
"""

from __future__ import annotations

import pytest
import yaml

BENCHMARK = "learning_curve"


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script


def test_a_variant_is_a_name_and_its_overrides(bench):
    assert bench.parse_variant("lr5e-4: optim.lr=5e-4 'team.agents=[{name: a}]'") == (
        "lr5e-4", ["optim.lr=5e-4", "team.agents=[{name: a}]"])
    assert bench.parse_variant("default:") == ("default", [])
    for bad in ("no colon", ": optim.lr=1", "a/b: steps=1"):
        with pytest.raises(ValueError, match="NAME: field=value"):
            bench.parse_variant(bad)


def _run(seed, points):
    return {"spec": {"seed": seed}, "max_reward": 3.0,
            "curve": [{"step": step, "train_seconds": seconds, "reward/mean": reward}
                      for step, seconds, reward in points],
            "steps": [{"time/step": 30.0}] * points[-1][0]}


def test_minutes_to_a_gain_and_the_reward_at_a_time(bench):
    run = _run(0, [(0, 0.0, 1.0), (5, 150.0, 1.4), (10, 300.0, 2.1), (15, 450.0, 1.9)])
    assert bench.minutes_to_gain(run, 0.3) == 2.5
    assert bench.minutes_to_gain(run, 1.0) == 5.0   # first reached at 300 s, even though it drops later
    assert bench.minutes_to_gain(run, 1.5) is None
    assert bench.reward_at(run, 299.0) == 1.4 and bench.reward_at(run, 300.0) == 2.1
    assert bench.reward_at(run, 1e6) == 1.9


def test_the_tables_summarise_over_seeds(bench):
    runs = {"fast": [_run(0, [(0, 0.0, 1.0), (10, 300.0, 2.0)]), _run(1, [(0, 0.0, 1.0), (10, 300.0, 1.6)])]}
    table = bench.markdown(runs)
    assert "| fast | 2 | 1.000 ± 0.000 | 1.800 ± 0.283 | 0.800 ± 0.283 | +0.600 | 10.0 | 30.0 |" in table
    assert "| fast-seed0 | 0: 1.00, 10: 2.00 | 5.0 | 5.0 |" in table
    assert "| fast-seed1 | 0: 1.00, 10: 1.60 | 5.0 | - |" in table


def test_a_run_evaluates_at_step_zero_on_its_schedule_and_at_its_end(bench, tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=3)))
    spec = {"config": str(config), "overrides": ["items_per_step=2"], "seed": 0, "run_dir": str(tmp_path / "run"),
            "minutes": 0.0, "steps": 0, "eval_every_steps": 2, "eval_every_minutes": 0.0, "eval_items": 4,
            "eval_samples": 1, "eval_seed": 0, "threads": 0}
    result = bench.train_with_evaluations(spec)
    assert [point["step"] for point in result["curve"]] == [0, 2, 3]
    assert len(result["steps"]) == 3 and result["max_reward"] == 1.0
    seconds = [point["train_seconds"] for point in result["curve"]]
    assert seconds[0] == 0.0 and seconds == sorted(seconds)
    assert seconds[-1] == pytest.approx(sum(step["time/step"] for step in result["steps"]))
