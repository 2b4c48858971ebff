"""The run directory nothing can corrupt: one training at a time, no silent overwrite, no resume from
nothing, problems found before a model loads, and a signal that stops at a step with a checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from teamrl.cli import main


def _config_file(make_data, tmp_path: Path, run_dir: Path, **overrides) -> Path:
    data = make_data(**{"steps": 2, "items_per_step": 1, "algorithm": {"num_generations": 2},
                        "run_dir": str(run_dir), **overrides})
    path = tmp_path / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _background_training(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "teamrl.cli", "train", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_steps(process: subprocess.Popen, run_dir: Path, steps: int) -> None:
    deadline = time.monotonic() + 240
    while len(_metric_steps(run_dir)) < steps and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the training ended early:\n" + process.communicate()[1]
    assert len(_metric_steps(run_dir)) >= steps, "the training made no progress in 240 s"


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything loads a model: run_dir problems must be found before that."""
    from teamrl.team import Team

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the run directory was checked")

    monkeypatch.setattr(Team, "from_config", refuse)


def test_a_second_training_is_refused_naming_the_first_until_the_first_dies(tmp_path, tiny_config_data, capsys,
                                                                              no_model_load):
    run_dir = tmp_path / "run"
    config = _config_file(tiny_config_data, tmp_path, run_dir, steps=100_000)
    first = _background_training(config)
    try:
        _wait_for_steps(first, run_dir, 1)
        # Even --overwrite must not take a directory another training is writing.
        code, out, err = _cli(capsys, "train", str(config), "--overwrite")
        assert code == 2 and out == ""
        assert err.startswith("teamrl: error: run_dir: ") and err.count("\n") == 1, err
        assert "in use by another training" in err
        assert f"pid {first.pid} on {socket.gethostname()}" in err and f"train {config}" in err
        steps = _metric_steps(run_dir)
        assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved lines
    finally:
        first.kill()  # SIGKILL: the lock must not outlive its process
        first.wait()
    code, out, err = _cli(capsys, "train", str(config))
    assert code == 2 and "in use" not in err and "already holds a run" in err  # past the lock, at the next check


def test_an_existing_run_is_kept_unless_overwrite_is_given(tmp_path, tiny_config_data, capsys):
    run_dir = tmp_path / "run"
    config = _config_file(tiny_config_data, tmp_path, run_dir, steps=3,
                          checkpoint={"save_every": 1, "keep_last": 2})
    assert main(["train", str(config)]) == 0
    capsys.readouterr()
    files = ["metrics.jsonl", "config.yaml", "team/team.json", "checkpoints/latest",
             "checkpoints/step_000003/first.safetensors"]
    before = {name: (run_dir / name).read_bytes() for name in files}

    code, out, err = _cli(capsys, "train", str(config), "steps=1")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "already holds a run" in err and "--resume" in err and "--overwrite" in err
    assert {name: (run_dir / name).read_bytes() for name in files} == before

    # Replaced on request: the earlier run's checkpoints are gone, so none outranks or outlives the new ones.
    code, out, err = _cli(capsys, "train", str(config), "--overwrite", "steps=1")  # overrides may follow flags
    assert code == 0, err
    assert _metric_steps(run_dir) == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000001"


