"""Evaluation checks what the task's own code returns as training does: held-out sampling and scoring, the
prompt-only baselines and ``teamrl generate`` refuse a wrong observation or reward with one line naming the
task's method, the item and the value."""

from __future__ import annotations

import math

import pytest

from teamrl.cli import main
from teamrl.envs.base import ENVIRONMENTS
from teamrl.envs.digit_sum import DigitSumGame
from teamrl.evaluation import heldout
from teamrl.evaluation.baselines import BASELINES, Episode, MethodOutput
from teamrl.rewards.base import RewardResult
from teamrl.train import Trainer


class OneObservation(DigitSumGame):
    """A user's task whose observe forgets the second agent, and whose single-agent prompt is not a string."""

    def observe(self, item):
        return [f"target {item['target']} first"]

    def single_agent_observation(self, item):
        return None


class NaNReward(DigitSumGame):
    """A user's task whose reward is NaN."""

    def joint_reward(self, item, actions, history=()):
        return RewardResult(math.nan)


class NoReward(DigitSumGame):
    """A user's task whose reward forgets to return."""

    def joint_reward(self, item, actions, history=()):
        super().joint_reward(item, actions, history)


def _never_sampled(*args):
    raise AssertionError("sampled although the observations were wrong")


def test_held_out_sampling_refuses_a_wrong_number_of_observations():
    env = OneObservation()
    with pytest.raises(ValueError, match=r"^OneObservation\.observe returned \['target \d+ first'\] for item 'eval-0'"):
        heldout.sample_held_out(_never_sampled, env, env.items("eval")[:2], num_samples=1, seed=0)


def test_held_out_scoring_refuses_a_non_finite_reward():
    env = NaNReward()
    item = env.items("eval")[0]
    output = MethodOutput([Episode(item, env.observe(item), ["1 2", "8 7"])], tokens=4, seconds=1.0)
    with pytest.raises(ValueError, match=r"^NaNReward\.joint_reward returned a non-finite total \(nan\) for "
                                         r"item 'eval-0'"):
        heldout.score(env, output, num_samples=1)


@pytest.mark.parametrize("baseline", ["concat", "sequential", "discussion", "single"])
def test_every_baseline_refuses_a_wrong_observation_before_it_samples(baseline, tiny_config):
    with Trainer(tiny_config(steps=1)) as trainer:
        team = trainer.team
    env = OneObservation()
    method = "single_agent_observation" if baseline == "single" else "observe"
    with pytest.raises(ValueError, match=rf"^OneObservation\.{method} returned .* for item 'eval-0'"):
        BASELINES[baseline](env, team, env.items("eval")[:1], 1)


def test_teamrl_generate_refuses_a_reward_that_is_not_a_reward_result(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(ENVIRONMENTS, "no_reward", NoReward)
    with Trainer(tiny_config(env={"name": "no_reward"}, steps=1)) as trainer:
        team = trainer.save_team(tmp_path / "team")
    assert main(["generate", str(team), "--split", "eval", "--limit", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("teamrl: error: ")]
    assert len(errors) == 1 and errors[0].startswith("teamrl: error: NoReward.joint_reward returned None for item "
                                                     "'eval-0'; it must return a teamrl.rewards.base.RewardResult")
