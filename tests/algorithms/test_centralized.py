"""Centralised MAGRPO (``algorithm.name: centralized``): one policy writes every seat's part of digit_sum,
trains on the task's joint reward, saves, and is evaluated held-out on that joint reward, in training and
in ``teamrl eval``, as a team is."""

from __future__ import annotations

import json

import pytest
import torch

from teamrl.envs import make_env
from teamrl.evaluation.methods import EvalSettings, parse_methods
from teamrl.evaluation.runner import run_evaluation
from teamrl.train import Trainer

CENTRAL_TEAM = {"agents": [{"name": "central"}], "sampling": {"max_new_tokens": 8}}  # both rows of 4 digits


def central_config(tiny_config, **overrides):
    team = {**CENTRAL_TEAM, **overrides.pop("team", {})}
    return tiny_config(algorithm={"name": "centralized", **overrides.pop("algorithm", {})}, team=team, **overrides)


@pytest.mark.parametrize("training", ["full", "lora"])
def test_one_policy_is_trained_on_the_joint_reward_of_its_split_completion(tiny_config, training):
    trainer = Trainer(central_config(tiny_config, steps=2, team={"training": training, "lora": {"r": 4}}))
    inner = make_env("digit_sum", targets=[9], length=4)
    (agent,) = trainer.team
    assert agent.name == "central" and agent.system_prompt == inner.single_agent_role
    assert (agent.adapter is not None) == (training == "lora")
    before = [p.detach().clone() for p in agent.parameters]
    metrics = trainer.train_step()
    assert any(not torch.equal(b, p) for b, p in zip(before, agent.parameters)), "the policy did not change"
    assert metrics["central/grad_norm"] > 0
    turn = trainer._last_tree.turns[0]
    # G = 8 completions per item of the one single-agent prompt, each scored as the split joint action
    assert turn.combos.shape == (8, 1)
    assert turn.observations[0] == [inner.single_agent_observation(turn.items[0])]
    for m, result in enumerate(turn.results[:8]):
        (completion,) = turn.joint_action(0, m)
        split = inner.split_single_agent_output(turn.items[0], completion)
        assert result.total == inner.joint_reward(turn.items[0], split).total
    trainer.close()


def test_held_out_evaluation_scores_the_tasks_joint_reward_in_training_and_in_teamrl_eval(tiny_config, tmp_path):
    config = central_config(tiny_config, steps=2)
    trainer = Trainer(config)
    trainer.train()
    metrics, samples = trainer.evaluate_with_samples(num_samples=2)
    inner = make_env("digit_sum", targets=[9], length=4)
    assert len(samples) == 2 * len(inner.items("eval"))
    for sample in samples:  # every record is the task's joint action (both rows), scored by the task
        item = next(i for i in inner.items("eval") if i["id"] == sample["item"])
        assert len(sample["actions"]) == 2 and sample["observations"] == [inner.single_agent_observation(item)]
        assert sample["reward"] == inner.joint_reward(item, sample["actions"]).total
    assert metrics["reward/mean"] == pytest.approx(sum(s["reward"] for s in samples) / len(samples))
    assert "count/hits" in metrics

    saved = trainer.save_team(tmp_path / "team")
    trainer.close()
    assert json.loads((saved / "team.json").read_text())["algorithm"] == "centralized"
    # teamrl eval on the task's own (two-agent) config runs the saved policy centralised and scores the same.
    task_config = tiny_config(run_dir=str(tmp_path / "eval"))
    results = run_evaluation(task_config, EvalSettings(tuple(parse_methods(f"team:{saved}")), num_samples=2))
    (result,) = results.methods
    assert result.metrics["reward_mean"] == pytest.approx(metrics["reward/mean"], abs=1e-6)
    assert [s["actions"] for s in result.samples] == [s["actions"] for s in samples]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_single_policy_learns_digit_sum(tiny_config, train_and_evaluate, seed):
    # Measured (seeds 0-4, 60 steps, G = 8): held-out 0.11-0.16 before, 0.84-0.95 after, 5-8 s a seed. Here at
    # most 60 steps, stopping once the training reward has converged (0.77, 0.07 above the threshold): measured
    # 33, 24, 24 steps and 0.81, 0.85, 0.81 held-out at seeds 0, 1, 2 (seeds 3-5: 25-27 steps, 0.79-0.83).
    before, after, history = train_and_evaluate(central_config(tiny_config, seed=seed, steps=60), stop_at=0.77)
    assert before < 0.3, f"the untrained policy already scores {before:.2f}"
    assert after > 0.7, f"seed {seed}: held-out joint reward only went {before:.2f} -> {after:.2f}"
    assert history[-1]["reward/mean"] > 0.7
