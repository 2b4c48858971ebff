"""The `schedule` task: its rules, rewards and observations by hand-computed examples, and a short run."""

from __future__ import annotations

import math
import random

import pytest

from teamrl.envs import make_env
from teamrl.envs.base import Step
from teamrl.envs.schedule import ScheduleEnv, parse_commands, task_owner, valid_tasks, violations

# Mon-tue, four meetings. With 2 agents seat 0 owns t1 and t3, seat 1 owns t2 and t4; with 3 agents
# seat 0 owns t1 and t4, seat 1 t2, seat 2 t3.
ITEM = {
    "id": "hand",
    "days": ["mon", "tue"],
    "tasks": [
        {"id": "t1", "duration": 2, "people": ["ann", "bob"], "window_days": ["mon"], "window_hours": [9, 10]},
        {"id": "t2", "duration": 1, "people": ["bob"], "window_days": ["mon", "tue"], "window_hours": [10, 11]},
        {"id": "t3", "duration": 1, "people": ["cat"], "window_days": ["tue"], "window_hours": [9, 10, 11, 12]},
        {"id": "t4", "duration": 1, "people": ["ann", "cat"], "window_days": ["mon"], "window_hours": [13, 14]},
    ],
    "before": [["t2", "t4"]],
}


def hand_env(num_agents: int = 2, **kwargs) -> ScheduleEnv:
    env = ScheduleEnv(num_agents=num_agents, num_train=1, num_eval=1, **kwargs)
    env.splits = {"train": [ITEM], "eval": [ITEM]}
    return env


def step(env: ScheduleEnv, history: list[Step], actions: list[str]) -> list[Step]:
    """``history`` with one more turn, rewarded as the trainer would."""
    return [*history, Step(("",) * env.num_agents, tuple(actions), env.joint_reward(ITEM, actions, history))]


# --- rules ----------------------------------------------------------------------------------------


def test_double_booking_names_both_tasks_and_back_to_back_is_fine():
    clash = {"t1": ("mon", 9), "t2": ("mon", 10)}  # t1 9-11 and t2 10-11 both have bob
    assert violations(ITEM, clash) == [("bob double-booked by t1 and t2 on mon", ("t1", "t2"))]
    assert valid_tasks(ITEM, clash) == set()
    assert valid_tasks(ITEM, {"t1": ("mon", 9), "t2": ("mon", 11)}) == {"t1", "t2"}  # t1 ends as t2 starts
    assert valid_tasks(ITEM, {"t1": ("mon", 9), "t2": ("tue", 10)}) == {"t1", "t2"}  # another day


def test_window_and_working_hours():
    assert violations(ITEM, {"t4": ("mon", 10)}) == [("t4 at mon 10 is outside its allowed slots", ("t4",))]
    assert violations(ITEM, {"t2": ("mon", 12)})[0][0] == "t2 at mon 12 is outside its allowed slots"
    assert violations(ITEM, {"t3": ("mon", 9)})[0][0] == "t3 at mon 9 is outside its allowed slots"  # wrong day
    # t1 lasts 2 hours: starting at 16 it would end at 18.
    assert violations(ITEM, {"t1": ("mon", 16)}) == [("t1 at mon 16 is outside working hours 9-17", ("t1",))]
    assert violations(ITEM, {"t2": ("mon", 8)})[0][0] == "t2 at mon 8 is outside working hours 9-17"


def test_precedence_across_days_and_unplaced_partner():
    # t2 on tue cannot end before t4 on mon.
    assert violations(ITEM, {"t2": ("tue", 10), "t4": ("mon", 13)}) == [("t2 must end before t4 starts", ("t2", "t4"))]
    assert valid_tasks(ITEM, {"t2": ("mon", 11), "t4": ("mon", 13)}) == {"t2", "t4"}
    assert valid_tasks(ITEM, {"t4": ("mon", 13)}) == {"t4"}  # a rule about an unplaced task is not yet broken
    same_day = {**ITEM, "before": [["t4", "t2"]]}  # t4 13-14 then t2 must start at 14 or later on mon
    assert violations(same_day, {"t2": ("mon", 11), "t4": ("mon", 13)})[0][0] == "t4 must end before t2 starts"


