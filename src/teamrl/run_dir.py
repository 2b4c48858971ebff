"""The run directory: what a training run writes where, and who may write it.

One training at a time holds a run directory: :meth:`RunDirLock.acquire` takes an exclusive ``flock`` on
``RUN_DIR/.lock`` and writes the holder's pid, host and command into it, so a second run is refused with
a line that names the first. The kernel drops the lock when its process dies, however it dies, so a
lock left by a killed run never blocks the next one. :func:`claim_run_dir` adds the checks a run needs
before it loads any model: the directory can be created and written, an existing run is only replaced
when asked to (``overwrite``), and ``resume`` has a checkpoint to resume from.

This module imports neither torch nor transformers: the checks must cost nothing next to a model load.
"""

from __future__ import annotations

import contextvars
import copy
import datetime
import fcntl
import functools
import json
import os
import shlex
import shutil
import socket
import sys
import weakref
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
EVAL_FILE = "eval.jsonl"
CURVE_FILE = "reward_curve.png"
CHECKPOINTS_DIR = "checkpoints"
TEAM_DIR = "team"
TENSORBOARD_DIR = "tensorboard"
LOCK_FILE = ".lock"
#: Everything a training run writes into its run directory: their presence means the directory holds a
#: run, and ``overwrite`` removes exactly these (never anything else a user keeps there).
RUN_OUTPUTS = (CONFIG_FILE, METRICS_FILE, SAMPLES_FILE, EVAL_FILE, CURVE_FILE, CHECKPOINTS_DIR, TEAM_DIR,
               TENSORBOARD_DIR)
CHECKPOINT_PREFIX = "step_"


class RunDirError(ValueError):
    """The run directory cannot be used as asked. The message names it and says what to do instead."""


def checkpoint_step(path: Path) -> int:
    """The step of checkpoint directory ``path`` (``step_000123`` -> 123)."""
    return int(path.name.removeprefix(CHECKPOINT_PREFIX))


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints (renamed into place, so ``state.json`` is there), newest step first.

    Ordered by step number, not by name: a name sorts wrong past six digits.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.name.removeprefix(CHECKPOINT_PREFIX).isdigit()
             and (p / "state.json").is_file()]
    return sorted(found, key=checkpoint_step, reverse=True)