@pytest.mark.parametrize("layout", ["missing", "no checkpoint"])
def test_resume_with_nothing_to_resume_is_an_error(tmp_path, tiny_config_data, capsys, no_model_load, layout):
    run_dir = tmp_path / "mistyped"
    if layout == "no checkpoint":  # a run killed before its first checkpoint
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    config = _config_file(tiny_config_data, tmp_path, run_dir)
    code, out, err = _cli(capsys, "train", str(config), "--resume")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"run_dir: nothing to resume: '{run_dir}'" in err
    assert run_dir.exists() == (layout == "no checkpoint")  # a mistyped directory is not created


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody can write in, root included (root ignores permission bits, not the immutable flag)."""
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    immutable = False
    if os.access(path, os.W_OK):
        immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("cannot make a read-only directory here (running as root, no chattr)")
    yield path
    if immutable:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    path.chmod(0o755)


@pytest.mark.parametrize("problem, message", [
    ("a file", "is a file, not a directory"),
    ("under a file", "cannot create"),
    ("read-only", "cannot write in"),
])
def test_run_dir_problems_are_reported_before_the_model_loads(tmp_path, tiny_config_data, capsys, no_model_load,
                                                              request, problem, message):
    if problem == "a file":
        run_dir = tmp_path / "run"
        run_dir.write_text("not a directory")
    elif problem == "under a file":
        (tmp_path / "file").write_text("")
        run_dir = tmp_path / "file" / "run"
    else:
        run_dir = request.getfixturevalue("read_only_dir")
    config = _config_file(tiny_config_data, tmp_path, run_dir)
    code, out, err = _cli(capsys, "train", str(config))
    assert code == 2 and out == ""
    assert err.startswith("teamrl: error: run_dir: ") and message in err and str(run_dir) in err
    assert err.count("\n") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_and_the_resume_command(tmp_path, tiny_config_data,
                                                                                    capsys, signum):
    run_dir = tmp_path / "run"
    config = _config_file(tiny_config_data, tmp_path, run_dir, steps=100_000, checkpoint={"save_every": 0})
    process = _background_training(config)
    _wait_for_steps(process, run_dir, 2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    assert "Traceback" not in err
    steps = _metric_steps(run_dir)
    last = steps[-1]
    assert steps == list(range(1, last + 1))
    assert (run_dir / "checkpoints" / f"step_{last:06d}" / "state.json").is_file()  # the step it stopped at
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{last:06d}"
    command = re.search(r"resume with: teamrl train (\S+) --resume", err)
    assert command, err
    assert Path(command.group(1)) == run_dir / "config.yaml"

    # The printed command, one step further (in this process: the signal above needed a process of its own).
    code, out, err = _cli(capsys, "train", command.group(1), f"steps={last + 1}", "--resume")
    assert code == 0, err
    assert _metric_steps(run_dir) == list(range(1, last + 2))  # continued from the step it stopped at


def test_held_out_evaluations_and_the_reward_curve_are_a_runs_outputs(tmp_path):
    from teamrl.run_dir import RunDirError, claim_run_dir, clear_run_outputs

    kept = tmp_path / "notes.txt"  # not a run's: overwrite leaves it
    for path in (tmp_path / "eval.jsonl", tmp_path / "reward_curve.png", kept):
        path.write_text("")
    with pytest.raises(RunDirError, match=r"already holds a run \(eval.jsonl, reward_curve.png\)"):
        claim_run_dir(tmp_path)
    claim_run_dir(tmp_path, overwrite=True).release()
    clear_run_outputs(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == [".lock", "notes.txt"]


def test_run_dir_advice_is_in_the_callers_terms(tmp_path, tiny_config, tiny_config_data, capsys, no_model_load):
    # Python's caller sets the Trainer's arguments, the command line's passes flags: each is told its own.
    from teamrl.run_dir import RunDirError
    from teamrl.train import Trainer

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000001" / "state.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError) as existing:
        Trainer(tiny_config(run_dir=str(run_dir)))
    assert (f"continue it with Trainer(load_config({str(run_dir / 'config.yaml')!r}), resume=True), replace it "
            f"with Trainer(config, overwrite=True), or choose another run_dir") in str(existing.value)
    missing = tmp_path / "mistyped"
    with pytest.raises(RunDirError) as nothing:
        Trainer(tiny_config(run_dir=str(missing)), resume=True)
    assert str(nothing.value).endswith("start a new run with Trainer(config, resume=False)")
    assert "--" not in str(existing.value) + str(nothing.value)

    code, out, err = _cli(capsys, "train", str(_config_file(tiny_config_data, tmp_path, run_dir)))
    assert code == 2 and f"continue it with teamrl train {run_dir / 'config.yaml'} --resume, replace it with " \
                          f"--overwrite, or choose another run_dir" in err
    code, out, err = _cli(capsys, "train", str(_config_file(tiny_config_data, tmp_path, missing)), "--resume")
    assert code == 2 and err.rstrip().endswith("start a new run without --resume")
    assert "Trainer(" not in err