def test_parser_reads_commands_and_rejects_the_rest_with_reasons():
    text = "Sure! Here is my plan:\n- **t1 mon 10:00**\nt3, tue, 9; t3 tue 10\nt2 mon 11\nt9 mon 9\nt1 monday 9"
    accepted, rejected = parse_commands(ITEM, 0, text, num_agents=2)
    assert [(c.task, c.day, c.hour) for c in accepted] == [("t1", "mon", 10), ("t3", "tue", 9)]
    assert [(r.text, r.kind) for r in rejected] == [
        ("t3 tue 10", "repeat"), ("t2 mon 11", "foreign"), ("t9 mon 9", "unknown"), ("t1 monday 9", "malformed")]
    assert rejected[1].reason == "t2 belongs to a teammate"
    # A task id with nothing after it, and an hour out of range, are malformed; prose alone costs nothing.
    assert [r.kind for r in parse_commands(ITEM, 0, "t1 mon 25 t3", 2)[1]] == ["malformed", "malformed"]
    assert parse_commands(ITEM, 0, "I will think about mon and 10.", 2) == ([], [])
    assert [task_owner(ITEM, t, 3) for t in ("t1", "t2", "t3", "t4")] == [0, 1, 2, 0]


# --- rewards --------------------------------------------------------------------------------------


def test_shaped_reward_is_the_change_in_valid_share_minus_penalties():
    env = hand_env()
    # Turn 1: t1 and t2 double-book bob; t3 and t4 are valid (t2 at mon 10 ends before t4 at 13): 2 of 4.
    history = step(env, [], ["t1 mon 9\nt3 tue 9", "t2 mon 10\nt4 mon 13"])
    reward = history[0].reward
    assert reward.total == pytest.approx(0.5)
    assert reward.parts == {"progress": pytest.approx(0.5), "penalty": 0.0}
    assert reward.counts == {"valid_tasks": 2.0, "placed_tasks": 4.0, "violations": 1.0, "rejected_commands": 0.0}
    # Turn 2: seat 1 moves t2 to 11 (all 4 valid, +0.5) and writes a malformed and a foreign command (-0.1).
    history = step(env, history, ["", "t2 mon 11 t4 monday 13 t1 mon 9"])
    assert history[1].reward.total == pytest.approx(0.4)
    assert history[1].reward.parts == {"progress": pytest.approx(0.5), "penalty": pytest.approx(-0.1)}
    # Turn 3: seat 0 breaks t1 out of its window: 3 of 4 valid.
    assert env.joint_reward(ITEM, ["t1 mon 16", ""], history).total == pytest.approx(-0.25)


def test_penalties_are_capped_per_turn():
    env = hand_env(penalty=0.05, max_penalty=0.3)
    assert env.joint_reward(ITEM, ["t9 " * 20, ""]).total == pytest.approx(-0.3)


def test_sparse_reward_pays_the_shaped_return_at_the_last_turn():
    env = hand_env(sparse=True, turns=2)
    actions = [["t1 mon 9\nt3 tue 9", "t2 mon 10\nt4 mon 13"], ["", "t2 mon 11 t4 monday 13 t1 mon 9"]]
    history = step(env, [], actions[0])
    assert history[0].reward.total == 0.0
    history = step(env, history, actions[1])
    assert history[1].reward.total == pytest.approx(1.0 - 0.1)
    shaped = hand_env(turns=2)
    assert sum(s.reward.total for s in step(shaped, step(shaped, [], actions[0]), actions[1])) == pytest.approx(0.9)


def test_individual_rewards_score_each_agent_alone():
    env = hand_env()
    # Each agent alone places its two tasks validly (0.5 each); together t1 and t2 clash (joint 0.5):
    # the individual rewards cannot see the clash.
    actions = ["t1 mon 9\nt3 tue 9", "t2 mon 10\nt4 mon 13 t1 tue 9"]
    assert env.individual_rewards(ITEM, actions) == [pytest.approx(0.5), pytest.approx(0.5 - 0.05)]
    assert env.joint_reward(ITEM, actions).total == pytest.approx(0.5 - 0.05)


