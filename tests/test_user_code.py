"""An exception raised in a user's code, wherever teamrl calls it (training's rollout and held-out evaluation,
`teamrl train`, `eval`, `generate`, `serve`), is one line: the user's function, the item, the exception's type and
message and the line of the user's file it was raised at; training adds the checkpoint it keeps and the command
that resumes; `--verbose` or TEAMRL_TRACEBACK=1 prints the whole traceback."""

from __future__ import annotations

import importlib
import json
import re
import uuid
from pathlib import Path

import pytest
import yaml

from teamrl.cli import main
from teamrl.envs.base import make_env
from teamrl.train import Trainer, TrainingStopped, batch_indices
from teamrl.user_code import UserCodeError, user_code, user_location

# A user's task: every method the rollout, the evaluation and the baselines call raises on request, each on a line
# marked `# raises: METHOD`; joint_reward fails inside the standard library, called from the user's line.
TASK = '''
import json

from teamrl import Environment, RewardResult

BROKEN = set()  # what raises: method names, or item ids (joint_reward on that item)


class FactQA(Environment):
    """Two agents ask and answer about a fact."""

    num_agents = 2
    roles = ("You ask.", "You answer.")
    max_turns = 2

    def __init__(self, num_facts=8):
        facts = [{"id": f"fact-{i}", "fact": f"fact {i} is {i * 3}", "answer": str(i * 3)} for i in range(num_facts)]
        self.splits = {"train": facts[2:], "eval": facts[:2]}

    def observe(self, item):
        if "observe" in BROKEN:
            return [item["answer"] / 2, ""]  # raises: observe
        return [f"ask about {item['fact']}", f"answer about {item['fact']}"]

    def next_observations(self, item, history):
        if "next_observations" in BROKEN:
            return [str(len(history) / 0)] * 2  # raises: next_observations
        return [f"again {item['fact']}", f"again {item['fact']}"]

    def joint_reward(self, item, actions, history=()):
        if "joint_reward" in BROKEN or item["id"] in BROKEN:
            json.loads("not json: " + actions[0])  # raises: joint_reward
        return RewardResult(float(item["answer"] in actions[1]))

    def joint_rewards(self, requests):
        if "joint_rewards" in BROKEN:
            raise RuntimeError(f"grader down for {len(requests)} requests")  # raises: joint_rewards
        return [self.joint_reward(*request) for request in requests]

    def individual_rewards(self, item, actions, history=()):
        if "individual_rewards" in BROKEN:
            return [1.0, float("x")]  # raises: individual_rewards
        return [1.0, 1.0]

    def single_agent_observation(self, item):
        if "single_agent_observation" in BROKEN:
            return {}["prompt"]  # raises: single_agent_observation
        return f"ask and answer about {item['fact']}"

    def split_single_agent_output(self, item, completion):
        return [completion, completion]

    def teammates_observation(self, item, seat, observation, teammates, own=None):
        if "teammates_observation" in BROKEN:
            return observation + None  # raises: teammates_observation
        return super().teammates_observation(item, seat, observation, teammates, own)
'''

REWARDS = '''
def reward(completions, item):
    return len(completions[0]) / 0  # raises: reward

def individual(completions, item):
    return [float(c) for c in completions]  # raises: individual

def feedback(item, history):
    return history[5].actions  # raises: feedback
'''

ERRORS = {"observe": "TypeError: unsupported operand type(s) for /: 'str' and 'int'",
          "next_observations": "ZeroDivisionError: division by zero",
          "joint_reward": "JSONDecodeError: Expecting value: line 1 column 1 (char 0)",
          "joint_rewards": "RuntimeError: grader down for",
          "individual_rewards": "ValueError: could not convert string to float: 'x'",
          "single_agent_observation": "KeyError: 'prompt'",
          "teammates_observation": "TypeError: can only concatenate str (not \"NoneType\") to str",
          "reward": "ZeroDivisionError: division by zero",
          "individual": "ValueError: could not convert string to float",
          "feedback": "IndexError: list index out of range"}


def line_of(source: str, method: str) -> int:
    """The line of ``source`` marked ``# raises: method``."""
    return next(number for number, line in enumerate(source.splitlines(), 1) if line.endswith(f"# raises: {method}"))


