"""CentralizedEnv: a team's task as one agent plays it (``algorithm.name: centralized``). Its one seat reads
the task's single-agent prompt; its completion is split into every seat's part and scored with the task's
own joint reward."""

from __future__ import annotations

from pathlib import Path

import pytest

from teamrl.envs import make_env
from teamrl.envs.base import Environment
from teamrl.envs.centralized import CentralizedEnv
from teamrl.evaluation.baselines import Episode, MethodOutput, as_inner_joint_actions
from teamrl.rewards.base import RewardResult

POSTS = str(Path(__file__).parent / "data" / "posts.jsonl")


def test_digit_sum_one_seat_reads_both_rows_and_is_scored_on_the_split():
    inner = make_env("digit_sum", targets=[9], length=2)
    env = CentralizedEnv(inner)
    item = env.items("train")[0]
    assert env.num_agents == 1 and env.max_turns == 1
    assert env.observe(item) == ["target 9 first second"]
    assert env.roles == (inner.single_agent_role,)
    assert env.splits is inner.splits and env.max_reward == inner.max_reward
    assert env.vocabulary() == inner.vocabulary()
    # "4 5 5 4": rows [4, 5] and [5, 4], both pairs sum to 9 -> 1.0, 2 hits
    exact = env.joint_reward(item, ["4 5 5 4"])
    assert exact.total == 1.0 and exact.counts == {"hits": 2.0, "digit_pairs": 2.0}
    # "4 5 3 3": pairs (4, 3) = 7 -> 1 - 2/10 = 0.8 and (5, 3) = 8 -> 0.9; mean 0.85, no hit
    near = env.joint_reward(item, ["4 5 3 3"])
    assert near.total == pytest.approx(0.85) and near.counts["hits"] == 0
    # A completion with only the first row leaves the second seat empty: no pair scores.
    assert env.joint_reward(item, ["4 5"]).total == 0.0
    assert [r.total for r in env.joint_rewards([(item, ["4 5 5 4"], ()), (item, ["4 5 3 3"], ())])] == \
        [1.0, pytest.approx(0.85)]


def test_writing_task_reward_is_the_inner_joint_reward_of_the_two_paragraphs():
    inner = make_env("tldr", source=POSTS, eval_size=3)
    env = CentralizedEnv(inner)
    item = env.items("eval")[0]
    assert env.observe(item) == [inner.single_agent_observation(item)]
    assert env.roles == (inner.single_agent_role,)
    short = "The landlord kept the whole deposit after the tenant moved out of the flat."
    detailed = ("The tenant moved out and cleaned the flat. However, the landlord kept the deposit, claiming "
                "stains on the carpet. Therefore the tenant is asking whether small claims court is worth it.")
    reward = env.joint_reward(item, [f"Paragraph 1: {short}\n\nParagraph 2: {detailed}"])
    expected = inner.joint_reward(item, [short, detailed])
    assert expected.total > 0.5  # the pair passes the length gate at least
    assert reward.total == expected.total and reward.parts == expected.parts
    # One paragraph: the detailed seat is empty and the length gate fails -> 0
    assert env.joint_reward(item, [short]).total == 0.0


def test_as_inner_joint_actions_records_every_seats_part_and_the_whole_completion():
    env = CentralizedEnv(make_env("digit_sum", targets=[9], length=2))
    item = env.items("eval")[0]
    output = MethodOutput([Episode(item, ["target 9 first second"], ["4 5 3 3"])], tokens=4, seconds=0.5)
    joint = as_inner_joint_actions(env, output)
    assert joint.episodes[0].actions == ["4 5", "3 3"]
    assert joint.episodes[0].trace == {"completion": "4 5 3 3"}
    assert joint.episodes[0].observations == ["target 9 first second"]
    assert (joint.tokens, joint.seconds) == (4, 0.5)
    assert output.episodes[0].actions == ["4 5 3 3"]  # the caller's output is left as it was


def test_a_task_without_a_single_agent_prompt_is_refused():
    class PairsOnly(Environment):
        splits = {"train": [{}], "eval": [{}]}

        def observe(self, item):
            return ["a", "b"]

        def joint_reward(self, item, actions, history=()):
            return RewardResult(0.0)

    with pytest.raises(ValueError, match="'centralized' needs a task a single agent can play; PairsOnly"):
        CentralizedEnv(PairsOnly())
