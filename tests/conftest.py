"""Shared fixtures: tiny configs that train in seconds on a laptop CPU."""

from __future__ import annotations

import json
import os
import textwrap
import uuid

import pytest
import torch
import yaml

from teamrl.config import config_from_dict


def tiny_config_dict(tmp_path, **overrides) -> dict:
    """A digit_sum run with two tiny random agents; ``overrides`` replace top-level sections/fields."""
    data = {
        "env": {"name": "digit_sum", "kwargs": {"targets": [9], "length": 4}},
        "team": {"model": "tiny", "training": "full", "sampling": {"max_new_tokens": 4},
                 "agents": [{"name": "first"}, {"name": "second"}]},
        "algorithm": {"num_generations": 8},
        "optim": {"lr": 3e-3},
        "steps": 60,
        "items_per_step": 4,
        "seed": 0,
        "run_dir": str(tmp_path / "run"),
        "logging": {"progress_bar": False, "sample_every": 10},
        "checkpoint": {"save_every": 0},
        # Held-out evaluation during training has tests of its own (tests/test_train_eval.py); off here, the
        # other tests train only what they check.
        "eval": {"every_steps": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


@pytest.fixture
def tiny_config_data(tmp_path):
    """Factory: ``tiny_config_data(steps=...)`` -> plain config data (for YAML files)."""

    def make(**overrides):
        return tiny_config_dict(tmp_path, **overrides)

    return make


@pytest.fixture
def tiny_config(tmp_path):
    """Factory: ``tiny_config(algorithm={...}, steps=...)`` -> validated TrainConfig."""

    def make(**overrides):
        return config_from_dict(tiny_config_dict(tmp_path, **overrides))

    return make


@pytest.fixture
def lora_team(tiny_config):
    """Factory: ``lora_team(scale=0.3, **team)`` -> a tiny two-agent LoRA team on one base whose adapters
    differ (drawn from N(0, scale)), so that a row run through the wrong adapter shows."""
    from teamrl.train import Trainer

    def make(scale: float = 0.3, **team):
        trainer = Trainer(tiny_config(steps=1, team={"training": "lora", **team}))
        trainer.close()
        with torch.no_grad():
            for agent in trainer.team:
                for p in agent.parameters:
                    p.normal_(0, scale)
        return trainer.team

    return make


class TrainAndEvaluate:
    """``train_and_evaluate(config, stop_at=None, keys=("reward/mean",))`` -> (held-out reward before, after, every
    step's metrics): a learning test's run between two evaluations of 4 samples per held-out item. It trains
    ``config.steps`` steps, or, given ``stop_at``, stops earlier once the training reward has converged: once the
    mean of each of ``keys`` over the last 5 steps is at least ``stop_at``. ``.trainer``: the last run's trainer.

    ``stop_at`` is a training-reward level above what the test then asks of the held-out evaluation, which
    draws its own samples: a run that gets there has learned; one that never does trains the full
    ``config.steps`` and is judged the same way."""

    trainer = None

    def __call__(self, config, stop_at: float | None = None, keys=("reward/mean",)):
        from teamrl.train import Trainer

        with Trainer(config) as trainer:
            self.trainer = trainer
            before = trainer.evaluate(num_samples=4)["reward/mean"]
            history = []
            while len(history) < config.steps and not (stop_at is not None and converged(history, keys, stop_at)):
                history.append(trainer.train_step())
            return before, trainer.evaluate(num_samples=4)["reward/mean"], history


@pytest.fixture
def train_and_evaluate():
    return TrainAndEvaluate()


def converged(history: list[dict], keys, level: float, window: int = 5) -> bool:
    """Whether each of ``keys`` averages at least ``level`` over the last ``window`` steps of ``history``."""
    return len(history) >= window and all(sum(h[key] for h in history[-window:]) / window >= level for key in keys)


@pytest.fixture(autouse=True)
def _restore_environ():
    # teamrl.cli.main, called in-process by some tests, sets the libraries' quiet settings in os.environ;
    # they must not reach later tests' subprocesses (teamrl --verbose would find them set).
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _two_threads():
    # The CI machine has 2 cores; more threads only add contention.
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def _idle_machine(monkeypatch):
    # The command line warns, on stderr, when other work keeps the machine busy (teamrl.runtime): what tests
    # print must not depend on what else the machine runs. tests/test_runtime.py sets the load it needs.
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))



