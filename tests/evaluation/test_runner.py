"""``teamrl eval``'s runner: method specs, settings, and every method scored by the environment's own reward."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from teamrl.envs import make_env
from teamrl.evaluation.baselines import Episode, MethodOutput
from teamrl.evaluation.metrics import accuracy_at_k, pass_at_k
from teamrl.evaluation.runner import EvalSettings, Method, method_metrics, parse_ks, parse_methods
from teamrl.evaluation.schemes import SCHEMES
from teamrl.rewards.base import RewardResult

AUX = "def aux(numbers, threshold):\n    return sorted(numbers)\n"
MAIN = "def has_close_elements(numbers, threshold):\n    xs = aux(numbers, threshold)\n    return len(xs) > 1\n"


def test_method_specs_parse_into_baselines_models_and_saved_teams(tiny_eval):
    untrained = tiny_eval.untrained_dir
    methods = parse_methods(f"single, single:bundled:smollm2,concat,sequential,discussion,team:{untrained}")
    assert [m.baseline for m in methods] == ["single", "single", "concat", "sequential", "discussion", "concat"]
    assert methods[1].model == "bundled:smollm2" and methods[0].model is None
    assert methods[-1].team_dir == Path(untrained) and methods[-1].spec == f"team:{untrained}"
    assert methods[2].title == "naive concatenation (untrained team)"
    assert all(m.description for m in methods)


@pytest.mark.parametrize("text, message", [
    ("concat,magic", "unknown method 'magic'; use a comma-separated list of single, single:MODEL"),
    ("concat:x", "unknown method 'concat:x'"),
    ("single:", "unknown method 'single:'"),
    ("team:/no/such/dir", "team:/no/such/dir: no saved team in '/no/such/dir' (no team.json)"),
    ("concat,concat", "concat given twice"),
])
def test_bad_method_specs_name_the_value_and_the_fix(text, message):
    with pytest.raises(ValueError, match="^--methods: ") as error:
        parse_methods(text)
    assert message in str(error.value)


def test_k_values_and_sample_counts_are_checked_up_front():
    assert parse_ks("3,1,3") == (1, 3)
    for bad in ("1,x", "0,1"):
        with pytest.raises(ValueError, match="^--k: "):
            parse_ks(bad)
    methods = (Method("concat", "concat"),)
    with pytest.raises(ValueError, match="--k: k=3 exceeds --num-samples 2.*raise --num-samples to 3"):
        EvalSettings(methods, num_samples=2, ks=(1, 3))
    with pytest.raises(ValueError, match="--num-samples: must be >= 1"):
        EvalSettings(methods, num_samples=0)
    with pytest.raises(ValueError, match="--max-items: must be >= 1"):
        EvalSettings(methods, max_items=0)
    with pytest.raises(ValueError, match="--methods: no method given"):
        EvalSettings(())


def test_every_method_is_scored_by_the_environments_joint_reward(tiny_eval):
    results, env = tiny_eval.results, make_env("digit_sum", targets=[9], length=4, num_eval=3)
    items = {item["id"]: item for item in env.items("eval")}
    assert results.num_items == 3 and results.num_samples == 2 and results.max_reward == env.max_reward
    assert len(results.methods) == 7
    for result in results.methods:
        assert len(result.samples) == 6 and [s["sample"] for s in result.samples] == [0, 1] * 3
        for sample in result.samples:
            expected = env.joint_reward(items[sample["item"]], sample["actions"])
            assert sample["reward"] == expected.total and sample["parts"] == expected.parts
        rewards = [sample["reward"] for sample in result.samples]
        metrics = result.metrics
        assert metrics["normalised_return"] == pytest.approx(statistics.fmean(rewards) / env.max_reward)
        assert metrics["count/hits"] == pytest.approx(statistics.fmean(s["counts"]["hits"] for s in result.samples))
        assert "level/hits" not in metrics  # a count, not a share of the reward
        assert metrics["tokens"] > 0
        assert metrics["tokens_per_s"] == pytest.approx(metrics["tokens"] / metrics["seconds"])
        assert metrics["tokens_per_answer"] == pytest.approx(metrics["tokens"] / 6)
        assert not any(key.startswith(("pass@", "scheme/")) for key in metrics)  # not a coding task


def test_methods_share_one_seed_and_a_saved_team_samples_with_the_configs_settings(tiny_eval):
    by_spec = {result.method.spec: result for result in tiny_eval.results.methods}
    concat, untrained = by_spec["concat"], by_spec[f"team:{tiny_eval.untrained_dir}"]
    assert [s["actions"] for s in untrained.samples] == [s["actions"] for s in concat.samples]
    trained = by_spec[f"team:{tiny_eval.run_dir / 'team'}"]
    assert [s["actions"] for s in trained.samples] != [s["actions"] for s in concat.samples]
    # single and single:tiny run the same model with the same seed
    assert [s["actions"] for s in by_spec["single"].samples] == [s["actions"] for s in by_spec["single:tiny"].samples]


def test_coding_metrics_are_pass_at_k_accuracy_at_k_tests_and_schemes():
    env = make_env("humaneval", eval_size=2, limit=4)  # nothing is run: the rewards are given
    first, second = env.items("eval")
    total = [len(first["tests"]), len(second["tests"])]
    passed = [[total[0], 0, total[0]], [1, 0, 0]]  # 3 samples per item
    episodes = [Episode(item, ["", ""], [AUX, MAIN]) for item in (first, second) for _ in range(3)]
    rewards = [RewardResult(2.0, {"syntax": 0.5}, {"tests_passed": float(p), "tests_total": float(t)})
               for p_item, t in zip(passed, total) for p in p_item]
    metrics = method_metrics(env, MethodOutput(episodes, tokens=60, seconds=3.0), rewards, 3, (1, 2), True)
    rates = [[p / t for p in p_item] for p_item, t in zip(passed, total)]
    for k in (1, 2):
        assert metrics[f"pass@{k}"] == pytest.approx((pass_at_k(3, 2, k) + pass_at_k(3, 0, k)) / 2)
        assert metrics[f"accuracy@{k}"] == pytest.approx((accuracy_at_k(rates[0], k) + accuracy_at_k(rates[1], k)) / 2)
    assert metrics["tests_passed"] == pytest.approx(statistics.fmean(rates[0] + rates[1]))
    assert metrics["normalised_return"] == pytest.approx(2.0 / env.max_reward)
    assert metrics["level/syntax"] == 0.5 and "level/tests_passed" not in metrics and "level/tests_total" not in metrics
    assert metrics["count/tests_total"] == pytest.approx(statistics.fmean([total[0]] * 3 + [total[1]] * 3))
    assert [key.removeprefix("scheme/") for key in metrics if key.startswith("scheme/")] == list(SCHEMES)
    assert sum(metrics[f"scheme/{s}"] for s in SCHEMES) == pytest.approx(1.0)
    assert metrics["tokens_per_answer"] == 10 and metrics["seconds_per_answer"] == 0.5 and metrics["tokens_per_s"] == 20
