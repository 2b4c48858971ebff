"""What a task's own code returns is checked where it enters teamrl: a wrong type, count or a non-finite
number is refused with one line that names the task's method, the item and the value."""

from __future__ import annotations

import math

import pytest

from teamrl.envs.centralized import CentralizedEnv
from teamrl.envs.checks import (
    EnvironmentOutputError,
    checked_individual_rewards,
    checked_observations,
    checked_reward,
    checked_rewards,
    user_function,
)
from teamrl.envs.digit_sum import DigitSumGame
from teamrl.rewards.base import RewardResult


class FactQA(DigitSumGame):
    """A user's task: overrides only the one-at-a-time reward methods."""

    def joint_reward(self, item, actions, history=()):
        return RewardResult(1.0)

    def individual_rewards(self, item, actions, history=()):
        return [1.0, 1.0]


class BatchedQA(FactQA):
    """A user's task that scores batches itself."""

    def joint_rewards(self, requests):
        return [RewardResult(1.0) for _ in requests]

    def individual_rewards_many(self, requests):
        return [[1.0, 1.0] for _ in requests]


ITEM = {"id": "q7", "target": 9}
REQUEST = (ITEM, ("1", "8"), ())


def _error(check, *args) -> str:
    with pytest.raises(EnvironmentOutputError) as info:
        check(*args)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_error_is_a_value_error_so_the_cli_reports_it_in_one_line():
    assert issubclass(EnvironmentOutputError, ValueError)


def test_the_named_function_is_the_one_the_task_defines():
    assert user_function(FactQA(), "joint_rewards") == "FactQA.joint_reward"
    assert user_function(BatchedQA(), "joint_rewards") == "BatchedQA.joint_rewards"
    assert user_function(FactQA(), "individual_rewards_many") == "FactQA.individual_rewards"
    assert user_function(BatchedQA(), "individual_rewards_many") == "BatchedQA.individual_rewards_many"
    assert user_function(FactQA(), "next_observations") == "FactQA.next_observations"
    # A centralised agent plays the task through its single-agent hook and its reward.
    central = CentralizedEnv(FactQA())
    assert user_function(central, "observe") == "FactQA.single_agent_observation"
    assert user_function(central, "joint_rewards") == "FactQA.joint_reward"


@pytest.mark.parametrize("total", [math.nan, math.inf, -math.inf])
def test_a_non_finite_total_is_refused(total):
    message = _error(checked_reward, FactQA(), ITEM, RewardResult(total))
    assert "FactQA.joint_reward" in message and "'q7'" in message and "non-finite total" in message
    assert repr(total) in message


@pytest.mark.parametrize("field", ["parts", "counts"])
def test_a_non_finite_part_or_count_is_refused(field):
    result = RewardResult(0.5, **{field: {"format": 1.0, "bonus": math.nan}})
    message = _error(checked_reward, FactQA(), ITEM, result)
    assert "FactQA.joint_reward returned a " in message and "'bonus' that is not finite (nan)" in message
    assert "'q7'" in message


@pytest.mark.parametrize("value", [None, [1.0], 1.0, {"total": 1.0}])
def test_a_reward_that_is_not_a_reward_result_is_refused(value):
    message = _error(checked_reward, FactQA(), ITEM, value)
    assert message.startswith("FactQA.joint_reward returned ") and repr(value) in message and "'q7'" in message
    assert "teamrl.rewards.base.RewardResult" in message


def test_a_total_that_is_not_a_number_is_refused():
    message = _error(checked_reward, FactQA(), ITEM, RewardResult("0.5"))
    assert "total" in message and "'0.5'" in message


def test_a_good_reward_passes_unchanged():
    result = RewardResult(0.5, {"level": 0.5}, {"hits": 2})
    assert checked_reward(FactQA(), ITEM, result) is result
    assert checked_rewards(BatchedQA(), [REQUEST], [result]) == [result]


def test_a_long_value_is_truncated():
    message = _error(checked_reward, FactQA(), ITEM, ["x" * 10_000])
    assert len(message) < 400 and "..." in message


@pytest.mark.parametrize("results", [[], [RewardResult(1.0)] * 3])
def test_joint_rewards_must_give_one_result_per_joint_action(results):
    message = _error(checked_rewards, BatchedQA(), [REQUEST, REQUEST], results)
    assert "BatchedQA.joint_rewards" in message and f"{len(results)} result(s) for 2 joint actions" in message
    assert "'q7'" in message


def test_joint_rewards_are_checked_one_by_one():
    message = _error(checked_rewards, BatchedQA(), [REQUEST, REQUEST], [RewardResult(1.0), None])
    assert message.startswith("BatchedQA.joint_rewards returned None") and "'q7'" in message


@pytest.mark.parametrize("observations", [["only one"], ["a", "b", "c"], "ab", None, ["a", None]])
def test_observations_must_be_a_list_of_one_string_per_agent(observations):
    for method in ("observe", "next_observations"):
        message = _error(checked_observations, FactQA(), method, ITEM, observations)
        assert message.startswith(f"FactQA.{method} returned {observations!r}") and "'q7'" in message
        assert "2 strings" in message


def test_good_observations_pass():
    assert checked_observations(FactQA(), "observe", ITEM, ("a", "b")) == ["a", "b"]


@pytest.mark.parametrize("rewards", [[1.0], [1.0, math.nan], [1.0, "1"], None])
def test_individual_rewards_must_be_one_finite_number_per_agent(rewards):
    message = _error(checked_individual_rewards, FactQA(), [REQUEST], [rewards])
    assert message.startswith(f"FactQA.individual_rewards returned {rewards!r}") and "'q7'" in message
    assert "2 finite numbers" in message


def test_individual_rewards_must_cover_every_joint_action():
    message = _error(checked_individual_rewards, BatchedQA(), [REQUEST, REQUEST], [[1.0, 1.0]])
    assert "BatchedQA.individual_rewards_many" in message and "1 result(s) for 2 joint actions" in message


def test_an_item_without_an_id_is_still_named():
    message = _error(checked_reward, FactQA(), {"target": 9}, None)
    assert "an item with no id" in message