class UserModule:
    """A user's module written to ``folder`` under a fresh name, imported; ``where(method)``: its raising line."""

    def __init__(self, folder, source: str, stem: str):
        self.name = f"{stem}_{uuid.uuid4().hex[:8]}"
        self.folder = folder
        self.source = source
        (folder / f"{self.name}.py").write_text(source)

    def where(self, method: str) -> str:
        return f"{self.name}.py:{line_of(self.source, method)}"

    @property
    def module(self):
        return importlib.import_module(self.name)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The FactQA module in a folder of its own, importable (as teamrl imports a config's module:Class)."""
    folder = tmp_path_factory.mktemp("project")
    user = UserModule(folder, TASK, "fact_tasks")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield user


@pytest.fixture
def broken(task):
    """``broken(*names)``: make those methods (or items) of the task raise, until the test ends."""
    module = task.module
    yield lambda *names: module.BROKEN.update(names)
    module.BROKEN.clear()


def one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


def expect(message: str, function: str, error: str, where: str, item: str) -> None:
    """``message`` names the function, the exception, the user's file:line and the item, in that order."""
    assert re.search(rf"{re.escape(function)} raised {re.escape(error)}.* at \S*{re.escape(where)}, on "
                     rf"{re.escape(item)}", message), message


def factqa(task, **kwargs):
    return make_env(f"{task.name}:FactQA", **kwargs)


# ------------------------------------------------------------------------------------------------------------
# What the error says


def test_the_location_is_the_users_innermost_line_not_the_librarys(task, broken):
    broken("joint_reward")
    env = factqa(task)
    item = env.items("eval")[0]
    with pytest.raises(UserCodeError) as info:
        env.joint_reward(item, ["q", "a"])
    err = info.value
    assert err.location.endswith(task.where("joint_reward"))  # json.loads raised it, inside the standard library
    assert err.function == "FactQA.joint_reward" and type(err.error).__name__ == "JSONDecodeError"
    assert err.__cause__ is err.error
    expect(one_line(str(err)), "FactQA.joint_reward", ERRORS["joint_reward"], task.where("joint_reward"),
           "item 'fact-0'")


def test_a_batch_names_its_items_and_an_inner_call_is_reported_once(task, broken):
    env = factqa(task)
    requests = [(item, ["q", "a"], ()) for item in env.items("train")[:3]]
    broken("joint_rewards")
    with pytest.raises(UserCodeError, match=r"^FactQA.joint_rewards raised RuntimeError: grader down for 3 requests "
                                            r"at \S+, on items \['fact-2', 'fact-3', 'fact-4'\]$"):
        env.joint_rewards(requests)
    task.module.BROKEN.clear()
    broken("fact-3")  # joint_rewards calls joint_reward: the innermost user function is the one named
    with pytest.raises(UserCodeError, match=r"^FactQA.joint_reward raised JSONDecodeError.*on item 'fact-3'$"):
        env.joint_rewards(requests)


def test_a_helper_in_another_user_file_is_the_location(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    helper = UserModule(tmp_path, "def parse(text):\n    return int(text)  # raises: parse\n", "helpers")
    caller = UserModule(tmp_path, f"from {helper.name} import parse\n\ndef score(text):\n    return parse(text)\n",
                        "scores")
    with pytest.raises(UserCodeError) as info, user_code("scores:score", {"id": 7}):
        caller.module.score("seven")
    assert info.value.location == helper.where("parse")  # relative to the working directory, which holds it
    assert str(info.value).endswith(f"at {helper.where('parse')}, on item 7")


def test_teamrls_own_messages_about_returned_values_pass_unchanged(task, broken):
    from teamrl.envs.checks import EnvironmentOutputError

    with pytest.raises(EnvironmentOutputError, match="^already said$"), user_code("FactQA.observe", {"id": 1}):
        raise EnvironmentOutputError("already said")


def test_a_location_outside_any_user_file_falls_back_to_the_innermost_frame_outside_teamrl():
    try:
        json.loads("{")
    except ValueError as err:
        assert user_location(err).endswith(f"{__file__.rsplit('/', 1)[-1]}:{err.__traceback__.tb_lineno}")


# ------------------------------------------------------------------------------------------------------------
# Training: the rollout of a step, and the held-out evaluation


def _trainer(task, tiny_config, **overrides) -> Trainer:
    config = tiny_config(env={"name": f"{task.name}:FactQA", "kwargs": {}}, steps=3, items_per_step=2,
                         algorithm={"num_generations": 2, **overrides.pop("algorithm", {})}, **overrides)
    return Trainer(config)


@pytest.mark.parametrize("method, algorithm", [
    ("observe", {}), ("next_observations", {"num_turns": 2}), ("joint_reward", {}), ("joint_rewards", {}),
    ("individual_rewards", {"learners": "individual"}),
])
def test_a_task_method_that_raises_stops_training_with_one_line_and_the_resume_command(
        task, broken, tiny_config, method, algorithm):
    with _trainer(task, tiny_config, algorithm=algorithm) as trainer:
        trainer.train_step()
        checkpoint = trainer.save()
        broken(method)
        with pytest.raises(TrainingStopped) as info:
            trainer.train_step()
    message = one_line(str(info.value))
    assert message.startswith(f"training stopped at step 2 of 3, before its update: FactQA.{method} raised ")
    expect(message, f"FactQA.{method}", ERRORS[method], task.where(method),
           "items [" if method == "joint_rewards" else "item 'fact-")
    assert message.endswith(f"the last checkpoint, {checkpoint}, is kept; fix the cause, then resume with: "
                            f"Trainer(load_config({str(trainer.run_dir / 'config.yaml')!r}), resume=True)")
    assert isinstance(info.value.__cause__, UserCodeError)


def test_a_raise_in_the_held_out_evaluation_stops_training_naming_it(task, broken, tiny_config):
    with _trainer(task, tiny_config, eval={"every_steps": 1, "items": 2}) as trainer:
        broken("observe")
        with pytest.raises(TrainingStopped) as info:
            trainer.train()
    message = one_line(str(info.value))
    assert message.startswith("training stopped at step 0 of 3, in its held-out evaluation: FactQA.observe raised")
    expect(message, "FactQA.observe", ERRORS["observe"], task.where("observe"), "item 'fact-0'")
    assert "no checkpoint was written yet" in message


@pytest.mark.parametrize("field, function, algorithm", [
    ("reward", "reward", {}), ("individual_reward", "individual", {"learners": "individual"}),
    ("feedback", "feedback", {"num_turns": 2}),
])
def test_a_dataset_tasks_function_that_raises_stops_training_with_one_line(tmp_path, monkeypatch, tiny_config, field,
                                                                           function, algorithm):
    monkeypatch.chdir(tmp_path)  # where the data and the reward module are found
    with open(tmp_path / "facts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"id": f"f{i}", "fact": f"fact {i}"}) + "\n")
    # The joint reward works when another function is the one that raises, so that the rollout reaches it.
    source = REWARDS if field == "reward" else REWARDS.replace("/ 0  # raises: reward", "/ 1")
    rewards = UserModule(tmp_path, source, "qa_rewards")
    kwargs = {"data": "facts.jsonl", "prompts": ["Ask about {fact}", "Answer about {fact}"], "eval_split": 2,
              "reward": f"{rewards.name}:reward", field: f"{rewards.name}:{function}"}
    config = tiny_config(env={"name": "dataset", "kwargs": kwargs}, steps=2, items_per_step=2,
                         algorithm={"num_generations": 2, **algorithm})
    with Trainer(config) as trainer, pytest.raises(TrainingStopped) as info:
        trainer.train_step()
    message = one_line(str(info.value))
    expect(message, f"{rewards.name}:{function}", ERRORS[function], rewards.where(function), "item 'f")
    assert message.startswith("training stopped at step 1 of 2, before its update:")
    assert "no checkpoint was written yet: fix the cause, then start again" in message


# ------------------------------------------------------------------------------------------------------------
# The command line: `teamrl train`, `eval`, `generate`, and `serve`'s answer


@pytest.fixture
def config_file(task, tiny_config_data, tmp_path):
    """A config beside the task's module: FactQA, 3 steps of 2 items, a checkpoint every step."""
    data = tiny_config_data(env={"name": f"{task.name}:FactQA", "kwargs": {}}, steps=3, items_per_step=2,
                            algorithm={"num_generations": 2}, checkpoint={"save_every": 1})
    path = task.folder / f"config-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data


def test_teamrl_train_says_it_in_one_line_exits_2_and_its_resume_command_works(task, broken, config_file, capsys):
    path, data = config_file
    env = factqa(task)
    train = env.items("train")
    first, second = (set(batch_indices(len(train), 2, step, 0)) for step in (0, 1))
    victim = train[sorted(second - first)[0]]["id"]  # an item step 2 draws, step 1 does not
    broken(victim)
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("teamrl: error: training stopped at step 2 of 3, before its update: ")
    expect(err, "FactQA.joint_reward", ERRORS["joint_reward"], task.where("joint_reward"), f"item {victim!r}")
    resume = re.search(r"resume with: (teamrl train \S+ --resume) \(--verbose or TEAMRL_TRACEBACK=1 shows the "
                       r"traceback\)$", err.strip())
    assert resume, err
    assert "step_000001" in err

    task.module.BROKEN.clear()  # the user fixes the cause
    argv = resume.group(1).split()
    assert main(argv[1:]) == 0, capsys.readouterr().err
    assert json.loads((Path(data["run_dir"]) / "team" / "team.json").read_text())["step"] == 3


@pytest.mark.parametrize("how", ["--verbose", "TEAMRL_TRACEBACK=1"])
def test_verbose_or_the_environment_variable_prints_the_traceback(task, broken, config_file, capsys, monkeypatch,
                                                                   how):
    path, _ = config_file
    broken("observe")
    argv = ["train", str(path), "--overwrite"]
    if how.startswith("--"):
        argv.append(how)
    else:
        monkeypatch.setenv(*how.split("="))
    main(["train", str(path), "steps=1", "checkpoint.save_every=0"])  # a run to overwrite: observe broken at once
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "--verbose or TEAMRL_TRACEBACK" not in err
    assert f'{task.name}.py", line {line_of(TASK, "observe")}, in observe' in err  # the user's frame, in full
    last = err.strip().splitlines()[-1]
    assert last.startswith("teamrl: error: ") and "FactQA.observe raised TypeError" in last


@pytest.fixture(scope="module")
def saved_team(task, tmp_path_factory):
    """FactQA's team, trained a step and saved (RUN_DIR/team)."""
    from teamrl.config import config_from_dict

    run_dir = tmp_path_factory.mktemp("saved") / "run"
    config = config_from_dict({
        "env": {"name": f"{task.name}:FactQA"}, "steps": 1, "items_per_step": 2, "run_dir": str(run_dir),
        "team": {"model": "tiny", "training": "full", "sampling": {"max_new_tokens": 4},
                 "agents": [{"name": "first"}, {"name": "second"}]},
        "algorithm": {"num_generations": 2}, "logging": {"progress_bar": False}, "eval": {"every_steps": 0}})
    with Trainer(config) as trainer:
        trainer.train_step()
        return trainer.save_team()


@pytest.mark.parametrize("method", ["observe", "joint_reward"])
def test_teamrl_generate_says_it_in_one_line(task, broken, saved_team, capsys, method):
    broken(method)
    assert main(["generate", str(saved_team), "--split", "eval", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("teamrl: error: ") and err.count("\n") == 1
    expect(err, f"FactQA.{method}", ERRORS[method], task.where(method), "item 'fact-0'")


@pytest.mark.parametrize("method, broken_method", [
    ("single", "single_agent_observation"), ("concat", "joint_rewards"), ("sequential", "teammates_observation"),
    ("team", "observe"),
])
def test_teamrl_eval_says_it_in_one_line(task, broken, config_file, saved_team, tmp_path, capsys, method,
                                        broken_method):
    path, _ = config_file
    broken(broken_method)
    methods = f"team:{saved_team}" if method == "team" else method
    code = main(["eval", str(path), "--methods", methods, "--max-items", "1", "--out", str(tmp_path / "eval")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("teamrl: error: ") and err.count("\n") == 1, err
    expect(err, f"FactQA.{broken_method}", ERRORS[broken_method], task.where(broken_method),
           "item 'fact-0'")


def test_teamrl_serve_answers_400_naming_the_users_line(task, broken, saved_team):
    pytest.importorskip("fastapi", reason="teamrl serve needs the serve extra")
    from fastapi.testclient import TestClient

    from teamrl.serve.app import create_app

    with TestClient(create_app(saved_team)) as client:
        broken("observe")
        response = client.post("/v1/chat/completions", json={
            "model": "run", "messages": [{"role": "user", "content": '{"fact": "a fact", "answer": "1"}'}]})
    assert response.status_code == 400, response.text
    message = one_line(response.json()["error"]["message"])
    assert "FactQA.observe raised TypeError" in message and task.where("observe") in message


def test_an_item_without_a_field_the_task_reads_is_said_as_such_not_as_the_users_bug(task, saved_team, capsys):
    # FactQA.observe reads item['fact']: free text has none. That is the input's fault, said in the input's terms.
    assert main(["generate", str(saved_team), "--text", "a fact"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--text: {task.name}:FactQA needs items with the field 'fact'" in err
    assert "free text will not do" in err