def test_sparse_individual_rewards_pay_each_agents_shaped_return_at_the_last_turn():
    # Turn 1: seat 0 writes a teammate's t2 (-0.05), seat 1 a malformed day (-0.05). Turn 2: seat 1 places t4 and
    # writes an unknown t9 (-0.05). Each agent's own meetings end valid, 2 of 4: seat 0 0.5 - 0.05, seat 1
    # 0.5 - 0.05 - 0.05: the penalties of every turn count, not the last turn's only.
    turns = [["t1 mon 9\nt3 tue 9 t2 mon 10", "t2 mon 11\nt4 monday 13"], ["", "t4 mon 13 t9 mon 9"]]
    sparse, shaped = hand_env(sparse=True, turns=2), hand_env(turns=2)
    assert sparse.individual_rewards(ITEM, turns[0]) == [0.0, 0.0]
    assert shaped.individual_rewards(ITEM, turns[0]) == [pytest.approx(0.5 - 0.05), pytest.approx(0.25 - 0.05)]
    history = step(sparse, [], turns[0])
    assert sparse.individual_rewards(ITEM, turns[1], history) == [pytest.approx(0.45), pytest.approx(0.4)]
    assert shaped.individual_rewards(ITEM, turns[1], history) == [0.0, pytest.approx(0.25 - 0.05)]


def test_sparse_episodes_shorter_than_the_paying_turn_are_refused():
    hand_env(sparse=True, turns=3).check_num_turns(3)
    hand_env(turns=3).check_num_turns(2)  # shaped: every turn pays
    with pytest.raises(ValueError, match=r"^algorithm.num_turns: sparse: true pays only at turn env.kwargs.turns = 3, "
                                         r"so a 1-turn episode earns 0 everywhere"):
        hand_env(sparse=True, turns=3).check_num_turns(1)


def test_three_agents_own_their_tasks():
    env = hand_env(num_agents=3)
    actions = ["t1 mon 9\nt4 mon 13", "t2 mon 11", "t3 tue 9 t4 mon 14"]  # seat 2's t4 is foreign
    reward = env.joint_reward(ITEM, actions)
    assert reward.total == pytest.approx(1.0 - 0.05)
    assert env.individual_rewards(ITEM, actions) == [pytest.approx(0.5), pytest.approx(0.25), pytest.approx(0.2)]
    history = step(env, [], actions)
    observations = env.next_observations(ITEM, history)
    assert len(observations) == 3
    assert "Your rejected lines: t4 mon 14 (t4 belongs to a teammate)" in observations[2]
    assert "Your rejected lines: none" in observations[0]
    assert "You are scheduler 3 of 3." in observations[2]


# --- observations ---------------------------------------------------------------------------------


def test_first_observation_lists_own_slots_as_ready_lines():
    first, second = hand_env().observe(ITEM)
    assert "t1: 2 hours with ann bob. Allowed: t1 mon 9 | t1 mon 10" in first
    assert "t3: 1 hour with cat. Allowed: t3 tue 9 | t3 tue 10 | t3 tue 11 | t3 tue 12" in first
    assert "t2: 1 hour with bob\nt4: 1 hour with ann cat" in first
    assert "Rules: nobody in two meetings at once; t2 before t4." in first
    assert first.endswith("and nothing else. For example:\nt1 mon 9\nt3 tue 9")
    assert second.endswith("For example:\nt2 mon 10\nt4 mon 13")


def test_next_observations_show_merged_schedule_broken_rules_and_own_rejections():
    env = hand_env()
    history = step(env, [], ["t1 mon 9\nt3 tue 9 t2 mon 9", "t2 mon 10"])
    first, second = env.next_observations(ITEM, history)
    for text in (first, second):
        assert "After turn 1: schedule t1 mon 9 | t2 mon 10 | t3 tue 9 | t4 unplaced" in text
        assert "Broken rules: bob double-booked by t1 and t2 on mon" in text
        assert "Valid: 1 of 4 meetings." in text
    assert "Your rejected lines: t2 mon 9 (t2 belongs to a teammate)" in first
    assert "Your rejected lines: none" in second
    assert first.startswith(env.observe(ITEM)[0])  # the task stays in view


def test_copying_the_example_line_earns_reward_on_every_generated_item():
    """What lets the untrained bundled model earn something: each prompt's first example line is a valid command."""
    for num_agents in (2, 3):
        env = ScheduleEnv(num_agents=num_agents, num_tasks=5, num_train=40, num_eval=10)
        for item in env.items("train"):
            for seat, text in enumerate(env.observe(item)):
                actions = [""] * num_agents
                actions[seat] = text.split("For example:\n", 1)[1].splitlines()[0]
                assert env.joint_reward(item, actions).total == pytest.approx(1 / 5)


