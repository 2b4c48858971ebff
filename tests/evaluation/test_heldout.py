"""Held-out evaluation, one path: training's ``Trainer.evaluate`` and ``teamrl eval``'s ``team:PATH`` sample a
team alike and score its joint actions with the same functions."""

from __future__ import annotations

import dataclasses
import shutil
import statistics
from types import SimpleNamespace

import pytest
import torch

from teamrl.envs import make_env
from teamrl.envs.code_schemes import SCHEMES
from teamrl.evaluation.baselines import Episode, MethodOutput
from teamrl.evaluation.heldout import method_metrics, sample_held_out, training_view
from teamrl.evaluation.metrics import accuracy_at_k, pass_at_k
from teamrl.rewards.base import RewardResult
from teamrl.rollout.generate import derive_seed
from teamrl.train import Trainer

AUX = "def aux(numbers, threshold):\n    return sorted(numbers)\n"
MAIN = "def has_close_elements(numbers, threshold):\n    xs = aux(numbers, threshold)\n    return len(xs) > 1\n"


@pytest.mark.parametrize("trained", [False, True])
def test_training_and_teamrl_eval_give_a_team_the_same_numbers(tiny_eval, tmp_path, trained):
    # The training run's team before training (a new run of its config) or after (its final checkpoint), and
    # the team it saved then, as teamrl eval's team:PATH ran it: --max-items 3 --num-samples 2 from the
    # config's seed, Trainer.evaluate's default seed.
    directory = tiny_eval.run_dir / "team" if trained else tiny_eval.untrained_dir
    result = next(r for r in tiny_eval.results.methods if r.method.team_dir == directory)
    if trained:
        shutil.copytree(tiny_eval.run_dir, tmp_path / "run")
    config = dataclasses.replace(tiny_eval.config, run_dir=str(tmp_path / "run"))
    with Trainer(config, resume=trained) as trainer:
        assert trainer.step == (config.steps if trained else 0)
        metrics, samples = trainer.evaluate_with_samples(max_items=3, num_samples=2)
    assert [s["actions"] for s in samples] == [s["actions"] for s in result.samples]
    assert (metrics, samples) == training_view(result.metrics, result.samples)
    assert metrics["reward/mean"] == pytest.approx(result.metrics["reward_mean"])
    assert metrics["count/hits"] == result.metrics["count/hits"]


def test_teamrl_eval_plays_a_saved_team_in_trainings_multi_turn_episodes(tiny_eval, tmp_path):
    # A two-turn config: Trainer.evaluate plays two-turn episodes, and teamrl eval's team:PATH plays the same ones
    # (the same numbers and joint actions); the prompt-only baseline answers once. Both normalised returns divide
    # by the largest return of their own episodes: digit_sum's reward scores a state, max 1 a turn, so 2 and 1.
    from teamrl.evaluation.runner import EvalSettings, parse_methods, run_evaluation

    config = dataclasses.replace(tiny_eval.config, run_dir=str(tmp_path / "run"),
                                 algorithm=dataclasses.replace(tiny_eval.config.algorithm, num_turns=2))
    with Trainer(config) as trainer:
        saved = trainer.save_team(tmp_path / "team")
        metrics, samples = trainer.evaluate_with_samples(max_items=2, num_samples=2)
    methods = parse_methods(f"concat,team:{saved}")
    results = run_evaluation(config, EvalSettings(tuple(methods), max_items=2, num_samples=2))
    concat, team = results.methods
    assert (team.num_turns, concat.num_turns, results.num_turns) == (2, 1, 2)
    assert all(len(sample["earlier_turns"]) == 1 for sample in team.samples)
    assert not any("earlier_turns" in sample for sample in concat.samples)
    assert (metrics, samples) == training_view(team.metrics, team.samples)
    assert team.metrics["normalised_return"] == pytest.approx(team.metrics["reward_mean"] / 2)
    assert concat.metrics["normalised_return"] == pytest.approx(concat.metrics["reward_mean"])
    assert "It plays episodes of 2 turns" in team.description and concat.description == concat.method.description


