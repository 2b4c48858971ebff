"""Production is the same endpoint: `teamrl serve RUN/team` answers a program's calls with the trained agents, under
the names it called them by in training, so the program runs unchanged against it."""

from __future__ import annotations

import json
import textwrap
import uuid

import pytest

openai = pytest.importorskip("openai")

APP = '''
import os

from openai import OpenAI


def run(item, base_url):
    client = OpenAI(base_url=base_url, api_key=os.environ.get("APP_KEY", "-"), max_retries=0, timeout=60)
    plan = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": item["topic"]}],
                                          stop=["zzz"]).choices[0].message.content
    text = client.completions.create(model="writer", prompt="write " + plan, max_tokens=3).choices[0].text
    return float(len(text.split()) <= 3)
'''


@pytest.fixture(scope="module")
def program_team(tmp_path_factory):
    """(the program's module, a team trained on it for one step and saved as RUN/team)."""
    import sys

    from teamrl.config import config_from_dict
    from teamrl.train import Trainer

    root = tmp_path_factory.mktemp("program_team")
    module = f"served_app_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text(textwrap.dedent(APP))
    (root / "items.jsonl").write_text("".join(json.dumps({"topic": f"plan {n} write"}) + "\n" for n in range(6)))
    sys.path.insert(0, str(root))
    try:
        config = config_from_dict({
            "env": {"name": "program", "kwargs": {"program": f"{module}:run", "data": str(root / "items.jsonl"),
                                                  "eval_split": 2}},
            "team": {"model": "tiny", "training": "lora", "sampling": {"max_new_tokens": 4},
                     "agents": [{"name": "planner"}, {"name": "writer"}]},
            "algorithm": {"num_generations": 2}, "steps": 1, "items_per_step": 1, "run_dir": str(root / "run"),
            "logging": {"progress_bar": False}, "checkpoint": {"save_every": 0}, "eval": {"every_steps": 0}})
        with Trainer(config) as trainer:
            trainer.train_step()
            trainer.save_team()
        yield sys.modules[module], root / "run" / "team"
    finally:
        sys.path.remove(str(root))


def test_the_served_team_answers_the_unchanged_program_under_its_agents_names(program_team, live_server, monkeypatch):
    from teamrl.serve.engine import ServedTeam

    app, team_dir = program_team
    served = ServedTeam.load(team_dir)
    assert served.model_ids() == ["run/planner", "run/writer", "planner", "writer"]  # no team id: a program's team
    for batching in ("window", "continuous"):
        url, _ = live_server(served, api_key="sesame", batching=batching)
        monkeypatch.setenv("APP_KEY", "sesame")
        assert app.run({"id": "x", "topic": "plan 1 write"}, f"{url}/v1") == 1.0
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="model 'run' does not exist"):
            client.chat.completions.create(model="run", messages=[{"role": "user", "content": "plan"}])
