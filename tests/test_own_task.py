"""A user's own task through the CLI: a class in a module beside the config, by module:Class, trained,
saved with what actually ran, and run again by `teamrl generate` from another folder."""

from __future__ import annotations

import json
import logging
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
