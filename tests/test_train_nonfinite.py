"""A bad reward loses nothing: a non-finite reward, or an update whose gradients are not finite, stops training
before the optimiser step that would use it; every checkpoint on disk stays finite and loads, and the message
names the step, the task's method, the item and the value, and how to resume."""

from __future__ import annotations

import math
import shlex

import pytest
import torch
import yaml

from teamrl.checkpoint import load_checkpoint
from teamrl.cli import main
from teamrl.envs.base import ENVIRONMENTS
from teamrl.envs.digit_sum import DigitSumGame
from teamrl.rewards.base import RewardResult
from teamrl.rollout.tree import sample_tree
from teamrl.run_dir import complete_checkpoints
from teamrl.train import Trainer, batch_indices

AGENTS = ["first", "second"]


class FactQA(DigitSumGame):
    """A user's task whose reward is NaN on the items in ``poisoned``."""

    poisoned: set[str] = set()

    def joint_reward(self, item, actions, history=()):
        if item["id"] in self.poisoned:
            return RewardResult(math.nan)
        return super().joint_reward(item, actions, history)


def _first_item_of_step(step: int, items_per_step: int = 2, seed: int = 0) -> str:
    """The id of the first item training sees at ``step`` (1-based)."""
    return f"train-{batch_indices(64, items_per_step, step - 1, seed)[0]}"


#: Four steps of FactQA, a checkpoint after each, the newest two kept.
RUN = {"env": {"name": "fact_qa", "kwargs": {"targets": [9], "length": 4}}, "steps": 4, "items_per_step": 2,
       "algorithm": {"num_generations": 4}, "checkpoint": {"save_every": 1, "keep_last": 2}}


def _assert_every_checkpoint_finite_and_loadable(run_dir) -> list[str]:
    names = []
    for checkpoint in complete_checkpoints(run_dir):
        states, _ = load_checkpoint(checkpoint, AGENTS)
        for name, state in states.items():
            assert all(torch.isfinite(value).all() for value in state.parameters.values()), (checkpoint, name)
        names.append(checkpoint.name)
    return sorted(names)


@pytest.fixture
def fact_qa(monkeypatch):
    monkeypatch.setitem(ENVIRONMENTS, "fact_qa", FactQA)
    return FactQA


def test_a_nan_reward_at_step_3_stops_the_cli_run_and_its_resume_command_continues_it(
        fact_qa, tiny_config_data, tmp_path, monkeypatch, capsys):
    bad_item = _first_item_of_step(3)
    monkeypatch.setattr(fact_qa, "poisoned", {bad_item})
    data = tiny_config_data(**RUN)
    config = tmp_path / "fact_qa.yaml"
    config.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"

    assert main(["train", str(config)]) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("teamrl: error: ")]
    assert len(errors) == 1, stderr  # one line (other lines may warn of a busy machine)
    error = errors[0]
    assert "step 3 of 4" in error and "FactQA.joint_reward" in error and repr(bad_item) in error and "nan" in error
    assert "step_000002" in error and "is kept" in error
    # Step 3 never updated: the two kept checkpoints are steps 1 and 2, finite, and they load.
    assert _assert_every_checkpoint_finite_and_loadable(run_dir) == ["step_000001", "step_000002"]
    assert not (run_dir / "team").exists()

    command = shlex.split(error.split("resume with: ")[1])
    assert command[:2] == ["teamrl", "train"] and command[-1] == "--resume"
    monkeypatch.setattr(fact_qa, "poisoned", set())  # the user fixes the reward
    assert main(command[1:]) == 0
    assert _assert_every_checkpoint_finite_and_loadable(run_dir) == ["step_000003", "step_000004"]
    assert (run_dir / "team" / "team.json").is_file()


def test_a_nan_reward_at_step_1_says_no_checkpoint_was_written(fact_qa, tiny_config, monkeypatch):
    monkeypatch.setattr(fact_qa, "poisoned", {_first_item_of_step(1)})
    config = tiny_config(**RUN)
    with Trainer(config) as trainer, pytest.raises(ValueError, match="no checkpoint was written yet") as info:
        trainer.train()
    assert "step 1 of 4" in str(info.value) and "FactQA.joint_reward" in str(info.value)
    assert complete_checkpoints(config.run_dir) == []


def test_an_update_whose_gradients_are_not_finite_is_not_applied_and_stops_the_run(tiny_config):
    # At this learning rate the first step throws the weights so far that the second one's gradients are NaN.
    config = tiny_config(**{**RUN, "env": {"name": "digit_sum", "kwargs": {"targets": [9], "length": 4}}},
                         optim={"lr": 1e30})
    with Trainer(config) as trainer, pytest.raises(ValueError) as info:
        trainer.train()
    message = str(info.value)
    assert "step 2 of 4" in message and "gradient" in message and "step_000001" in message, message
    assert "resume with: " in message
    assert _assert_every_checkpoint_finite_and_loadable(config.run_dir) == ["step_000001"]
    # The NaN gradients never reached the weights.
    assert all(torch.isfinite(p).all() for agent in trainer.team for p in agent.parameters)


@pytest.mark.parametrize("fast_update", [True, False])
def test_either_update_path_refuses_an_optimiser_step_on_non_finite_gradients(tiny_config, fast_update):
    with Trainer(tiny_config(steps=1, optim={"fast_update": fast_update})) as trainer:

        tree = sample_tree(trainer.agents.sample, trainer.env, trainer.items[:2], trainer.config.algorithm)
        generations = [[turn.generations[i] for turn in tree.turns] for i in range(2)]
        advantages = [[torch.full((gen.completion_ids.shape[0],), math.inf) for gen in per_agent]
                      for per_agent in generations]
        before = [p.detach().clone() for agent in trainer.team for p in agent.parameters]
        with pytest.raises(ValueError, match="first.*gradient.*not finite"):
            trainer.agents.update(generations, advantages, [0, 1])
        after = [p.detach() for agent in trainer.team for p in agent.parameters]
        assert all(torch.equal(b, a) for b, a in zip(before, after))