class ServeProcess:
    """``teamrl serve ARGV --port 0`` in a subprocess (from ``cwd``): :attr:`url` once it listens (:meth:`start`),
    :meth:`chat` to ask it, :meth:`stop` to send SIGTERM (its exit status and stderr)."""

    def __init__(self, argv: list[str], cwd=None):
        import subprocess
        import sys

        self.process = subprocess.Popen([sys.executable, "-m", "teamrl.cli", "serve", *argv, "--port", "0"],
                                        cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url = ""

    def start(self, timeout: float = 180) -> ServeProcess:
        import select

        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        assert " on http://127.0.0.1:" in line, f"teamrl serve printed {line!r}; stderr: {self.stop()[1]}"
        self.url = line.split(" on ")[1].strip().removesuffix("/v1")
        return self

    def chat(self, model: str, content: str, timeout: float = 120) -> dict:
        """POST one user message to /v1/chat/completions; the JSON answer (an HTTP error raises)."""
        import json
        import urllib.request

        request = urllib.request.Request(f"{self.url}/v1/chat/completions", method="POST", data=json.dumps(
            {"model": model, "messages": [{"role": "user", "content": content}]}).encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)

    def stop(self) -> tuple[int, str]:
        import signal
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        return code, self.process.stderr.read()


@pytest.fixture
def teamrl_server():
    """Factory: ``teamrl_server(argv, cwd=None)`` -> a started :class:`ServeProcess` of ``teamrl serve ARGV --port
    0``. After the test every server gets SIGTERM and must exit 0."""
    servers: list[ServeProcess] = []

    def start(argv: list[str], cwd=None) -> ServeProcess:
        servers.append(ServeProcess(argv, cwd))
        return servers[-1].start()

    yield start
    for server in servers:
        code, stderr = server.stop()
        assert code == 0, stderr


@pytest.fixture(autouse=True)
def _own_search_folders(monkeypatch):
    """Each test starts with the import search folders it found (a config file's folder is added when it loads):
    one CLI process reads one config, and a test's messages should not list the folders of every test before it."""
    from teamrl import imports

    monkeypatch.setattr(imports, "_search_folders", list(imports._search_folders))


# A program task's project (tests/test_program_training.py, tests/rollout/test_vllm_continuous.py)
APP = '''
from openai import OpenAI

TARGET = "good"


def run(item, base_url):
    """A planner -> writer pipeline: the writer reads the planner's plan; the reward counts the target word."""
    client = OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)
    plan = client.chat.completions.create(model="planner", messages=[
        {"role": "user", "content": "plan " + item["topic"]}]).choices[0].message.content
    text = client.chat.completions.create(model="writer", messages=[
        {"role": "user", "content": "write " + plan}]).choices[0].message.content
    planned, written = plan.split(), text.split()
    return {"plan": planned.count(TARGET) / max(len(planned), 1), "text": written.count(TARGET) / max(len(written), 1)}


def broken(item, base_url):
    client = OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)
    client.chat.completions.create(model="planner", messages=[{"role": "user", "content": item["topic"]}])
    raise KeyError("summary")
'''


@pytest.fixture
def program_project(tmp_path, tiny_config_data):
    """(config file, module name): a program beside its config and data, as docs/programs.md lays one out."""
    module = f"my_app_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / f"{module}.py").write_text(textwrap.dedent(APP))
    topics = ["good bad", "bad plan", "write good", "plan bad good", "bad", "good good bad", "plan", "write bad"]
    (folder / "items.jsonl").write_text("".join(json.dumps({"topic": t}) + "\n" for t in topics * 3))
    data = tiny_config_data(
        env={"name": "program", "kwargs": {"program": f"{module}:run", "data": "items.jsonl", "eval_split": 4,
                                           "words": ["good", "bad", "plan", "write"]}},
        team={"model": "tiny", "training": "lora", "sampling": {"max_new_tokens": 6},
              "agents": [{"name": "planner"}, {"name": "writer"}]},
        algorithm={"num_generations": 4}, optim={"lr": 0.02}, steps=2, items_per_step=1,
        eval={"every_steps": 2, "items": 2, "samples": 2}, logging={"progress_bar": False, "sample_every": 1},
        run_dir=str(tmp_path / "run"))
    config = folder / "app.yaml"
    config.write_text(yaml.safe_dump(data))
    return config, module
