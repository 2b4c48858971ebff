"""A user's own task through the CLI: a class in a module beside the config, by module:Class, trained,
saved with what actually ran, and run again by `teamrl generate` from another folder."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid

import pytest
import yaml

from teamrl.cli import main
from teamrl.envs.base import Environment
from teamrl.rewards.base import RewardResult

# A user's task as docs/environments.md teaches it: no vocabulary(), items without ids.
TASK = '''
from teamrl import Environment, RewardResult

class FactQA(Environment):
    num_agents = 2
    roles = ("You ask a question about the fact.", "You answer it.")

    def __init__(self, num_facts=6):
        facts = [{"fact": f"fact {i} is {i * 3}", "answer": str(i * 3)} for i in range(num_facts)]
        self.splits = {"train": facts[2:], "eval": facts[:2]}

    def observe(self, item):
        return [f"ask about {item['fact']}", f"answer about {item['fact']}"]

    def joint_reward(self, item, actions, history=()):
        return RewardResult(float(item["answer"] in actions[1]))
'''


@pytest.fixture
def user_task(tmp_path, tiny_config_data):
    """(config file, module name): FactQA in a module beside the config, named env.name=module:FactQA."""
    module = f"fact_tasks_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"{module}.py").write_text(TASK)
    data = tiny_config_data(steps=2, env={"name": f"{module}:FactQA", "kwargs": {"num_facts": 5}},
                            algorithm={"num_generations": 2}, run_dir=str(tmp_path / "run"))
    config = folder / "my.yaml"
    config.write_text(yaml.safe_dump(data))
    return config, module


def test_train_and_generate_a_task_of_ones_own_through_the_cli(user_task, tmp_path, monkeypatch, capsys):
    config, module = user_task
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # neither the config's folder nor the module's
    assert main(["train", str(config)]) == 0
    team = tmp_path / "run" / "team"
    manifest = json.loads((team / "team.json").read_text())
    assert manifest["env"] == {"name": f"{module}:FactQA", "kwargs": {"num_facts": 5},
                               "folders": [str(config.parent.resolve())]}
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(sample["item"].startswith("train-") for line in samples for sample in line["samples"])
    capsys.readouterr()
    assert main(["generate", str(team), "--split", "eval", "--limit", "2"]) == 0
    out = capsys.readouterr().out
    assert "=== eval-0" in out and "=== eval-1" in out  # FactQA's items, with ids teamrl gave them


def test_the_saved_team_records_the_environment_object_the_trainer_was_given(tiny_config, tmp_path, monkeypatch):
    module = f"fact_tasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    fact_qa = __import__(module).FactQA
    from teamrl.team import Team
    from teamrl.train import Trainer

    with Trainer(tiny_config(steps=1, algorithm={"num_generations": 2}), env=fact_qa(num_facts=4)) as trainer:
        trainer.train()
        team_dir = trainer.save_team()
    manifest = json.loads((team_dir / "team.json").read_text())
    assert manifest["env"]["name"] == f"{module}:FactQA" and manifest["env"]["kwargs"] == {"num_facts": 4}
    # Rebuilt on the task it was trained on (the config said digit_sum): the tiny base has FactQA's words.
    team = Team.from_pretrained(team_dir)
    assert "fact" in team.agents[0].tokenizer.get_vocab()


def test_a_task_defined_where_no_process_can_import_it_is_said_before_training(tiny_config, caplog, capsys):
    class LocalTask(Environment):
        num_agents = 2

        def __init__(self):
            self.splits = {"train": [{"x": "a b"}], "eval": [{"x": "a b"}]}

        def observe(self, item):
            return [item["x"], item["x"]]

        def joint_reward(self, item, actions, history=()):
            return RewardResult(0.0)

    from teamrl.train import Trainer

    with caplog.at_level(logging.WARNING, logger="teamrl.train"):
        trainer = Trainer(tiny_config(steps=1, algorithm={"num_generations": 2}), env=LocalTask())
    assert "will not be able to rebuild its task" in caplog.text and "LocalTask" in caplog.text
    with trainer:
        trainer.train()
        team_dir = trainer.save_team()
    assert main(["generate", str(team_dir), "--split", "eval"]) == 2
    assert "cannot be built again" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# A run and its team, used from any folder: what a new process needs to rebuild the task is written down


DECORATED = TASK.replace("from teamrl import Environment, RewardResult",
                         "from teamrl import Environment, RewardResult, register_env").replace(
    "class FactQA(", '@register_env("NAME")\nclass FactQA(')
FACTS = [{"fact": f"fact {i} is {i * 3}"} for i in range(6)]
REWARD = "def score(completions, item):\n    return float(item['fact'].split()[-1] in completions[1])\n"


@pytest.fixture
def project(tmp_path, tiny_config_data):
    """A user's folder: a task class registered by name (@register_env) and a dataset task (data file and reward
    module), each with a config whose run_dir and data are relative, as docs/environments.md writes them."""
    folder = tmp_path / "project"
    folder.mkdir()
    tag = uuid.uuid4().hex[:8]
    (folder / f"fact_tasks_{tag}.py").write_text(DECORATED.replace("NAME", f"fact_qa_{tag}"))
    (folder / f"qa_rewards_{tag}.py").write_text(REWARD)
    (folder / "facts.jsonl").write_text("".join(json.dumps(fact) + "\n" for fact in FACTS))
    envs = {"class": {"name": f"fact_tasks_{tag}:FactQA", "kwargs": {"num_facts": 5}},
            "dataset": {"name": "dataset", "kwargs": {
                "data": "facts.jsonl", "eval_split": 2, "reward": f"qa_rewards_{tag}:score",
                "prompts": ["ask about {fact}", "answer about {fact}"]}}}
    for name, env in envs.items():
        data = tiny_config_data(steps=2, env=env, algorithm={"num_generations": 2}, run_dir=f"runs/{name}",
                                checkpoint={"save_every": 1})
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return folder, tag


def _train_in(folder, monkeypatch, *configs: str) -> None:
    monkeypatch.chdir(folder)
    for config in configs:
        assert main(["train", config]) == 0


def test_a_registered_class_is_recorded_by_its_module_and_folder(project, monkeypatch):
    folder, tag = project
    _train_in(folder, monkeypatch, "class.yaml")
    manifest = json.loads((folder / "runs" / "class" / "team" / "team.json").read_text())
    # Not the registered name: a new process knows it only once the module is imported.
    assert manifest["env"] == {"name": f"fact_tasks_{tag}:FactQA", "kwargs": {"num_facts": 5},
                               "folders": [str(folder.resolve())]}


def test_the_runs_config_holds_absolute_paths_and_its_run_follows_it_when_moved(project, tmp_path, monkeypatch,
                                                                                capsys):
    from teamrl.config import load_config

    folder, tag = project
    _train_in(folder, monkeypatch, "dataset.yaml")
    run = folder / "runs" / "dataset"
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["run_dir"] == str(run.absolute())
    assert written["env"]["kwargs"]["data"] == str(folder / "facts.jsonl")
    assert written["env"]["folders"] == [str(folder.resolve())]  # where qa_rewards_TAG.py is imported from
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    run.rename(moved)
    monkeypatch.chdir(moved.parent)
    assert load_config("moved/config.yaml").run_dir == "moved"  # the run is where its config is now
    assert load_config("moved/config.yaml", ["run_dir=other"]).run_dir == "other"  # unless overridden
    capsys.readouterr()
    assert main(["train", "moved/config.yaml", "steps=3", "--resume"]) == 0, capsys.readouterr().err
    assert [json.loads(line)["step"] for line in (moved / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


@pytest.mark.slow
def test_generate_eval_serve_and_resume_work_in_new_processes_from_another_folder(project, tmp_path, monkeypatch,
                                                                                   teamrl_server):
    """What the saved team and the run's config.yaml record is enough for a new process in another folder: for a
    class registered by name and for the dataset task, moved to another folder after training."""
    folder, tag = project
    _train_in(folder, monkeypatch, "class.yaml", "dataset.yaml")
    moved = tmp_path / "moved-dataset"
    (folder / "runs" / "dataset").rename(moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    def teamrl(*argv) -> str:
        done = subprocess.run([sys.executable, "-m", "teamrl.cli", *map(str, argv)], cwd=elsewhere,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"teamrl {' '.join(map(str, argv))}: {done.stderr}"
        return done.stdout

    for run, item in ((folder / "runs" / "class", {"fact": "fact 7 is 21", "answer": "21"}),
                      (moved, {"fact": "fact 7 is 21"})):
        assert "=== eval-" in teamrl("generate", run / "team", "--split", "eval", "--limit", "1")
        teamrl("eval", run / "config.yaml", "--methods", f"concat,team:{run / 'team'}", "--max-items", "1")
        assert (run / "eval" / "results.md").is_file()  # RUN_DIR/eval: the run where its config.yaml is now
        server = teamrl_server([str(run / "team")], cwd=elsewhere)
        answer = server.chat(run.name, json.dumps(item))
        assert len(answer["choices"][0]["message"]["agent_outputs"]) == 2
    teamrl("train", moved / "config.yaml", "steps=3", "--resume")
    assert json.loads((moved / "team" / "team.json").read_text())["step"] == 3
