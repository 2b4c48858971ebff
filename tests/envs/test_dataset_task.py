"""env.name=dataset: a task from a data file, a prompt template per agent and a plain reward function."""

from __future__ import annotations

import json
import math
import re
import uuid

import pytest

from teamrl.envs.base import Step, env_record, make_env, rebuild_env
from teamrl.envs.checks import (
    EnvironmentOutputError,
    checked_individual_rewards,
    checked_observations,
    checked_rewards,
)
from teamrl.rewards.base import RewardResult

REWARDS = '''
from teamrl.rewards.base import RewardResult

def as_number(completions, item):
    return float(item["answer"] in completions[1])

def as_parts(completions, item):
    return {"asks": float("?" in completions[0]), "answers": float(item["answer"] in completions[1])}

def as_result(completions, item, history):
    return RewardResult(len(history), {"turn": len(history)})

def as_nan(completions, item):
    return float("nan")

def as_nan_part(completions, item):
    return {"fine": 1.0, "broken": float("inf")}

def as_none(completions, item):
    return None

def per_agent(completions, item):
    return [float(len(c) > 0) for c in completions]

def feedback(item, history):
    return f"reward so far {history[-1].reward.total}"
'''


@pytest.fixture
def task_folder(tmp_path, monkeypatch):
    """A folder with facts.jsonl (12 items, no ids) and a rewards module; the working directory."""
    module = f"qa_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(REWARDS)
    with open(tmp_path / "facts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"fact": f"fact number {i}", "answer": f"a{i}"}) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path, module


def _task(module, reward="as_number", **kwargs):
    kwargs.setdefault("eval_split", 3)
    return make_env("dataset", data="facts.jsonl", prompts=["Ask about {fact}", "Answer about {fact}"],
                    reward=f"{module}:{reward}", **kwargs)


def test_items_prompts_and_held_out_split(task_folder):
    folder, module = task_folder
    env = _task(module)
    assert env.num_agents == 2 and env.max_turns == 1
    train, held_out = env.items("train"), env.items("eval")
    assert (len(train), len(held_out)) == (9, 3)
    assert {item["id"] for item in train} == {f"train-{i}" for i in range(9)}  # the data had no ids
    assert not {item["fact"] for item in train} & {item["fact"] for item in held_out}
    assert env.observe(train[0]) == [f"Ask about {train[0]['fact']}", f"Answer about {train[0]['fact']}"]
    assert len(_task(module, eval_split=0.25).items("eval")) == 3
    assert len(_task(module, num_train=4, num_eval=2).items("train")) == 4


def test_a_split_chosen_by_name(task_folder):
    folder, module = task_folder
    for split, count in (("train", 5), ("test", 2)):
        (folder / f"qa-{split}.jsonl").write_text(
            "".join(json.dumps({"id": f"{split}{i}", "fact": "f", "answer": "a"}) + "\n" for i in range(count)))
    env = make_env("dataset", data="qa-{split}.jsonl", prompts=["{fact}", "{fact}"], reward=f"{module}:as_number",
                   eval_split="test")
    assert [item["id"] for item in env.items("eval")] == ["test0", "test1"]  # the data's own ids kept
    with pytest.raises(ValueError, match="env.kwargs.data: .*one file without named splits"):
        _task(module, eval_split="test")


def test_reward_functions_return_a_number_parts_or_a_result(task_folder):
    folder, module = task_folder
    item = {"id": "x", "fact": "f", "answer": "a1"}
    assert _task(module).joint_reward(item, ["q", "a1"]).total == 1.0
    parts = _task(module, "as_parts").joint_reward(item, ["why?", "no"])
    assert parts == RewardResult(1.0, {"asks": 1.0, "answers": 0.0})
    step = Step(("o", "o"), ("a", "b"), RewardResult(0.0))
    assert _task(module, "as_result").joint_reward(item, ["q", "a"], [step, step]).total == 2


@pytest.mark.parametrize("reward, value", [("as_nan", "a non-finite total (nan)"),
                                           ("as_nan_part", "a non-finite total (inf)"),
                                           ("as_none", "None")])
def test_a_bad_reward_is_refused_naming_the_function_the_item_and_the_value(task_folder, reward, value):
    folder, module = task_folder
    env = _task(module, reward)
    requests = [({"id": "x", "fact": "f", "answer": "a"}, ["q", "a"], ())]
    with pytest.raises(EnvironmentOutputError, match=rf"^{module}:{reward} returned {re.escape(value)} .*item 'x'"):
        checked_rewards(env, requests, env.joint_rewards(requests))


def test_bad_individual_rewards_and_feedback_name_the_users_function(task_folder):
    folder, module = task_folder
    (folder / f"{module}_bad.py").write_text(
        "def per_agent(completions, item):\n    return [1.0]\n"
        "def feedback(item, history):\n    return [1, 2]\n")
    env = _task(module, individual_reward=f"{module}_bad:per_agent", feedback=f"{module}_bad:feedback")
    item = env.items()[0]
    requests = [(item, ["q", "a"], ())]
    with pytest.raises(EnvironmentOutputError, match=rf"^{module}_bad:per_agent returned \[1.0\]"):
        checked_individual_rewards(env, requests, env.individual_rewards_many(requests))
    step = Step(("o", "o"), ("a", "b"), RewardResult(0.0))
    with pytest.raises(EnvironmentOutputError, match=rf"^{module}_bad:feedback returned \[1, 2\]"):
        checked_observations(env, "next_observations", item, env.next_observations(item, [step]))


def test_a_template_field_the_data_lacks_fails_at_construction_naming_the_item(task_folder):
    folder, module = task_folder
    with pytest.raises(ValueError, match=r"env.kwargs.prompts\[1\]: train item 'train-0' has no field 'question' "
                                         r"\(its fields: fact, answer, id\)"):
        make_env("dataset", data="facts.jsonl", prompts=["{fact}", "{question}"], reward=f"{module}:as_number",
                 eval_split=3)
    with pytest.raises(ValueError, match="env.kwargs.prompts: give a list"):
        make_env("dataset", data="facts.jsonl", prompts="{fact}", reward=f"{module}:as_number")
    with pytest.raises(ValueError, match=f"env.kwargs.reward: module '{module}' .* has no 'missing'"):
        _task(module, "missing")
    (folder / "broken.jsonl").write_text('{"fact": "f"}\n{"fact": oops}\n')
    with pytest.raises(ValueError, match=r"env.kwargs.data: .*broken.jsonl:2: not valid JSON"):
        make_env("dataset", data="broken.jsonl", prompts=["{fact}"], reward=f"{module}:as_number")
    # Where it looked, and the name meant.
    with pytest.raises(ValueError, match=rf"^env.kwargs.data: no file 'fatcs.jsonl' in the working directory or the "
                                         rf"config file's folder \(looked in {folder}\); give its path, absolute or "
                                         rf"relative to one of those; did you mean 'facts.jsonl'\?$"):
        make_env("dataset", data="fatcs.jsonl", prompts=["{fact}"], reward=f"{module}:as_number")
    with pytest.raises(ValueError, match=f"env.kwargs.reward: module '{module}' .* has no 'as_numbr'; did you mean "
                                         f"'as_number'\\?$"):
        _task(module, "as_numbr")
    with pytest.raises(ValueError, match=f"env.kwargs.data: .*{folder / 'nothing.jsonl'}: no such file"):
        make_env("dataset", data=str(folder / "nothing.jsonl"), prompts=["{fact}"], reward=f"{module}:as_number")


def test_individual_rewards_and_multi_turn_feedback(task_folder):
    folder, module = task_folder
    env = _task(module, individual_reward=f"{module}:per_agent", feedback=f"{module}:feedback", roles=["A", "B"])
    item = env.items("train")[0]
    assert env.individual_rewards(item, ["x", ""]) == [1.0, 0.0]
    assert env.max_turns is None and env.roles == ("A", "B")
    step = Step(tuple(env.observe(item)), ("my question", "my answer"), env.joint_reward(item, ["q", item["answer"]]))
    second = env.next_observations(item, [step])
    expected = f"Answer about {item['fact']}\n\nYour previous answer:\nmy answer\n\nFeedback:\nreward so far 1.0"
    assert second[1] == expected
    with pytest.raises(NotImplementedError):
        _task(module).next_observations(item, [step])


def test_a_saved_record_rebuilds_the_same_task_from_anywhere(task_folder, tmp_path_factory, monkeypatch):
    folder, module = task_folder
    env = _task(module, individual_reward=f"{module}:per_agent")
    record = json.loads(json.dumps(env_record(env)))  # plain data, as team.json holds it
    assert record["name"] == "dataset" and record["kwargs"]["reward"] == f"{module}:as_number"
    assert record["kwargs"]["data"] == str(folder / "facts.jsonl") and record["folders"] == [str(folder.resolve())]
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    again = rebuild_env(record)
    assert again.items("eval") == env.items("eval")
    assert again.joint_reward(again.items("eval")[0], ["q", again.items("eval")[0]["answer"]]).total == 1.0


def test_python_users_may_pass_functions(task_folder):
    folder, module = task_folder
    env = make_env("dataset", data="facts.jsonl", prompts=["{fact}", "{fact}"], eval_split=2,
                   reward=lambda completions, item: math.pi)
    assert env.joint_reward(env.items()[0], ["a", "b"]).total == math.pi
    assert "cannot be imported by name" in env_record(env)["kwargs"]["reward"]


def test_the_tiny_model_needs_no_vocabulary_method(task_folder):
    folder, module = task_folder
    words = _task(module).vocabulary()
    assert {"Ask", "about", "fact", "number", "11"} <= set(words)


def test_the_single_agent_baseline_asks_for_every_part_and_reads_them_back(task_folder):
    folder, module = task_folder
    env = _task(module)
    item = env.items("eval")[0]
    prompt = env.single_agent_observation(item)
    assert f"Part 1: Ask about {item['fact']}" in prompt and f"Part 2: Answer about {item['fact']}" in prompt
    assert env.split_single_agent_output(item, "Part 1: why?\npart 2: because\nso") == ["why?", "because\nso"]
    assert env.split_single_agent_output(item, "**Part 2:** only this") == ["", "only this"]