def test_teamrl_eval_refuses_baselines_on_a_world_that_pays_only_at_a_later_turn(tiny_config):
    from teamrl.evaluation.runner import EvalSettings, parse_methods, run_evaluation

    config = tiny_config(env={"name": "build", "kwargs": {"sparse": True, "max_turns": 2, "num_train": 2,
                                                           "num_eval": 1}}, algorithm={"num_turns": 2})
    with pytest.raises(ValueError, match=r"^--methods concat \(a prompt-only baseline answers once\): sparse: true "
                                         r"pays only at turn env.kwargs.max_turns = 2, so a 1-turn episode earns 0"):
        run_evaluation(config, EvalSettings(tuple(parse_methods("concat"))))


def test_held_out_items_are_sampled_in_batches_each_under_its_own_seed():
    env = make_env("digit_sum", targets=[9], length=4, num_eval=5)
    items = env.items("eval")
    calls = []

    def sample(observations, num_samples, seed):
        calls.append((observations, num_samples, seed))
        return [SimpleNamespace(texts=[f"agent {i} seed {seed} row {row}" for row in range(len(obs) * num_samples)],
                                num_tokens=len(obs)) for i, obs in enumerate(observations)]

    output = sample_held_out(sample, env, items, 2, seed=3, items_per_batch=2)
    assert [seed for *_, seed in calls] == [derive_seed(3, batch) for batch in range(3)]
    assert [obs for obs, *_ in calls][1] == [[env.observe(item)[i] for item in items[2:4]] for i in range(2)]
    assert [episode.item for episode in output.episodes] == [item for item in items for _ in range(2)]
    seed = derive_seed(3, 1)  # item 3, sample 1: batch 1, row 3
    assert output.episodes[7].actions == [f"agent 0 seed {seed} row 3", f"agent 1 seed {seed} row 3"]
    assert output.episodes[7].observations == env.observe(items[3])
    assert output.tokens == 2 * len(items)
    with pytest.raises(ValueError, match="items_per_batch: must be >= 1"):
        sample_held_out(sample, env, items, 2, seed=3, items_per_batch=0)


def test_training_view_names_the_numbers_as_training_logs_them():
    metrics = {"normalised_return": 0.7, "reward_mean": 0.7, "level/tests": 0.25, "level/syntax": 0.5,
               "count/tests_total": 2.0, "count/tests_passed": 1.0, "tokens": 3.0, "pass@1": 0.5}
    records = [{"item": "x", "sample": sample, "observations": ["o0", "o1"], "actions": ["a", "b"], "reward": reward,
                "parts": {"syntax": reward}, "counts": {"tests_passed": 1.0}, "scheme": "other"}
               for sample, reward in enumerate([0.1, 0.2, 0.4])]
    view, samples = training_view(metrics, records)
    assert list(view) == ["reward/mean", "reward/std", "reward/syntax", "reward/tests", "count/tests_passed",
                          "count/tests_total"]
    totals = torch.tensor([0.1, 0.2, 0.4])  # float32, as training's reward/mean (rollout_metrics)
    assert view["reward/mean"] == float(totals.mean()) == pytest.approx(statistics.fmean([0.1, 0.2, 0.4]))
    assert view["reward/std"] == float(totals.std()) == pytest.approx(statistics.stdev([0.1, 0.2, 0.4]))
    assert view["reward/syntax"] == 0.5 and view["count/tests_total"] == 2.0
    assert samples[2] == {"item": "x", "observations": ["o0", "o1"], "actions": ["a", "b"], "reward": 0.4,
                          "reward_parts": {"syntax": 0.4}, "reward_counts": {"tests_passed": 1.0}}
    assert training_view(metrics, records[:1])[0]["reward/std"] == 0.0
    two_turns = {**metrics, "turn1/reward_mean": 0.3, "turn2/reward_mean": 0.4}
    assert training_view(two_turns, records)[0]["reward/turn2/mean"] == 0.4  # as training logs a turn's reward


