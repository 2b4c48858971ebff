"""teamrl export: what it writes loads with plain transformers/peft and answers token for token as teamrl does."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from teamrl.cli import main
from teamrl.config import config_from_dict
from teamrl.export import CARD_TAGS, ExportError, export_team
from teamrl.rollout.generate import generate_team
from teamrl.team import Team
from teamrl.train import Trainer

# Loads every export of a case with transformers and peft alone, in a fresh interpreter that never imports
# teamrl, and answers each observation greedily; also runs the team card's own snippet.
PLAIN_LOADER = r'''
import json, sys
import torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

cases = json.loads(open(sys.argv[1]).read())
results = {}
for case in cases:
    out = case["out"]
    tokens, texts, base_tokens = [], [], []
    for agent in case["agents"]:
        path = f"{out}/{agent['name']}"
        tokenizer = AutoTokenizer.from_pretrained(path)
        if case["adapters"]:
            model = AutoPeftModelForCausalLM.from_pretrained(path)
            # The same adapter on the base loaded by hand, as PeftModel users do.
            config = json.load(open(f"{path}/adapter_config.json"))
            by_hand = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
                                                path)
        else:
            model = by_hand = AutoModelForCausalLM.from_pretrained(path)
        settings = GenerationConfig.from_pretrained(path)
        settings.do_sample = False  # greedy, as teamrl's top_k=1 below
        agent_tokens = []
        for observation, expected_prompt in zip(agent["observations"], agent["prompts"]):
            if agent["chat"]:
                messages = [{"role": "system", "content": agent["system_prompt"]}] if agent["system_prompt"] else []
                messages.append({"role": "user", "content": observation})
                prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            else:
                prompt = f"{agent['system_prompt']}\n\n{observation}" if agent["system_prompt"] else observation
            assert prompt == expected_prompt, (prompt, expected_prompt)
            inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=not agent["chat"])
            start = inputs["input_ids"].shape[1]
            answers = [m.generate(**inputs, generation_config=settings)[0, start:].tolist() for m in (model, by_hand)]
            assert answers[0] == answers[1], answers
            agent_tokens.append(answers[0])
            if case["adapters"]:
                with model.disable_adapter():
                    base_tokens.append(model.generate(**inputs, generation_config=settings)[0, start:].tolist())
        tokens.append(agent_tokens)
    results[out] = {"tokens": tokens, "base_tokens": base_tokens}
    if case["run_card"]:
        card = open(f"{out}/README.md").read()
        snippet = card.split("```python\n")[-1].split("\n```")[0]
        namespace = {}
        exec(snippet, namespace)  # it samples and prints the team's answer to its example item
        results[out]["card_texts"] = [namespace["answer"](*agent, observation, do_sample=False)
                                      for agent, observation in zip(namespace["AGENTS"], namespace["observations"])]
assert not any(name == "teamrl" or name.startswith("teamrl.") for name in sys.modules)
print(json.dumps(results))
'''


def _train_one_step(run_dir: Path, training: str) -> Path:
    """A tiny digit_sum team trained for one step and saved as training saves it (RUN_DIR/team). LoRA adapters
    are then drawn far from zero, so that an export that loses an adapter answers differently."""
    config = config_from_dict({
        "env": {"name": "digit_sum", "kwargs": {"targets": [3, 9, 14], "length": 4}},
        "team": {"model": "tiny", "training": training, "sampling": {"max_new_tokens": 6},
                 "agents": [{"name": "first"}, {"name": "second"}]},
        "algorithm": {"num_generations": 4}, "optim": {"lr": 3e-3}, "steps": 1, "items_per_step": 2, "seed": 0,
        "run_dir": str(run_dir), "logging": {"progress_bar": False}, "checkpoint": {"save_every": 0},
        "eval": {"every_steps": 0},
    })
    with Trainer(config) as trainer:
        trainer.train()
        if training == "lora":
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for agent in trainer.team:
                    for parameter in agent.parameters:
                        parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        return trainer.save_team()


@pytest.fixture(scope="module")
def saved_teams(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teams")
    return {training: _train_one_step(root / training, training) for training in ("lora", "full")}


@pytest.fixture(scope="module")
def exports(saved_teams, tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("exports")
    return {(training, format): export_team(team_dir, root / f"{training}-{format}", format=format)
            for training, team_dir in saved_teams.items() for format in ("peft", "merged")}


def _greedy_team(team_dir: Path, observations: list[list[str]]) -> tuple[Team, list[list[list[int]]], list]:
    """teamrl's own greedy answers (top_k=1) of a saved team: per agent, per observation, the completion's tokens
    up to and including the first end token."""
    team = Team.from_pretrained(team_dir)
    for agent in team:
        agent.sampling = dataclasses.replace(agent.sampling, top_k=1)
    generations = generate_team(team, team.prompts([list(column) for column in zip(*observations)]), 1)
    tokens = [[row[mask.bool()].tolist() for row, mask in zip(g.completion_ids, g.completion_mask)]
              for g in generations]
    return team, tokens, [g.texts for g in generations]


def test_every_export_loads_with_plain_transformers_and_peft_and_answers_as_the_team_does(saved_teams, exports,
                                                                                          tmp_path):
    from teamrl.envs.base import rebuild_env

    env = rebuild_env(json.loads((saved_teams["lora"] / "team.json").read_text())["env"])
    # input-major, one observation per agent; one input per target
    observations = [list(obs) for obs in dict.fromkeys(tuple(env.observe(item)) for item in env.items("eval"))]
    assert len(observations) == 3
    cases, expected = [], {}
    for (training, format), out in exports.items():
        team, tokens, texts = _greedy_team(saved_teams[training], observations)
        expected[str(out)] = (tokens, texts)
        adapters = training == "lora" and format == "peft"
        # The team card's snippet runs for both of the model classes it may use (each load costs a second).
        run_card = (training, format) in (("lora", "peft"), ("full", "merged"))
        cases.append({"out": str(out), "adapters": adapters, "run_card": run_card, "agents": [
            {"name": agent.name, "system_prompt": agent.system_prompt, "chat": agent.uses_chat_template,
             "observations": [obs[i] for obs in observations],
             "prompts": [agent.prompt(obs[i]) for obs in observations]}
            for i, agent in enumerate(team)]})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = tmp_path / "plain_loader.py"
    script.write_text(PLAIN_LOADER)
    result = subprocess.run([sys.executable, str(script), str(tmp_path / "cases.json")], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.splitlines()[-1])
    for out, (tokens, texts) in expected.items():
        assert answers[out]["tokens"] == tokens, out
        if "card_texts" in answers[out]:  # the card's snippet answers its example item, the first, as the team does
            assert answers[out]["card_texts"] == [agent_texts[0] for agent_texts in texts], out
    lora_peft = answers[str(exports["lora", "peft"])]
    assert lora_peft["base_tokens"] != [t for agent_tokens in lora_peft["tokens"] for t in agent_tokens]


def _front_matter(readme: Path) -> dict:
    text = readme.read_text()
    assert text.startswith("---\n"), readme
    return yaml.safe_load(text.split("---\n")[1])


def test_each_agent_folder_is_a_repo_push_to_hub_takes(exports):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    for (training, format), out in exports.items():
        folders = [out / "first", out / "second"] + ([out / "base"] if (training, format) == ("lora", "peft") else [])
        assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "team.json", *(f.name for f in folders)])
        for folder in folders:
            files = {p.name for p in folder.iterdir()}
            assert not any(name.startswith(".") for name in files), folder
            adapter = folder.name != "base" and training == "lora" and format == "peft"
            weights = "adapter_model.safetensors" if adapter else "model.safetensors"
            config = "adapter_config.json" if adapter else "config.json"
            assert {"README.md", config, weights, "tokenizer.json", "tokenizer_config.json"} <= files, folder
            card = huggingface_hub.ModelCard.load(folder / "README.md")  # the hub's own parser
            assert card.data.library_name == ("peft" if adapter else "transformers")
            assert set(CARD_TAGS) <= set(card.data.tags)
            assert _front_matter(folder / "README.md")["tags"] == card.data.tags
            if folder.name != "base":
                settings = json.loads((folder / "generation_config.json").read_text())
                assert (settings["max_new_tokens"], settings["do_sample"], settings["eos_token_id"]) == (6, True, 1)
        assert set(CARD_TAGS) <= set(huggingface_hub.ModelCard.load(out / "README.md").data.tags)


def test_team_card_names_roles_task_reward_and_training(exports, saved_teams):
    card = (exports["lora", "peft"] / "README.md").read_text()
    manifest = json.loads((saved_teams["lora"] / "team.json").read_text())
    for agent in manifest["agents"]:
        assert agent["system_prompt"] in card
    assert "digit_sum" in card and '"targets"' in card and "joint_reward" in card
    assert "algorithm: `magrpo`; training steps: 1; seed: 0" in card
    assert "training joint reward" in card and "config.yaml" in card
    assert "AutoPeftModelForCausalLM" in card
    assert "AutoPeftModelForCausalLM" not in (exports["lora", "merged"] / "README.md").read_text()


def test_the_team_card_describes_the_task_in_the_users_words_not_teamrls_internals(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "facts.jsonl").write_text("".join(f'{{"fact": "fact {i}"}}\n' for i in range(6)))
    module = f"card_rewards_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text('def score(completions, item):\n    """Both agents name the fact\'s\n'
                                           '    number, ``exactly``."""\n    return 0.0\n')
    config = config_from_dict({
        "env": {"name": "dataset", "kwargs": {"data": "facts.jsonl", "prompts": ["ask {fact}", "say {fact}"],
                                              "reward": f"{module}:score", "eval_split": 2}},
        "team": {"model": "tiny", "training": "full", "sampling": {"max_new_tokens": 2},
                 "agents": [{"name": "first"}, {"name": "second"}]},
        "algorithm": {"num_generations": 2}, "steps": 1, "run_dir": str(tmp_path / "run"),
        "logging": {"progress_bar": False}, "eval": {"every_steps": 0}})
    with Trainer(config) as trainer:
        card = (export_team(trainer.save_team(), tmp_path / "out", format="merged") / "README.md").read_text()
    assert ("`DatasetTask`: A task from a dataset, a prompt template per agent and a reward function (no class to "
            "write).") in card
    assert (f"the task's reward function `{module}:score` of the agents' outputs in seat order (at most 1.0 a turn): "
            f"Both agents name the fact's number, `exactly`.") in card
    assert "teamrl.envs.checks" not in card and ":mod:" not in card