def read_records(path: str | Path) -> list[dict]:
    """The records (JSON objects) of one of a run's JSON-lines files, in order; none where the file is missing.
    A line that does not decode is skipped: a run killed while appending leaves its last line torn."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def resume_command(run_dir: str | Path) -> str:
    """The command that continues the run in ``run_dir`` from its newest checkpoint, from any folder. The run's
    own ``config.yaml`` (written when training starts, :func:`run_config`) holds every setting, overrides
    included."""
    return f"teamrl train {shlex.quote(str(Path(run_dir).absolute() / CONFIG_FILE))} --resume"


def is_run_config(file: Path) -> bool:
    """Whether ``file`` is a run's own ``config.yaml``: named so, in a folder that holds the run's metrics or
    checkpoints. Its run is that folder, wherever the run directory has been moved since."""
    return file.name == CONFIG_FILE and any((file.parent / name).exists() for name in (METRICS_FILE, CHECKPOINTS_DIR))


#: Config fields that name a model (``team.agents[i].model`` too): a local path among them is written absolute.
MODEL_FIELDS = (("team", "model"), ("algorithm", "critic", "model"), ("algorithm", "reward_model", "model"))


def run_config(data: dict, run_dir: str | Path, task: dict | None = None) -> dict:
    """The run's ``config.yaml`` (``data``: the config as plain data), which resumes and evaluates the run from any
    working directory: ``run_dir`` and local model paths absolute, and ``env`` the task that runs (``task``, its
    :func:`~teamrl.envs.base.env_record`: data files absolute, with the folders of the user's modules), not a
    relative path or a module only the starting folder had."""
    data = copy.deepcopy(data)
    data["run_dir"] = str(Path(run_dir).absolute())
    if task is not None and "unavailable" not in task:
        data["env"] = {"name": task["name"], "kwargs": task.get("kwargs", {}), "folders": task.get("folders", [])}
    for agent in data["team"]["agents"]:
        agent["model"] = _absolute_model(agent["model"])
    for *sections, name in MODEL_FIELDS:
        section = functools.reduce(dict.__getitem__, sections, data)
        section[name] = _absolute_model(section[name])
    return data


def _absolute_model(spec: str | None) -> str | None:
    """``spec`` as an absolute path when it names a local file or folder (not 'tiny' or 'bundled'), else as it is."""
    if not spec or spec == "tiny" or spec.partition(":")[0] == "bundled" or not Path(spec).expanduser().exists():
        return spec
    return str(Path(spec).expanduser().absolute())


#: Whether the advice of run-directory messages names the ``teamrl`` command's flags (set by ``teamrl.cli.main``
#: while a command runs) or, by default, the :class:`~teamrl.train.Trainer`'s arguments of the Python API.
ADVISE_FLAGS: contextvars.ContextVar[bool] = contextvars.ContextVar("teamrl_advise_flags", default=False)


def how_to_resume(run_dir: str | Path) -> str:
    """What continues the run in ``run_dir``, as its caller would do it: :func:`resume_command` on the command
    line, the Trainer of the run's own ``config.yaml`` in Python."""
    if ADVISE_FLAGS.get():
        return resume_command(run_dir)
    return f"Trainer(load_config({str(Path(run_dir) / CONFIG_FILE)!r}), resume=True)"


def ask_for(option: str, value: bool = True) -> str:
    """How the caller sets ``option`` (``resume`` or ``overwrite``) to ``value``, after a verb ("replace it
    with --overwrite"): the flag on the command line, the Trainer's argument in Python."""
    if ADVISE_FLAGS.get():
        return f"with --{option}" if value else f"without --{option}"
    return f"with Trainer(config, {option}={value})"


class RunDirLock:
    """A hold on a run directory that keeps other processes out until :meth:`release` or until this process
    ends. Holds on one directory within this process share one ``flock`` (a process cannot lock out itself:
    two Trainers of one session may build on one run directory); it is let go with the last of them."""

    def __init__(self, run_dir: Path, flock: _Flock):
        self.run_dir = run_dir
        self._flock: _Flock | None = flock

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunDirLock:
        """Hold ``run_dir`` (which must exist) or raise :class:`RunDirError` naming the process that holds it."""
        run_dir = Path(run_dir)
        key = run_dir.resolve()
        flock = _HELD.get(key)
        if flock is None:
            flock = _HELD[key] = _Flock.take(run_dir)
        return cls(run_dir, flock)

    def release(self) -> None:
        """Let go of the directory (idempotent); other processes may take it once no hold of this one is left."""
        self._flock = None  # the last reference gone, _Flock's finalizer unlocks


class _Flock:
    """This process's ``flock`` on a run directory's lock file; unlocked when no :class:`RunDirLock` refers to it."""

    def __init__(self, fd: int):
        weakref.finalize(self, _unlock, fd)

    @classmethod
    def take(cls, run_dir: Path) -> _Flock:
        path = run_dir / LOCK_FILE
        try:
            # No O_TRUNC: the current holder's record must survive a contender's open().
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirError(f"run_dir: cannot write in {str(run_dir)!r} ({err.strerror}); choose a writable "
                              f"directory (run_dir=PATH)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(f"run_dir: {str(run_dir)!r} is in use by another training ({_holder(path)}); wait "
                              f"for it to end or stop it, or choose another run_dir") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": shlex.join(sys.argv),
                  "since": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(fd)


#: The run directories this process holds, by resolved path.
_HELD: weakref.WeakValueDictionary[Path, _Flock] = weakref.WeakValueDictionary()


def _unlock(fd: int) -> None:
    os.ftruncate(fd, 0)  # nobody holds the directory now: the record would only mislead a reader
    os.close(fd)  # closing the descriptor drops the flock


def _holder(lock_path: Path) -> str:
    """Who holds the lock, from the record its holder wrote (empty while the holder is still writing it)."""
    try:
        record = json.loads(lock_path.read_text())
        return f"pid {record['pid']} on {record['host']}, since {record['since']}: {record['command']}"
    except (OSError, ValueError, KeyError, TypeError):  # no record yet, or not one this module wrote
        return "a process that has not said which yet"


def run_outputs(run_dir: Path) -> list[str]:
    """The run outputs (:data:`RUN_OUTPUTS`) present in ``run_dir``."""
    return [name for name in RUN_OUTPUTS if (run_dir / name).exists()]


def claim_run_dir(run_dir: str | Path, *, resume: bool = False, overwrite: bool = False) -> RunDirLock:
    """Check that a training may write into ``run_dir`` as asked and hold it; raise :class:`RunDirError`
    with one line saying why not and what to do otherwise.

    ``resume``: continue the run there, which needs a complete checkpoint. ``overwrite``: replace the run
    there (the caller removes it with :func:`clear_run_outputs` once it is ready to start). Neither: the
    directory must hold no run, so an earlier run is never lost by mistake.
    """
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("resume and overwrite: choose one (continue the run, or replace it)")
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir: {str(run_dir)!r} is a file, not a directory; choose another run_dir")
    if resume and not complete_checkpoints(run_dir):
        where = "does not exist" if not run_dir.exists() else "has no complete checkpoint"
        raise RunDirError(f"run_dir: nothing to resume: {str(run_dir)!r} {where}; check run_dir, or start a new "
                          f"run {ask_for('resume', False)}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"run_dir: cannot create {str(run_dir)!r} ({err.strerror}); choose a writable "
                          f"location (run_dir=PATH)") from None
    lock = RunDirLock.acquire(run_dir)
    found = run_outputs(run_dir)
    if found and not (resume or overwrite):
        lock.release()
        # The resume command, not a bare --resume: `teamrl demo` has none, and the run's config.yaml has
        # every setting of the run, whatever command started it.
        resumable = f"continue it with {how_to_resume(run_dir)}, " if complete_checkpoints(run_dir) else ""
        raise RunDirError(f"run_dir: {str(run_dir)!r} already holds a run ({', '.join(found)}); {resumable}"
                          f"replace it {ask_for('overwrite')}, or choose another run_dir")
    return lock


def clear_run_outputs(run_dir: str | Path) -> None:
    """Remove an earlier run's outputs from ``run_dir`` (what ``overwrite`` replaces)."""
    for name in run_outputs(Path(run_dir)):
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
