"""``teamrl eval``'s runner: method specs, settings, and every method scored by the environment's own reward."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from teamrl.envs import make_env
from teamrl.evaluation.methods import EvalSettings, Method, parse_ks, parse_methods


def test_method_specs_parse_into_baselines_models_and_saved_teams(tiny_eval):
    untrained = tiny_eval.untrained_dir
    methods = parse_methods(f"single, single:bundled:smollm2,concat,sequential,discussion,team:{untrained}")
    assert [m.baseline for m in methods] == ["single", "single", "concat", "sequential", "discussion", None]
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


def test_baselines_share_one_seed_and_training_changes_a_saved_teams_answers(tiny_eval):
    by_spec = {result.method.spec: result for result in tiny_eval.results.methods}
    untrained, trained = by_spec[f"team:{tiny_eval.untrained_dir}"], by_spec[f"team:{tiny_eval.run_dir / 'team'}"]
    assert [s["actions"] for s in trained.samples] != [s["actions"] for s in untrained.samples]
    # single and single:tiny run the same model with the same seed
    assert [s["actions"] for s in by_spec["single"].samples] == [s["actions"] for s in by_spec["single:tiny"].samples]
