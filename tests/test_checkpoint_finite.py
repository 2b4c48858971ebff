"""Checkpoints and saved teams never hold non-finite weights: saving them is refused before anything is
written, so pruning (``checkpoint.keep_last``) never deletes the newest good checkpoint to make room."""

from __future__ import annotations

import math

import pytest
import torch

from teamrl.checkpoint import AgentState, load_checkpoint, save_checkpoint
from teamrl.run_dir import complete_checkpoints
from teamrl.train import Trainer


def _state(value: float) -> dict[str, AgentState]:
    return {"first": AgentState({"layer.weight": torch.full((2, 2), value), "layer.steps": torch.tensor([3])},
                                {"optimizer": {}, "scheduler": {}})}


@pytest.mark.parametrize(("bad", "keep_last"), [(math.nan, 1), (math.inf, 1), (math.nan, 2)])
def test_a_checkpoint_of_non_finite_weights_is_refused_and_the_good_ones_are_kept(tmp_path, bad, keep_last):
    for step in (1, 2):
        save_checkpoint(tmp_path, step, _state(float(step)), keep_last=keep_last)
    kept = [path.name for path in complete_checkpoints(tmp_path)]
    assert kept == ["step_000002", "step_000001"][:keep_last]
    with pytest.raises(ValueError, match=r"step_000003.*'first'.*layer\.weight.*not finite") as info:
        save_checkpoint(tmp_path, 3, _state(bad), keep_last=keep_last)
    assert "\n" not in str(info.value)
    # Nothing written, nothing pruned: with keep_last=1 a NaN step 3 would otherwise have deleted step 2.
    assert [path.name for path in complete_checkpoints(tmp_path)] == kept
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    states, state = load_checkpoint(tmp_path / "checkpoints" / "step_000002", ["first"])
    assert state["step"] == 2 and torch.equal(states["first"].parameters["layer.weight"], torch.full((2, 2), 2.0))


def test_a_team_with_non_finite_weights_is_not_saved(tiny_config, tmp_path):
    with Trainer(tiny_config(steps=1)) as trainer:
        with torch.no_grad():
            trainer.team[1].parameters[0].view(-1)[0] = math.nan
        with pytest.raises(ValueError, match="'second'.*not finite"):
            trainer.save_team(tmp_path / "team")
    assert not (tmp_path / "team").exists()
