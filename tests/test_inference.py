"""Saved teams load back and run decentralised: each agent on its own prompt, concurrently."""

from __future__ import annotations

import pytest
import torch

from teamrl.inference import run_team
from teamrl.rollout.generate import generate
from teamrl.team import Team
from teamrl.train import Trainer


@pytest.mark.parametrize("training", ["lora", "full"])
def test_saved_team_reloads_with_identical_policies(tiny_config, tmp_path, training):
    trainer = Trainer(tiny_config(steps=2, team={"training": training}))
    for _ in range(2):
        trainer.train_step()
    directory = trainer.save_team(tmp_path / "team")
    loaded = Team.from_pretrained(directory)
    ids = trainer.team[0].tokenizer("target 9 first", return_tensors="pt").input_ids
    for original, reloaded in zip(trainer.team, loaded):
        assert reloaded.name == original.name and reloaded.sampling == original.sampling
        original.activate()
        reloaded.activate()
        with torch.no_grad():
            torch.testing.assert_close(reloaded.model(input_ids=ids).logits, original.model(input_ids=ids).logits)


def test_shared_base_agents_generate_in_one_mixed_batch_like_separately(tiny_config):
    trainer = Trainer(tiny_config(steps=1, team={"training": "lora", "sampling": {"max_new_tokens": 4,
                                                                                  "temperature": 1e-3}}))
    with torch.no_grad():
        for agent in trainer.team:  # make the two adapters differ so routing matters
            for p in agent.parameters:
                p.normal_(0, 0.5)
    observations = [trainer.env.observe(item) for item in trainer.env.items("eval")[:3]]
    together = run_team(trainer.team, observations)
    for i, agent in enumerate(trainer.team):
        alone = generate(agent, [agent.prompt(obs[i]) for obs in observations], 1)
        assert together.texts[i] == alone.texts  # near-greedy: the same completions
    assert together.texts[0] != together.texts[1]
    assert together.tokens > 0 and together.seconds > 0


def test_teamrl_generate_runs_a_saved_team(tiny_config, tmp_path, capsys):
    # In this process; tests/test_cli.py runs `python -m teamrl.cli generate` in a process of its own.
    trainer = Trainer(tiny_config(steps=1))
    trainer.train_step()
    directory = trainer.save_team(tmp_path / "team")
    capsys.readouterr()  # what saving printed
    code, out, err = _generate(capsys, str(directory), "--split", "eval", "--limit", "2")
    assert code == 0, err
    assert out.count("joint reward") == 2
    assert "tokens/s" in out and "--- first" in out and "--- second" in out


def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    from teamrl.cli import main

    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_refuses_an_input_longer_than_the_context(tiny_config, tmp_path, capsys):
    # A writing team, as `teamrl demo` saves one, on the tiny model (a 256-token context, one token a word).
    directory = Trainer(tiny_config(env={"name": "tldr", "kwargs": {}})).save_team(tmp_path / "team")
    capsys.readouterr()  # what saving printed
    code, out, err = _generate(capsys, str(directory), "--text", "We propose a method that learns.")
    assert code == 0, err
    assert out.count("joint reward") == 1
    code, out, err = _generate(capsys, str(directory), "--text", "word " * 2_000)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("teamrl: error: --text 1: ") and "context of 256 tokens" in err and "shorten" in err


def test_generate_text_on_a_task_that_takes_no_text_says_what_it_takes(tiny_config, tmp_path, capsys):
    directory = Trainer(tiny_config(steps=1)).save_team(tmp_path / "team")  # the README's smoke team: digit_sum
    capsys.readouterr()  # what saving printed
    code, out, err = _generate(capsys, str(directory), "--text", "hello")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--text: digit_sum" in err and "'target'" in err and "--split eval" in err and "--input-file" in err


def test_run_team_texts_are_agent_major_with_each_inputs_samples_in_consecutive_rows(tiny_config):
    # observations[input][agent] in, texts[agent][input * num_samples + sample] out (run_team's docstring).
    trainer = Trainer(tiny_config(steps=1, env={"kwargs": {"targets": [2, 9, 13, 17]}},
                                  team={"training": "lora", "sampling": {"max_new_tokens": 4, "temperature": 1e-6}}))
    with torch.no_grad():
        for agent in trainer.team:
            for p in agent.parameters:
                p.normal_(0, 0.5)
    observations = [trainer.env.observe(item) for item in trainer.env.items("eval")[:3]]  # three targets
    output = run_team(trainer.team, observations, num_samples=2)
    assert len(output.texts) == len(trainer.team)
    for i, agent in enumerate(trainer.team):
        alone = generate(agent, [agent.prompt(obs[i]) for obs in observations], 2).texts
        assert output.texts[i] == alone  # agent i's own completions, in generate's order...
        # ...which, greedy in effect, shows each input's two samples side by side, the inputs' answers differing
        assert alone[0::2] == alone[1::2] and len(set(alone)) == len(observations)