# --- items ----------------------------------------------------------------------------------------


def test_items_are_deterministic_feasible_and_splits_disjoint():
    env = ScheduleEnv(num_agents=3, num_tasks=6, num_people=3, precedence_density=0.5, num_train=100, num_eval=30)
    again = ScheduleEnv(num_agents=3, num_tasks=6, num_people=3, precedence_density=0.5, num_train=100, num_eval=30)
    assert env.items("train") == again.items("train") and env.items("eval") == again.items("eval")
    assert env.items("train") != ScheduleEnv(num_agents=3, num_tasks=6, num_train=100, seed=1).items("train")
    key = lambda item: repr((item["tasks"], item["before"]))  # noqa: E731
    assert not {key(i) for i in env.items("train")} & {key(i) for i in env.items("eval")}
    assert len({i["id"] for i in [*env.items("train"), *env.items("eval")]}) == 130
    for item in [*env.items("train"), *env.items("eval")]:
        assert len(item["tasks"]) == 6
        solution = {tid: tuple(slot) for tid, slot in item["solution"].items()}
        assert violations(item, solution) == []  # every item has a valid schedule
        assert env.joint_reward(item, env.split_single_agent_output(
            item, "\n".join(f"{t} {d} {h}" for t, (d, h) in solution.items()))).total == pytest.approx(1.0)
    assert any(item["before"] for item in env.items("train"))


def test_bad_arguments_are_refused():
    for kwargs in ({"num_agents": 1}, {"num_agents": 3, "num_tasks": 2}, {"num_days": 6}, {"turns": 0}):
        with pytest.raises(ValueError):
            ScheduleEnv(**kwargs)


def test_random_strings_never_crash_and_get_feedback():
    env = ScheduleEnv(num_agents=3, num_tasks=5, num_train=4, num_eval=1)
    words = [*env.vocabulary(), "t0", "t99", "t", "9:30", "-1", "mon:", "**", "\n", "\t", "t1t2", "é", "", "10:00"]
    rng = random.Random(0)
    for item in env.items("train"):
        history: list[Step] = []
        for _ in range(3):
            actions = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 30))) for _ in range(3)]
            actions[rng.randrange(3)] = "".join(chr(rng.randint(0, 0x2FF)) for _ in range(50))
            reward = env.joint_reward(item, actions, history)
            assert math.isfinite(reward.total) and -0.5 - 1e-9 <= reward.total <= 1.0
            assert all(math.isfinite(r) for r in env.individual_rewards(item, actions, history))
            history.append(Step(("",) * 3, tuple(actions), reward))
            assert len(env.next_observations(item, history)) == 3


def test_registered_and_vocabulary_covers_commands():
    env = make_env("schedule", num_agents=2, num_train=2, num_eval=1)
    assert isinstance(env, ScheduleEnv)
    vocab = set(env.vocabulary())
    assert {"t1", "t4", "mon", "tue", "9", "16", "ann", "|"} <= vocab


# --- training -------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_agents, algorithm", [
    (3, {"joint_mode": "aligned"}),
    (4, {"joint_mode": "cross", "max_joint_actions": 6, "normalize_advantages": "agent"}),
])
def test_three_and_four_agents_train_two_turns(tiny_config, num_agents, algorithm):
    from teamrl.train import Trainer

    config = tiny_config(env={"name": "schedule", "kwargs": {"num_agents": num_agents, "num_tasks": num_agents,
                                                              "num_train": 8, "num_eval": 2, "turns": 2}},
                         team={"agents": [{"name": f"p{i}"} for i in range(num_agents)],
                               "sampling": {"max_new_tokens": 6}},
                         algorithm={"num_turns": 2, "num_generations": 2, **algorithm}, steps=2, items_per_step=1)
    trainer = Trainer(config)
    try:
        metrics = [trainer.train_step() for _ in range(2)]
    finally:
        trainer.close()
    assert all(math.isfinite(m["reward/mean"]) for m in metrics)
    joint = 6 if algorithm["joint_mode"] == "cross" else 2
    assert metrics[-1]["turn2/joint_actions"] == joint * joint
