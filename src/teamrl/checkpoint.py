"""Atomic checkpoints: a run killed at any moment resumes from its last complete checkpoint.

A checkpoint is a directory ``checkpoints/step_000123`` holding, per agent, its trained parameters
(the adapter, or the whole model) and optimiser and scheduler state, plus the RNG states and the step.
It is written under a temporary name, every file fsync'd, then renamed into place in one step, so a
directory with the final name is always complete; ``latest`` names the newest one and is replaced the
same way.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from teamrl.team import Team

LATEST = "latest"


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    team: Team,
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    extra: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint for ``step`` atomically and prune all but the ``keep_last`` newest."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for agent, optimizer, scheduler in zip(team, optimizers, schedulers):
        names = _parameter_names(agent)
        save_file({names[id(p)]: p.detach().contiguous().cpu() for p in agent.parameters},
                  str(tmp / f"{agent.name}.safetensors"))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
                   tmp / f"{agent.name}.optim.pt")
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state(),
         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        tmp / "rng.pt",
    )
    (tmp / "state.json").write_text(json.dumps({"step": step, **(extra or {})}))
    for file in tmp.iterdir():
        _fsync(file)
    if final.exists():  # a checkpoint of this step from a run that was killed after writing it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    _atomic_write(root / LATEST, final.name)
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.json").is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / "state.json").is_file())
    return complete[-1] if complete else None


def load_checkpoint(
    path: str | Path, team: Team, optimizers: list[torch.optim.Optimizer], schedulers: list[Any]
) -> dict[str, Any]:
    """Restore parameters, optimiser, scheduler and RNG states; returns the saved state (with ``step``)."""
    path = Path(path)
    for agent, optimizer, scheduler in zip(team, optimizers, schedulers):
        tensors = load_file(str(path / f"{agent.name}.safetensors"))
        names = _parameter_names(agent)
        if set(tensors) != set(names.values()):
            raise ValueError(f"checkpoint {path} does not match agent {agent.name!r}'s parameters; "
                             "was it written by a run with another team config?")
        with torch.no_grad():
            for p in agent.parameters:
                p.copy_(tensors[names[id(p)]])
        state = torch.load(path / f"{agent.name}.optim.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.random.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "state.json").read_text())


def _parameter_names(agent) -> dict[int, str]:
    trained = {id(p) for p in agent.parameters}
    return {id(p): name for name, p in agent.model.named_parameters() if id(p) in trained}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)
