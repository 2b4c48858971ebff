"""teamrl eval of a program task: the trained program against the same program on its untrained team and on one model
answering every agent's calls, each behind a gateway of its own, scored by the program's own reward."""

from __future__ import annotations

import json
import textwrap
import uuid

import pytest

from teamrl.cli import main

pytest.importorskip("openai")

APP = '''
from openai import OpenAI


def run(item, base_url):
    client = OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)
    plan = client.chat.completions.create(model="planner", messages=[{"role": "user", "content": item["topic"]}])
    text = client.chat.completions.create(model="writer", messages=[
        {"role": "user", "content": plan.choices[0].message.content}]).choices[0].message.content
    return {"good": float(text.split().count("good")), "length": 0.1 * len(text.split())}
'''


@pytest.fixture
def program_config(tmp_path, tiny_config_data, monkeypatch):
    import yaml

    module = f"eval_app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(APP))
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"topic": f"good plan {n}"}) + "\n" for n in range(8)))
    data = tiny_config_data(
        env={"name": "program", "kwargs": {"program": f"{module}:run", "data": "items.jsonl", "eval_split": 3,
                                           "words": ["good"]}},
        team={"model": "tiny", "training": "lora", "sampling": {"max_new_tokens": 4},
              "agents": [{"name": "planner"}, {"name": "writer"}]},
        algorithm={"num_generations": 2}, steps=1, items_per_step=1, run_dir=str(tmp_path / "run"))
    config = tmp_path / "app.yaml"
    config.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    return config


@pytest.mark.slow
def test_the_trained_program_is_compared_with_its_untrained_team_and_one_model(program_config, tmp_path, capsys):
    assert main(["train", str(program_config)]) == 0
    out = tmp_path / "eval"
    assert main(["eval", str(program_config), "--methods", f"team:{tmp_path / 'run' / 'team'},concat,single",
                 "--num-samples", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    methods = {method["method"].split(":")[0]: method for method in results["methods"]}
    assert set(methods) == {"team", "concat", "single"}
    for method in methods.values():
        metrics = method["metrics"]
        assert metrics["calls/planner"] == 1 and metrics["calls/writer"] == 1 and "level/good" in metrics
        assert len(method["samples"]) == 3 * 2  # the 3 held-out items x 2 episodes
        sample = method["samples"][0]
        assert [call["agent"] for call in sample["calls"]] == ["planner", "writer"]
        assert sample["actions"] == [call["text"] for call in sample["calls"]]
    assert "one model answering every agent's calls" in (out / "results.md").read_text()


def test_pipelines_a_program_does_not_have_are_refused_in_one_line(program_config, capsys):
    assert main(["eval", str(program_config), "--methods", "concat,sequential"]) == 2
    error = capsys.readouterr().err.strip()
    assert "--methods: sequential: program is a program, which decides itself who sees what" in error
    assert "\n" not in error
