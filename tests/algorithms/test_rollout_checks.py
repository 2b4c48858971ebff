"""The rollout checks what the task's own code returns: observations of the wrong number or type, rewards of
the wrong type, number or a non-finite value each stop it with one line naming the method, item and value,
instead of an IndexError deep inside, a silently dropped observation or a NaN trained on."""

from __future__ import annotations

import math

import pytest

from teamrl.envs.digit_sum import DigitSumGame
from teamrl.rewards.base import RewardResult
from teamrl.rollout.tree import sample_tree
from teamrl.train import Trainer


def _game(name: str, **methods) -> DigitSumGame:
    """digit_sum under the class name ``name`` with ``methods`` replaced: a user's task with a mistake."""
    return type(name, (DigitSumGame,), methods)(targets=[9], length=4)


def _rollout(tiny_config, env, **algorithm):
    config = tiny_config(algorithm={"num_generations": 2, **algorithm})
    with Trainer(config, env=env) as trainer:
        return sample_tree(trainer.agents.sample, trainer.env, trainer.items[:2], config.algorithm, seed=1)


def _refused(tiny_config, env, **algorithm) -> str:
    with pytest.raises(ValueError) as info:
        _rollout(tiny_config, env, **algorithm)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("observations", [["target 9 first"], ["target 9 first", "target 9 second", "extra"]])
def test_observe_must_give_one_observation_per_agent(tiny_config, observations):
    message = _refused(tiny_config, _game("FactQA", observe=lambda self, item: observations))
    assert message.startswith(f"FactQA.observe returned {observations!r} for item 'train-")


@pytest.mark.parametrize("observations", [["again"], ["again", "again", "again"]])
def test_next_observations_must_give_one_observation_per_agent(tiny_config, observations):
    env = _game("FactQA", next_observations=lambda self, item, history: observations)
    message = _refused(tiny_config, env, num_turns=2)
    assert message.startswith(f"FactQA.next_observations returned {observations!r} for item 'train-")


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_joint_reward_stops_the_rollout(tiny_config, value):
    env = _game("FactQA", joint_reward=lambda self, item, actions, history=(): RewardResult(value))
    message = _refused(tiny_config, env)
    assert message.startswith("FactQA.joint_reward returned a non-finite total") and repr(value) in message
    assert "'train-" in message


def test_a_nan_reward_part_stops_the_rollout(tiny_config):
    def joint_reward(self, item, actions, history=()):
        return RewardResult(0.5, parts={"format": 0.5, "bonus": math.nan})

    message = _refused(tiny_config, _game("FactQA", joint_reward=joint_reward))
    assert "FactQA.joint_reward" in message and "'bonus'" in message and "nan" in message


@pytest.mark.parametrize("value", [None, [0.5], 0.5])
def test_a_joint_reward_that_is_not_a_reward_result_stops_the_rollout(tiny_config, value):
    message = _refused(tiny_config, _game("FactQA", joint_reward=lambda self, item, actions, history=(): value))
    assert message.startswith(f"FactQA.joint_reward returned {value!r} for item 'train-")


@pytest.mark.parametrize("drop", [1, -1])
def test_joint_rewards_must_give_one_result_per_joint_action(tiny_config, drop):
    def joint_rewards(self, requests):
        results = [DigitSumGame.joint_reward(self, *request) for request in requests]
        return results[:-1] if drop == 1 else [*results, results[0]]

    message = _refused(tiny_config, _game("FactQA", joint_rewards=joint_rewards))
    assert "FactQA.joint_rewards returned" in message and "for 4 joint actions" in message


def test_individual_rewards_must_give_a_finite_number_per_agent(tiny_config):
    env = _game("FactQA", individual_rewards=lambda self, item, actions, history=(): [1.0, math.nan])
    message = _refused(tiny_config, env, learners="individual")
    assert message.startswith("FactQA.individual_rewards returned [1.0, nan] for item 'train-")


def test_the_built_in_task_passes_every_check_over_two_turns(tiny_config):
    # The checks let a well-behaved task's outputs through unchanged: every expansion point's observations are
    # the task's own (turn 2: its feedback on the history), every joint action's reward is the task's.
    env = DigitSumGame(targets=[9], length=4)
    tree = _rollout(tiny_config, env, num_turns=2)
    first, second = tree.turns
    assert first.parents.tolist() == [0, 1] and second.parents.tolist() == [0, 1, 2, 3]  # every joint action grew
    for turn in tree.turns:
        for e, (item, history) in enumerate(zip(turn.items, turn.histories)):
            expected = env.next_observations(item, history) if history else env.observe(item)
            assert turn.observations[e] == expected
            for m in range(len(turn.combos)):
                result = turn.results[e * len(turn.combos) + m]
                assert result == env.joint_reward(item, turn.joint_action(e, m), history)
                assert turn.rewards[e, m, 0] == pytest.approx(result.total)
    assert [len(history) for history in second.histories] == [1] * 4
    assert [history[0].actions for history in second.histories] == [first.joint_action(e, m) for e in range(2)
                                                                     for m in range(2)]
