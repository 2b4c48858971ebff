"""A run's reward curve (``plot_run``, ``teamrl plot RUN_DIR``): drawn from the run's files, an old run's too,
and a directory that holds no run is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from teamrl.cli import main
from teamrl.evaluation import plots

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, steps: int = 4, evaluated: tuple[int, ...] = ()) -> Path:
    """A run directory as training leaves it: config.yaml, metrics.jsonl and, if ``evaluated``, eval.jsonl."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("algorithm:\n  name: maremax\n")
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "reward/mean": 0.1 * step, "loss": 0.5}) + "\n"
                for step in range(1, steps + 1)))
    if evaluated:
        (run_dir / "eval.jsonl").write_text(
            "".join(json.dumps({"step": step, "reward/mean": 0.2 + 0.1 * step, "reward/std": 0.1, "items": 16,
                                "samples": 2}) + "\n" for step in evaluated))
    return run_dir


def test_the_curve_has_every_training_step_and_the_held_out_points(tmp_path, monkeypatch):
    drawn = {}

    def record(history, path, **options):
        drawn.update(history=history, path=path, **options)
        return Path(path)

    monkeypatch.setattr(plots, "plot_reward_curve", record)
    run_dir = _write_run(tmp_path / "run", evaluated=(0, 2, 4))
    assert plots.plot_run(run_dir) == run_dir / "reward_curve.png"
    assert [h["step"] for h in drawn["history"]] == [1, 2, 3, 4]
    assert [e["step"] for e in drawn["held_out"]] == [0, 2, 4]
    assert drawn["title"] == "Joint reward during MAREMAX training"


def test_teamrl_plot_draws_a_run_with_or_without_held_out_evaluations(tmp_path, capsys):
    for name, evaluated in (("new", (0, 2, 4)), ("old", ())):  # an old run has no eval.jsonl
        run_dir = _write_run(tmp_path / name, evaluated=evaluated)
        out = tmp_path / f"{name}.png"
        assert main(["plot", str(run_dir), "--out", str(out)]) == 0
        assert capsys.readouterr().out == f"reward curve: {out}\n"
        assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000
    assert main(["plot", str(tmp_path / "new")]) == 0  # by default, beside the run's files
    assert (tmp_path / "new" / "reward_curve.png").read_bytes()[:8] == PNG


def test_teamrl_plot_refuses_a_directory_that_is_not_a_run_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a run")
    for directory in (tmp_path, tmp_path / "missing"):
        assert main(["plot", str(directory)]) == 2
        err = capsys.readouterr().err
        assert err == (f"teamrl: error: run_dir: {str(directory)!r} is not a training run (no metrics.jsonl or "
                       f"eval.jsonl in it); give the run_dir of a teamrl train run\n")
    (tmp_path / "metrics.jsonl").write_text("")  # a run that has not logged a step yet
    assert main(["plot", str(tmp_path)]) == 2
    assert "has logged no step yet" in capsys.readouterr().err


def test_teamrl_plot_loads_no_model_library(tmp_path):
    # Plotting a run takes a second: it must not pay for importing torch.
    run_dir = _write_run(tmp_path / "run", evaluated=(0, 4))
    script = ("import sys\nfrom teamrl.cli import main\nassert main(['plot', sys.argv[1]]) == 0\n"
              "print(sorted(name for name in ('torch', 'transformers', 'peft') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def _drawn(monkeypatch, history, **options):
    """The axes plot_reward_curve draws (captured before saving): {label: y values}, and the y-axis label."""
    captured = {}

    def keep(fig, path):
        captured["axes"] = fig.axes[0]
        return Path(path)

    monkeypatch.setattr(plots, "_save", keep)
    plots.plot_reward_curve(history, "unused.png", **options)
    axes = captured["axes"]
    return {line.get_label(): list(line.get_ydata()) for line in axes.get_lines()}, axes.get_ylabel()


def test_a_multi_turn_curve_shows_training_episode_returns_beside_held_out_episode_returns(monkeypatch):
    # Two-turn episodes: held-out evaluation scores each episode's return (both turns' joint rewards summed), so
    # the training curve is the rollout's episode return, not turn 1's reward (0 throughout with a sparse reward).
    history = [{"step": step, "reward/mean": 0.0, "reward/episode/mean": 0.3 * step} for step in (1, 2)]
    held_out = [{"step": 0, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.7}]
    lines, ylabel = _drawn(monkeypatch, history, held_out=held_out, num_turns=2)
    assert lines["training batch"] == [0.3, 0.6]
    assert lines["held-out episodes: 0.20 at step 0 -> 0.70 at step 2"] == [0.2, 0.7]
    assert ylabel == "episode return (2 turns, joint rewards summed)"
    # A run logged before the episode return existed: its turn-1 reward, labelled as such.
    lines, _ = _drawn(monkeypatch, [{"step": 1, "reward/mean": 0.1}], num_turns=2)
    assert lines["training: turn-1 joint reward only (logged before episode returns were)"] == [0.1]
    # One turn: the episode is the turn.
    lines, ylabel = _drawn(monkeypatch, [{"step": 1, "reward/mean": 0.4}])
    assert lines["training batch"] == [0.4] and ylabel == "joint reward"


def test_a_runs_curve_reads_its_number_of_turns_from_its_config(tmp_path, monkeypatch):
    drawn = {}
    monkeypatch.setattr(plots, "plot_reward_curve", lambda history, path, **options: drawn.update(options))
    run_dir = _write_run(tmp_path / "run")
    (run_dir / "config.yaml").write_text("algorithm:\n  name: magrpo\n  num_turns: 3\n")
    plots.plot_run(run_dir)
    assert drawn["num_turns"] == 3