def test_peft_adapters_name_their_base_by_absolute_path_or_exactly_the_base_path_given(saved_teams, exports,
                                                                                       tmp_path):
    base = exports["lora", "peft"] / "base"
    for name in ("first", "second"):
        config = json.loads((exports["lora", "peft"] / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(base.absolute())
    out = export_team(saved_teams["lora"], tmp_path / "pushed", base_path="someone/tiny-base")
    for name in ("first", "second"):
        config = json.loads((out / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "someone/tiny-base"
        assert _front_matter(out / name / "README.md")["base_model"] == "someone/tiny-base"
    assert (out / "base" / "model.safetensors").is_file()  # still written: it is what gets pushed there


def test_an_export_is_itself_a_team_teamrl_loads(saved_teams, exports):
    observations = [["target 9 first", "target 9 second"], ["target 3 first", "target 3 second"]]
    _, expected, _ = _greedy_team(saved_teams["lora"], observations)
    for format in ("peft", "merged"):
        manifest = json.loads((exports["lora", format] / "team.json").read_text())
        assert manifest["export"]["format"] == format
        assert _greedy_team(exports["lora", format], observations)[1] == expected


def test_the_base_and_agent_folders_sample_as_trained_whatever_the_hub_config_said(saved_teams, tmp_path,
                                                                                   monkeypatch):
    """``vllm serve OUT/base`` fills a request's missing sampling fields from base/generation_config.json, and plain
    generate() samples with an agent's: both hold the trained sampling, not the hub model's (here Qwen2.5-Instruct's
    repetition_penalty and top_k, Qwen3's top_p and temperature)."""
    from transformers import GenerationConfig

    import teamrl.export

    load_base = teamrl.export._load_base

    def hub_like_base(*args):
        model, tokenizer = load_base(*args)
        model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20, min_p=0.05,
                                       repetition_penalty=1.05)
        return model, tokenizer

    monkeypatch.setattr(teamrl.export, "_load_base", hub_like_base)
    out = export_team(saved_teams["lora"], tmp_path / "out")
    trained = json.loads((saved_teams["lora"] / "team.json").read_text())["agents"][0]["sampling"]
    for folder in ("base", "first", "second"):
        settings = GenerationConfig.from_pretrained(out / folder)
        assert (settings.temperature, settings.top_p, settings.top_k, settings.max_new_tokens) == (
            trained["temperature"], trained["top_p"], trained["top_k"], trained["max_new_tokens"]), folder
        assert settings.repetition_penalty == 1.0 and not settings.min_p, folder
    assert "the agents' sampling settings" in (out / "base" / "README.md").read_text()


def test_saved_adapters_name_their_base_the_same_way(tmp_path):
    from peft import AutoPeftModelForCausalLM

    from teamrl.envs import DigitSumGame
    from teamrl.models.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(DigitSumGame().vocabulary(), seed=1)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    config = config_from_dict({"team": {"model": str(tmp_path / "base"), "training": "lora",
                                        "agents": [{"name": "a"}, {"name": "b"}]}})
    root = Team.from_config(config.team, DigitSumGame(), seed=0).save_pretrained(tmp_path / "team")
    for name in ("a", "b"):  # PEFT itself names the base for the first adapter only
        saved = json.loads((root / name / "adapter_config.json").read_text())
        assert saved["base_model_name_or_path"] == str((tmp_path / "base").absolute())
        AutoPeftModelForCausalLM.from_pretrained(root / name)  # no hub, no teamrl


def _cli_error(capsys, *argv: str) -> str:
    assert main(["export", *argv]) == 2
    message = capsys.readouterr().err
    assert message.startswith("teamrl: error: ") and message.count("\n") == 1, message
    return message


def test_one_line_errors(saved_teams, exports, tmp_path, capsys):
    team = str(saved_teams["lora"])
    assert "is not a saved team (no team.json)" in _cli_error(capsys, str(tmp_path), "--out", str(tmp_path / "x"))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert "exists and is not empty" in _cli_error(capsys, team, "--out", str(tmp_path / "busy"))
    assert "not a teamrl export" in _cli_error(capsys, team, "--out", str(tmp_path / "busy"), "--overwrite")
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    assert "holds the team" in _cli_error(capsys, team, "--out", str(saved_teams["lora"].parent), "--overwrite")
    assert "--base-path" in _cli_error(capsys, team, "--out", str(tmp_path / "m"), "--format", "merged",
                                       "--base-path", "someone/base")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("first", "second"):
        (broken / name).symlink_to(saved_teams["lora"] / name)
    manifest = json.loads((saved_teams["lora"] / "team.json").read_text())
    for agent in manifest["agents"]:
        agent["base_model"] = str(tmp_path / "no-such-model")
    (broken / "team.json").write_text(json.dumps(manifest))
    message = _cli_error(capsys, str(broken), "--out", str(tmp_path / "y"))
    assert "base model cannot be loaded" in message and "no-such-model" in message
    assert not (tmp_path / "y").exists() and not list(tmp_path.glob(".y.export-*"))  # nothing half-written


def test_overwrite_replaces_an_earlier_export(saved_teams, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(saved_teams["full"]), "--out", str(out), "--format", "merged"]) == 0
    assert "model card:" in capsys.readouterr().out
    with pytest.raises(ExportError, match="--overwrite"):
        export_team(saved_teams["full"], out)
    export_team(saved_teams["lora"], out, overwrite=True)
    assert json.loads((out / "team.json").read_text())["export"]["format"] == "peft"
    assert (out / "base").is_dir()
