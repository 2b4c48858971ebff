"""The program task: items and held-out split as the dataset task reads them, the program found and checked at load,
what it returns turned into a reward, OPENAI_BASE_URL per episode thread, and what a saved team records of it."""

from __future__ import annotations

import json
import os
import threading

import pytest

from teamrl.envs.base import env_record, rebuild_env
from teamrl.envs.dataset import DatasetTask
from teamrl.envs.program import ProgramTask
from teamrl.rewards.base import RewardResult


def two_parts(item, base_url):
    return {"plan": 0.5, "text": 1.0}


def reads_the_variable(item, base_url):
    return float(os.environ["OPENAI_BASE_URL"].rsplit("/", 1)[1])


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"key": f"k{n}", "topic": f"topic {n}"}) + "\n" for n in range(10)))
    return str(path)


def test_items_and_the_held_out_split_are_the_dataset_tasks(data):
    task = ProgramTask(two_parts, data, eval_split=3, id_field="key", seed=4, agents=["planner", "writer"],
                       words=["plan"])
    dataset = DatasetTask(data, ["{topic}"], two_parts, eval_split=3, id_field="key", seed=4)
    assert task.splits == dataset.splits
    assert [item["id"] for item in task.items("eval")] == [item["id"] for item in dataset.items("eval")]
    assert task.num_agents == 2 and task.agents == ["planner", "writer"]
    assert {"topic", "plan"} <= set(task.vocabulary())


def test_what_the_program_returns_becomes_its_reward(data):
    task = ProgramTask(two_parts, data)
    assert task.play({"id": "a"}, "http://127.0.0.1:1/v1") == RewardResult(1.5, {"plan": 0.5, "text": 1.0})


def test_a_program_that_cannot_take_item_and_base_url_is_refused_at_load(data):
    with pytest.raises(ValueError, match=r"^env.kwargs.program: .* must take two arguments, \(item, base_url\)"):
        ProgramTask(lambda item: 1.0, data)
    with pytest.raises(ValueError, match="env.kwargs.program: no module named 'nowhere'"):
        ProgramTask("nowhere:run", data)
    with pytest.raises(ValueError, match="env.kwargs.timeout_s: must be a number of seconds > 0"):
        ProgramTask(two_parts, data, timeout_s=0)


def test_each_episode_thread_reads_its_own_base_url_from_the_variable_the_program_reads(data, monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://elsewhere/0")
    task = ProgramTask(reads_the_variable, data, base_url_variable="OPENAI_BASE_URL")
    results, barrier = {}, threading.Barrier(4)

    def play(n: int) -> None:
        barrier.wait()  # all four inside play() at once
        results[n] = task.play({"id": str(n)}, f"http://127.0.0.1:1/episodes/{n}")

    threads = [threading.Thread(target=play, args=(n,)) for n in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert {n: result.total for n, result in results.items()} == {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    assert os.environ["OPENAI_BASE_URL"] == "http://elsewhere/0"  # outside an episode: the process's own


def test_a_saved_team_records_the_program_and_its_agents_and_builds_the_task_again(data):
    task = ProgramTask(f"{__name__}:two_parts", data, eval_split=2)
    task.seat(["planner", "writer"])
    record = env_record(task)
    assert record["name"] == "program"
    assert record["kwargs"]["program"] == f"{__name__}:two_parts"
    assert record["kwargs"]["agents"] == ["planner", "writer"]
    again = rebuild_env(record)
    assert again.agents == ["planner", "writer"] and again.splits == task.splits and not again.joint_prompts
