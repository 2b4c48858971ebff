"""Atomic checkpoints: a run killed at any moment resumes from its last complete checkpoint.

A checkpoint is a directory ``checkpoints/step_000123`` holding, per agent, its trained parameters
(the adapter, or the whole model) and optimiser and scheduler state, plus the RNG states and the step.
It is written under a temporary name, every file fsync'd, then renamed into place in one step, so a
directory with the final name is always complete; ``latest`` names the newest one and is replaced the
same way. Checkpoints are ordered by their step number, never by name.

The writer and the reader deal in :class:`AgentState` (plain CPU tensors and state dicts), not in live
agents, so a driver can checkpoint agents that live in other processes or on other machines
(:mod:`teamrl.backends.ray`) in the same format.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from teamrl.run_dir import CHECKPOINT_PREFIX, CHECKPOINTS_DIR, checkpoint_step, complete_checkpoints
from teamrl.team import Agent

LATEST = "latest"


class CheckpointUnreadable(ValueError):
    """A complete checkpoint's files cannot be read back (truncated or damaged after it was written)."""


class NonFiniteWeights(ValueError):
    """Weights about to be saved hold a NaN or an infinity: nothing was written (writing them would only
    replace, or prune, the good ones)."""


@dataclass
class AgentState:
    """What a checkpoint keeps of one agent, on the CPU."""

    parameters: dict[str, torch.Tensor]
    """The trained parameters (the adapter, or the whole model) by their name in the agent's model."""
    optim: dict[str, Any]
    """``{"optimizer": ..., "scheduler": ...}`` state dicts."""


def agent_state(agent: Agent, optimizer: torch.optim.Optimizer, scheduler: Any) -> AgentState:
    """``agent``'s trained parameters and optimiser and scheduler state, on the CPU. CPU tensors are not
    copied: write or send the state before the next update changes them."""
    names = parameter_names(agent)
    return AgentState(
        parameters={names[id(p)]: p.detach().contiguous().cpu() for p in agent.parameters},
        optim=_to_cpu({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}),
    )


def restore_agent_state(agent: Agent, optimizer: torch.optim.Optimizer, scheduler: Any, state: AgentState,
                        source: str | Path,
                        place: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Load ``state`` (read from checkpoint ``source``) into a live agent, its optimiser and scheduler.

    ``place(saved, live)``: a saved full tensor as the live parameter holds it (its rank's shard under FSDP,
    :mod:`teamrl.backends.fsdp`); the optimiser's per-parameter tensors are placed the same way."""
    names = parameter_names(agent)
    if set(state.parameters) != set(names.values()):
        raise ValueError(f"checkpoint {source} does not match agent {agent.name!r}'s parameters; "
                         "was it written by a run with another team config?")
    with torch.no_grad():
        for p in agent.parameters:
            saved = state.parameters[names[id(p)]]
            p.copy_(saved if place is None else place(saved, p))
    optimizer.load_state_dict(state.optim["optimizer"])
    if place is not None:
        for p in agent.parameters:  # load_state_dict made the moments plain tensors of the full shape
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim() > 0:
                    optimizer.state[p][key] = place(value, p)
    scheduler.load_state_dict(state.optim["scheduler"])


def non_finite_parameters(agents: dict[str, AgentState]) -> list[str]:
    """``'agent' parameter`` of every floating-point parameter in ``agents`` (states by name) that holds a NaN
    or an infinity."""
    return [f"{name!r} {key}" for name, state in agents.items() for key, value in state.parameters.items()
            if value.is_floating_point() and not bool(torch.isfinite(value).all())]


def require_finite(agents: dict[str, AgentState], what: str) -> None:
    """Raise :class:`NonFiniteWeights` (``what`` names what was not saved) unless every parameter of
    ``agents`` is finite."""
    bad = non_finite_parameters(agents)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NonFiniteWeights(f"{what} not written: the weights of {shown} are not finite (NaN or inf)")


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    agents: dict[str, AgentState],
    extra: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> Path:
    """Write the checkpoint for ``step`` (``agents``: each agent's state by name) atomically and prune all
    but the ``keep_last`` newest (by step).

    Non-finite weights are refused before anything is written or pruned, so every checkpoint on disk is
    finite, and pruning, which only follows a checkpoint written, keeps that newest good one.

    Raises:
        NonFiniteWeights: a parameter holds a NaN or an infinity.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / f"{CHECKPOINT_PREFIX}{step:06d}"
    require_finite(agents, f"checkpoint {final}")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, state in agents.items():
        save_file(state.parameters, str(tmp / f"{name}.safetensors"))
        torch.save(state.optim, tmp / f"{name}.optim.pt")
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
    for old in complete_checkpoints(run_dir)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def discard_checkpoints_after(run_dir: str | Path, step: int) -> list[Path]:
    """Remove the run's checkpoints of steps after ``step`` and point ``latest`` at ``step``'s; returns what
    was removed. A run resumed from ``step`` redoes those steps, and a newer checkpoint left in place
    would outrank the new ones when pruning."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    newer = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*")
             if p.name.removeprefix(CHECKPOINT_PREFIX).isdigit() and checkpoint_step(p) > step]
    for path in newer:
        shutil.rmtree(path)
    _atomic_write(root / LATEST, f"{CHECKPOINT_PREFIX}{step:06d}")
    return newer


def load_checkpoint(path: str | Path, names: Sequence[str]) -> tuple[dict[str, AgentState], dict[str, Any]]:
    """The states of agents ``names`` and the saved state (with ``step``); restores this process's RNG states.

    Raises:
        CheckpointUnreadable: a file of the checkpoint is missing, truncated or damaged (nothing is
            restored then).
    """
    path = Path(path)
    try:
        agents = {name: AgentState(load_file(str(path / f"{name}.safetensors")),
                                   torch.load(path / f"{name}.optim.pt", weights_only=False))
                  for name in names}
        rng = torch.load(path / "rng.pt", weights_only=False)
        state = json.loads((path / "state.json").read_text())
    except Exception as err:  # safetensors, zip, pickle and JSON each fail on damage in their own way
        raise CheckpointUnreadable(f"checkpoint {path} cannot be read ({type(err).__name__}: {err})") from err
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.random.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return agents, state


def parameter_names(agent) -> dict[int, str]:
    """The name in ``agent``'s model of each parameter it trains, by the parameter's ``id``."""
    trained = {id(p) for p in agent.parameters}
    return {id(p): name for name, p in agent.model.named_parameters() if id(p) in trained}


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor inside its dicts, lists and tuples on the CPU (a no-op for CPU tensors)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


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