def test_coding_metrics_are_pass_at_k_accuracy_at_k_tests_and_schemes():
    env = make_env("humaneval", eval_size=2, limit=4)  # nothing is run: the rewards are given
    first, second = env.items("eval")
    total = [len(first["tests"]), len(second["tests"])]
    passed = [[total[0], 0, total[0]], [1, 0, 0]]  # 3 samples per item
    episodes = [Episode(item, ["", ""], [AUX, MAIN]) for item in (first, second) for _ in range(3)]
    rewards = [RewardResult(2.0, {"syntax": 0.5}, {"tests_passed": float(p), "tests_total": float(t)})
               for p_item, t in zip(passed, total) for p in p_item]
    metrics = method_metrics(env, MethodOutput(episodes, tokens=60, seconds=3.0), rewards, 3, (1, 2))
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


def test_a_multi_turn_episode_answers_the_feedback_and_scores_its_return():
    # Two builders on a 4 x 2 x 2 grid over three turns; each turn an agent writes the first line its
    # observation asks for (a perfect copier), except agent 1 in turn 1, which writes a wrong block.
    from teamrl.evaluation.heldout import score

    item = {"id": "hand", "target": [[0, 0, 0, "R"], [2, 0, 0, "R"], [0, 0, 1, "G"]]}
    calls = []

    def copier(observations, num_samples, seed):
        calls.append((num_samples, seed))
        texts = []
        for seat, seen in enumerate(observations):
            lines = [[line for line in obs.splitlines() if line.startswith(("place", "remove"))][:1] for obs in seen]
            first_turn = len(calls) == 1
            texts.append([("place 3 1 0 G" if seat == 1 and first_turn else "\n".join(found))
                          for found in lines for _ in range(num_samples)])
        return [SimpleNamespace(texts=agent, num_tokens=len(agent)) for agent in texts]

    for sparse in (False, True):
        calls.clear()
        env = make_env("build", width=4, depth=2, height=2, num_types=2, num_blocks=2, num_train=1, num_eval=1,
                       max_turns=3, sparse=sparse)
        output = sample_held_out(copier, env, [item], 1, seed=7, num_turns=3)
        assert [seed for _, seed in calls] == [derive_seed(7, 0), derive_seed(7, 2, 0), derive_seed(7, 3, 0)]
        (episode,) = output.episodes
        assert [list(step.actions) for step in episode.history] == [["place 0 0 0 R", "place 3 1 0 G"],
                                                                     ["place 0 0 1 G", "remove 3 1 0"]]
        assert episode.actions == ["", "place 2 0 0 R"]
        assert "remove 3 1 0" in episode.observations[1]  # it saw the feedback on its wrong block
        metrics, records = score(env, output, 1)
        # Whole target built; one off-target block cost 0.1: shaped or sparse, the episode returns 0.9.
        assert metrics["reward_mean"] == pytest.approx(0.9)
        assert records[0]["counts"]["iou"] == 1.0
        turns = [turn["reward"] for turn in records[0]["earlier_turns"]]
        assert turns == ([0.0, 0.0] if sparse else [pytest.approx(1 / 4 - 0.1), pytest.approx(2 / 3 - 1 / 4)])
        per_turn = [metrics[f"turn{turn}/reward_mean"] for turn in (1, 2, 3)]
        assert per_turn == pytest.approx([0.0, 0.0, 0.9] if sparse else [1 / 4 - 0.1, 2 / 3 - 1 / 4, 1 - 2 / 3])
    with pytest.raises(ValueError, match="num_turns: must be >= 1"):
        sample_held_out(copier, env, [item], 1, seed=7, num_turns=0)
