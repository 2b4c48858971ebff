"""Checkpoints: a run killed with SIGKILL resumes from its last checkpoint and ends exactly like an
uninterrupted run; `teamrl train` leaves metrics, samples, checkpoints and a saved team."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

STEPS = 24
SAVE_EVERY = 4


def _write_config(make_data, tmp_path: Path, name: str) -> Path:
    data = make_data(steps=STEPS, items_per_step=2, algorithm={"num_generations": 4},
                            checkpoint={"save_every": SAVE_EVERY, "keep_last": 2}, run_dir=str(tmp_path / name))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _train(config: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.Popen([sys.executable, "-m", "teamrl.cli", "train", str(config), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().removeprefix("step_")) if pointer.exists() else 0


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_config_data):
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    killed_cfg = _write_config(tiny_config_data, tmp_path, "killed")
    clean_cfg = _write_config(tiny_config_data, tmp_path, "clean")

    process = _train(killed_cfg)
    deadline = time.monotonic() + 120
    while _latest_step(killed_dir) < 2 * SAVE_EVERY and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be killed:\n" + process.stdout.read()
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = _latest_step(killed_dir)
    assert SAVE_EVERY <= saved < STEPS
    complete = sorted(p.name for p in (killed_dir / "checkpoints").glob("step_*"))
    assert all((killed_dir / "checkpoints" / name / "state.json").exists() for name in complete)

    resumed = _train(killed_cfg, "--resume")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    # The uninterrupted reference run, in this process (the same 2 torch threads as the runs above).
    from teamrl.cli import main

    assert main(["train", str(clean_cfg)]) == 0

    killed_metrics, clean_metrics = _metrics(killed_dir), _metrics(clean_dir)
    assert [m["step"] for m in killed_metrics] == list(range(1, STEPS + 1))  # every update exactly once
    assert len(killed_metrics) == len(clean_metrics) == STEPS
    # Same items, same RNG stream, same weights and optimiser state: the same run, number for number.
    for resumed_step, clean_step in zip(killed_metrics, clean_metrics):
        for key in ("reward/mean", "loss", "first/grad_norm", "second/grad_norm"):
            assert resumed_step[key] == pytest.approx(clean_step[key], rel=1e-5, abs=1e-6), (resumed_step["step"], key)
    assert _latest_step(killed_dir) == STEPS
    assert not list((killed_dir / "checkpoints").glob(".tmp-*"))  # a half-written checkpoint is cleaned up


def test_teamrl_train_end_to_end_leaves_metrics_checkpoint_and_team(tmp_path, tiny_config_data):
    config = _write_config(tiny_config_data, tmp_path, "e2e")
    result = subprocess.run([sys.executable, "-m", "teamrl.cli", "train", str(config), "steps=3",
                             "logging.sample_every=1", "checkpoint.save_every=2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "e2e"
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("reward/turn1/mean", "reward/turn1/std", "return/mean", "advantage/std", "loss", "kl",
                "clip_fraction", "grad_norm", "tokens/per_second", "time/step", "memory/rss_gib",
                "memory/peak_rss_gib"):
        assert key in metrics[0], key
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["samples"][0]["observations"] == ["target 9 first", "target 9 second"]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000003"
    assert (run / "team" / "team.json").exists()
    assert "team saved to" in result.stdout


def test_resume_skips_a_damaged_checkpoint_for_the_newest_readable_one(tmp_path, tiny_config_data, caplog):
    from teamrl.cli import main

    config = _write_config(tiny_config_data, tmp_path, "damaged")
    run = tmp_path / "damaged"
    assert main(["train", str(config), "steps=3", "checkpoint.save_every=1"]) == 0
    uninterrupted = _metrics(run)
    newest = run / "checkpoints" / "step_000003"
    tensors = newest / "first.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])  # a truncated tensor file

    assert main(["train", str(config), "steps=3", "checkpoint.save_every=1", "--resume"]) == 0
    assert "checkpoints/step_000003 cannot be read" in caplog.text and "step_000002" in caplog.text
    resumed = _metrics(run)
    assert [m["step"] for m in resumed] == [1, 2, 3]  # step 3 redone from step 2's checkpoint
    for key in ("reward/mean", "loss", "first/grad_norm"):
        assert resumed[2][key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-6), key
    assert (run / "checkpoints" / "latest").read_text() == "step_000003"
    load_file(str(tensors))  # written again, whole


def test_checkpoints_are_pruned_by_step_number_not_by_name(tmp_path):
    from teamrl.checkpoint import save_checkpoint

    for step in (999_998, 999_999, 1_000_000):  # past six digits, "step_1000000" sorts before "step_999999"
        save_checkpoint(tmp_path, step, {}, keep_last=2)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_1000000", "step_999999"]
    assert (checkpoints / "latest").read_text() == "step_1000000"
