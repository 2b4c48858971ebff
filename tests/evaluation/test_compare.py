"""teamrl compare (teamrl/evaluation/compare.py): contenders, a run's evaluation schedule, the resumable runner,
the numbers over seeds and the report. Runs train the tests' tiny digit_sum team (seconds each)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from teamrl.algorithms.base import ALGORITHMS
from teamrl.cli import main
from teamrl.config import load_config
from teamrl.evaluation import compare
from teamrl.evaluation.compare import CompareSettings, Contender
from teamrl.run_dir import checkpoint_step, complete_checkpoints


def test_every_algorithm_is_a_contender_whose_config_loads_on_a_two_agent_task(tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    # A config that names MAGRPO's estimator, as the presets do, and scales it per agent: the fixed-estimator
    # algorithms must not clash with the first, nor the critics and MADPO (which read neither) with either.
    config.write_text(yaml.safe_dump(tiny_config_data(algorithm={"advantage": "std", "normalize_advantages": "agent"})))
    task = load_config(str(config), ["team.agents=[{name: a}, {name: b, sampling: {max_new_tokens: 6}}]"])
    contenders = compare.parse_algorithms("all", task)
    assert [c.name for c in contenders][:4] == ["magrpo", "mareinforce", "marloo", "maremax"]
    assert [c.name for c in contenders] == list(ALGORITHMS)
    compare.check_contenders(CompareSettings(config=str(config)), contenders)
    loaded = {c.name: load_config(str(config), list(c.overrides)) for c in contenders}
    assert all(loaded[name].algorithm.name == name for name in ALGORITHMS)
    assert loaded["maremax"].algorithm.advantage_estimator == "max"
    assert loaded["magrpo"].algorithm.advantage_estimator == "std"
    assert (loaded["iac"].algorithm.advantage, loaded["iac"].algorithm.normalize_advantages) == (None, "none")
    assert loaded["magrpo"].algorithm.normalize_advantages == "agent"
    # the one policy writes both parts: the team's token budget, 4 (the tiny config's) + 6
    assert [(agent.name, agent.sampling) for agent in loaded["centralized"].team.agents] == [
        ("central", {"max_new_tokens": 10})]
    assert len(loaded["iac"].team.agents) == 2


def test_bad_contenders_are_refused_before_anything_trains(tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data()))
    with pytest.raises(ValueError, match="unknown algorithm 'grpo'; choose from magrpo"):
        compare.parse_algorithms("magrpo,grpo", load_config(str(config)))
    with pytest.raises(ValueError, match="contender 'fast': .*optim.lr"):
        compare.check_contenders(CompareSettings(config=str(config)), [Contender("fast", ("optim.lr=-1",))])
    with pytest.raises(ValueError, match="different names"):
        compare.check_contenders(CompareSettings(config=str(config)), [Contender("a"), Contender("a")])
    with pytest.raises(ValueError, match="--eval-items: must be >= 1"):
        CompareSettings(config=None, eval_items=0)


def test_a_variant_is_a_name_and_its_overrides():
    assert compare.parse_variant("lr5e-4: optim.lr=5e-4 'team.agents=[{name: a}]'") == Contender(
        "lr5e-4", ("optim.lr=5e-4", "team.agents=[{name: a}]"))
    assert compare.parse_variant("default:") == Contender("default")
    for bad in ("no colon", ": optim.lr=1", "a/b: steps=1"):
        with pytest.raises(ValueError, match="NAME: field=value"):
            compare.parse_variant(bad)


def test_the_standard_error_counts_each_item_once_by_its_mean():
    samples = [{"item": "a", "reward": 1.0}, {"item": "a", "reward": 0.0}, {"item": "b", "reward": 1.0},
               {"item": "b", "reward": 1.0}, {"item": "c", "reward": 0.0}, {"item": "c", "reward": 0.0}]
    # item means 0.5, 1, 0: sample sd 0.5, over sqrt(3) items
    assert compare.item_standard_error(samples) == pytest.approx(0.5 / math.sqrt(3))
    assert compare.item_standard_error(samples[:2]) == 0.0


def _run(seed, points, contender="fast", peak=2**30):
    return {"spec": {"seed": seed, "contender": contender, "contender_overrides": ["optim.lr=1"], "config": "c.yaml",
                     "overrides": [], "minutes": 10.0, "steps": 0, "eval_items": 32, "eval_samples": 2,
                     "eval_seed": 0, "parallel": 1, "threads": 0},
            "max_reward": 3.0, "peak_rss_bytes": peak,
            "curve": [{"step": step, "train_seconds": seconds, "reward/mean": reward, "reward/se": 0.05}
                      for step, seconds, reward in points],
            "steps": [{"time/step": 30.0}] * points[-1][0]}


def test_minutes_to_a_gain_and_the_return_at_a_time():
    run = _run(0, [(0, 0.0, 1.0), (5, 150.0, 1.4), (10, 300.0, 2.1), (15, 450.0, 1.9)])
    assert compare.minutes_to_gain(run, 0.3) == 2.5
    assert compare.minutes_to_gain(run, 1.0) == 5.0   # first reached at 300 s, even though it drops later
    assert compare.minutes_to_gain(run, 1.5) is None
    # between evaluations, the line joining them; after the last, its value
    assert compare.reward_at(run, 0.0) == 1.0 and compare.reward_at(run, 300.0) == 2.1
    assert math.isclose(compare.reward_at(run, 225.0), 1.75) and math.isclose(compare.reward_at(run, 75.0), 1.2)
    assert compare.reward_at(run, 1e6) == 1.9


def test_a_contender_is_summarised_over_its_seeds():
    runs = [_run(0, [(0, 0.0, 1.0), (10, 300.0, 2.0)]), _run(1, [(0, 0.0, 1.0), (10, 300.0, 1.6)], peak=2**31)]
    summary = compare.summarise("fast", runs)
    assert summary.after == pytest.approx(1.8) and summary.gain == pytest.approx(0.8)
    # after: 2.0 and 1.6, sample sd 0.2828, over sqrt(2) seeds = 0.2
    assert summary.after_se == pytest.approx(0.2) and summary.gain_se == pytest.approx(0.2)
    assert summary.min_gain == pytest.approx(0.6)
    assert summary.minutes_to == {0.5: [5.0, 5.0], 1.0: [5.0, None]}
    assert summary.seconds_per_step == 30.0 and summary.train_minutes == 5.0 and summary.peak_memory_gib == 2.0
    row = compare.summary_rows([summary])[0]
    assert row == ["fast", "2", "1.000", "1.800 ± 0.200", "+0.800 ± 0.200", "+0.600", "5.0 (2/2)", "5.0 (1/2)",
                   "10.0", "5.00", "30.0", "2.00"]
    # One seed: the return's standard error is over that run's held-out items; a gain has none.
    alone = compare.summary_rows([compare.summarise("fast", runs[:1])])[0]
    assert alone[3:5] == ["2.000 ± 0.050", "+1.000"]


def test_each_contender_is_compared_with_the_first_by_the_difference_of_returns_and_its_standard_error(tmp_path):
    def seeds(name, start, finals):
        return [_run(seed, [(0, 0.0, start), (10, 300.0, final)], contender=name) for seed, final in enumerate(finals)]

    # after: reference 1.8, 2.0, 2.2 (mean 2.0, sd 0.2, SE 0.2/sqrt 3); better 2.4, 2.6, 2.8 (mean 2.6, same SE)
    runs = {"reference": seeds("reference", 1.0, [1.8, 2.0, 2.2]), "better": seeds("better", 1.0, [2.4, 2.6, 2.8]),
            # starts far lower and gains more, but ends below: judged by where it ends
            "low start": seeds("low start", 0.2, [1.4, 1.6, 1.8]), "alone": seeds("alone", 1.0, [3.0])}
    summaries = [compare.summarise(name, mine) for name, mine in runs.items()]
    value, se = compare.return_difference(summaries[1], summaries[0])
    assert value == pytest.approx(0.6) and se == pytest.approx(math.sqrt(2 * 0.2**2 / 3))  # 0.163
    assert summaries[2].gain > summaries[0].gain
    assert compare.return_difference(summaries[2], summaries[0])[0] == pytest.approx(-0.4)
    assert compare.return_difference(summaries[3], summaries[0]) is None  # one seed: no spread over seeds
    assert compare.against_reference_rows(summaries) == [["better", "+0.600", "0.163", "+3.7"],
                                                         ["low start", "-0.400", "0.163", "-2.4"]]
    table = compare.write_report(runs, tmp_path)["results.md"].read_text()
    assert "return after training against reference's" in table and "| better | +0.600 | 0.163 | +3.7 |" in table
    assert "<h2>Against reference</h2>" in (tmp_path / "report.html").read_text()
    # nothing to compare: no table
    assert "against reference" not in compare.render_markdown({"reference": runs["reference"], "alone": runs["alone"]})


def test_the_report_files_say_what_ran(tmp_path):
    runs = {"fast <b>": [_run(0, [(0, 0.0, 1.0), (10, 300.0, 2.0)], contender="fast <b>")],
            "slow": [_run(0, [(0, 0.0, 1.0), (4, 300.0, 1.2)], contender="slow")]}
    files = compare.write_report(runs, tmp_path)
    table = files["results.md"].read_text()
    assert "Budget per run: 10 training minutes" in table and "one run at a time" in table
    assert "- slow: optim.lr=1" in table
    assert "Machine: not recorded." in table  # runs made before machines were recorded
    runs["fast <b>"][0]["machine"], runs["slow"][0]["machine"] = "cpu A, 2 cores", "cpu B, 2 cores"
    assert ("Machines (minutes compare only within one): cpu A, 2 cores: fast <b>-seed0; cpu B, 2 cores: "
            "slow-seed0.") in compare.describe(runs)
    assert "| fast <b>-seed0 | 0: 1.00, 10: 2.00 | 2.000 ± 0.050 | 5.0 | 5.0 |" in table
    rows = files["results.csv"].read_text().splitlines()
    assert rows[0].startswith("contender,seeds,before,after,after_se,gain") and rows[2].startswith("slow,1,1.0,1.2")
    assert files["curve.png"].read_bytes()[:4] == b"\x89PNG"
    page = files["report.html"].read_text()
    assert "fast &lt;b&gt;" in page and "fast <b>" not in page and "data:image/png;base64," in page


def test_the_reward_parts_before_and_after_are_averaged_over_seeds(tmp_path):
    def parted(seed, before, after, contender="fast"):
        run = _run(seed, [(0, 0.0, 1.0), (10, 300.0, 2.0)], contender=contender)
        run["curve"][0].update({"reward/structure": before[0], "reward/tests": before[1]})
        run["curve"][1].update({"reward/structure": after[0], "reward/tests": after[1]})
        return run

    runs = {"fast": [parted(0, (0.2, 0.0), (0.8, 0.5)), parted(1, (0.4, 0.0), (1.0, 0.3))],
            "plain": [_run(0, [(0, 0.0, 1.0), (4, 120.0, 1.2)], contender="plain")]}
    assert compare.reward_parts(runs) == ["structure", "tests"]  # not mean, std or se
    assert compare.parts_rows(runs) == [["fast", "0.30 -> 0.90", "0.00 -> 0.40"], ["plain", "-", "-"]]
    table = compare.write_report(runs, tmp_path)["results.md"].read_text()
    assert "| contender | structure | tests |" in table and "| fast | 0.30 -> 0.90 | 0.00 -> 0.40 |" in table
    assert "0.30 -&gt; 0.90" in (tmp_path / "report.html").read_text()
    # no parts, no table
    assert "reward's parts" not in compare.render_markdown({"plain": runs["plain"]})


def test_a_run_evaluates_at_step_zero_on_its_schedule_and_at_its_end(tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=3)))
    spec = compare.run_spec(CompareSettings(config=str(config), overrides=("items_per_step=2",), eval_every_steps=2,
                                            eval_items=4, eval_samples=2),
                            Contender("plain"), seed=0, out=tmp_path)
    result = compare.train_with_evaluations(spec)
    assert [point["step"] for point in result["curve"]] == [0, 2, 3]
    assert len(result["steps"]) == 3 and result["max_reward"] == 1.0
    assert all(point["episodes"] == 8 and point["reward/se"] >= 0 for point in result["curve"])
    seconds = [point["train_seconds"] for point in result["curve"]]
    assert seconds[0] == 0.0 and seconds == sorted(seconds)
    assert seconds[-1] == pytest.approx(sum(step["time/step"] for step in result["steps"]))
    assert result["peak_rss_bytes"] > 100 * 2**20


def test_a_minute_budget_stops_training_after_the_step_that_spends_it(tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=50)))
    settings = CompareSettings(config=str(config), minutes=1e-9, eval_items=2, eval_samples=1)
    result = compare.train_with_evaluations(compare.run_spec(settings, Contender("plain"), seed=0, out=tmp_path))
    assert len(result["steps"]) == 1 and [point["step"] for point in result["curve"]] == [0, 1]
    run_dir = tmp_path / "plain-seed0"  # a training run's directory: the stopping step checkpointed, the team saved
    assert [checkpoint_step(path) for path in complete_checkpoints(run_dir)] == [1] and (run_dir / "team").is_dir()


def test_the_runner_trains_each_run_in_its_own_process_names_a_failure_and_a_rerun_skips_what_is_done(
        tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=1)))
    settings = CompareSettings(config=str(config), seeds=(0,), eval_items=2, eval_samples=1, threads=1, parallel=2)
    magrpo = compare.algorithm_contender("magrpo", load_config(str(config)))
    broken = Contender("broken", ("env.kwargs.length=-3",))  # not checked here: its worker fails on it
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match=r"1 run\(s\) failed: broken-seed0 .*a re-run trains only the missing"):
        compare.run_all(settings, [magrpo, broken], out, log=lambda message: None)
    assert (out / "broken-seed0.log").read_text()
    done = json.loads((out / "results.json").read_text())
    assert set(done) == {"magrpo-seed0"}
    assert (out / "magrpo-seed0" / "metrics.jsonl").is_file() and (out / "magrpo-seed0" / "team").is_dir()
    messages = []
    runs = compare.run_all(settings, [magrpo], out, log=messages.append)
    assert runs == {"magrpo": [done["magrpo-seed0"]]}
    assert messages == [f"magrpo-seed0: already in {out / 'results.json'}, skipped"]
    with pytest.raises(ValueError, match="magrpo-seed0 was run with other settings"):
        compare.run_all(CompareSettings(**{**settings.__dict__, "eval_items": 3}), [magrpo], out, log=print)


def test_a_run_killed_part_way_resumes_from_its_checkpoint_and_ends_as_if_uninterrupted(tiny_config_data, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=4)))
    settings = CompareSettings(config=str(config), overrides=("items_per_step=2", "checkpoint.save_every=2"),
                               eval_every_steps=2, eval_items=4, eval_samples=2)
    whole = compare.train_with_evaluations(compare.run_spec(settings, Contender("plain"), seed=0,
                                                            out=tmp_path / "whole"))
    spec = compare.run_spec(settings, Contender("plain"), seed=0, out=tmp_path / "killed")
    compare.train_with_evaluations(spec)
    # Killed during step 4's checkpoint: on disk step 2's checkpoint, then step 3's and 4's metrics and step 4's
    # evaluation, which the resumed run must drop and redo.
    run_dir = Path(spec["run_dir"])
    for path in complete_checkpoints(run_dir):
        if checkpoint_step(path) == 4:
            shutil.rmtree(path)
    shutil.rmtree(run_dir / "team")
    assert compare.resumable(spec)
    assert not compare.resumable({**spec, "seed": 1}) and not compare.resumable({**spec, "run_dir": str(tmp_path)})
    resumed = compare.train_with_evaluations(spec)
    assert [point["step"] for point in resumed["curve"]] == [0, 2, 4] and len(resumed["steps"]) == 4
    for key in ("reward/mean", "reward/se"):  # training's draws are seeded by step: the same run, point for point
        assert [point[key] for point in resumed["curve"]] == [point[key] for point in whole["curve"]]
    assert [step["reward/mean"] for step in resumed["steps"]] == [step["reward/mean"] for step in whole["steps"]]
    seconds = [point["train_seconds"] for point in resumed["curve"]]
    assert seconds == sorted(seconds) and seconds[-1] == pytest.approx(sum(s["time/step"] for s in resumed["steps"]))
    assert (run_dir / "team").is_dir()


def _workers_of(run_dir: Path) -> list[int]:
    """Pids of the ``teamrl compare`` workers training into ``run_dir`` (read from /proc: no psutil here)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"teamrl.evaluation.compare" in command and any(str(run_dir).encode() in part for part in command):
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_compare_stops_its_runs_at_a_checkpoint(stop, tiny_config_data, tmp_path):
    """SIGTERM (or Ctrl-C) to ``teamrl compare`` reaches each run under way, which saves its step and ends before
    compare does; if compare is killed outright its runs still end (they used to go on, unwatched)."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=10_000)))
    settings = CompareSettings(config=str(config), overrides=("items_per_step=2", "checkpoint.save_every=1000"),
                               eval_every_steps=10_000, eval_items=2, eval_samples=1)
    out = tmp_path / "out"
    script = (f"from teamrl.evaluation import compare; compare.run_all("
              f"compare.CompareSettings(**{settings.__dict__!r}), [compare.Contender('plain')], {str(out)!r})")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = Path(compare.run_spec(settings, Contender("plain"), seed=0, out=out)["run_dir"])
    try:
        _stop_and_watch(parent, stop, run_dir)
    finally:  # a failed check must not leave a 10,000-step run behind
        parent.kill()
        for pid in _workers_of(run_dir):
            os.kill(pid, signal.SIGKILL)
    steps = [checkpoint_step(path) for path in complete_checkpoints(run_dir)]
    assert steps and steps[-1] >= 1, "the run did not save the step it stopped after"
    assert compare.resumable(compare.run_spec(settings, Contender("plain"), seed=0, out=out))


def _stop_and_watch(parent: subprocess.Popen, stop: int, run_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file() or not _workers_of(run_dir):
        assert time.monotonic() < deadline and parent.poll() is None, parent.stdout.read().decode()[-2000:]
        time.sleep(0.2)
    parent.send_signal(stop)
    output = parent.communicate(timeout=120)[0].decode()
    if stop == signal.SIGTERM:
        assert not _workers_of(run_dir), "compare ended before its run"
        assert "stopping: 1 run(s) under way save a checkpoint at the end of their step" in output, output[-2000:]
    deadline = time.monotonic() + 120
    while _workers_of(run_dir):
        assert time.monotonic() < deadline, "the run went on after compare was killed"
        time.sleep(0.2)


def test_the_runs_finished_so_far_are_grouped_per_contender_in_seed_order(tmp_path):
    with pytest.raises(ValueError, match="no finished runs there yet"):
        compare.finished_runs(tmp_path)
    points = [(0, 0.0, 1.0), (10, 300.0, 2.0)]
    results = {"slow-seed1": _run(1, points, contender="slow"), "fast-seed0": _run(0, points),
               "slow-seed0": _run(0, points, contender="slow")}
    (tmp_path / "results.json").write_text(json.dumps(results))
    runs = compare.finished_runs(tmp_path)
    assert list(runs) == ["slow", "fast"]  # the order each contender's first run finished
    assert [run["spec"]["seed"] for run in runs["slow"]] == [0, 1] and len(runs["fast"]) == 1
    assert list(compare.finished_runs(tmp_path, ["fast", "slow"])) == ["fast", "slow"]
    with pytest.raises(ValueError, match="no finished run of magrpo .it has slow, fast"):
        compare.finished_runs(tmp_path, ["magrpo"])
    results["fast-seed1"] = _run(1, points)
    results["fast-seed1"]["spec"]["minutes"] = 5.0  # another budget: not one table
    (tmp_path / "results.json").write_text(json.dumps(results))
    with pytest.raises(ValueError, match="fast-seed1 and slow-seed1 differ in minutes"):
        compare.finished_runs(tmp_path)
    assert len(compare.finished_runs(tmp_path, ["slow"])["slow"]) == 2


def test_the_command_line_refuses_a_comparison_without_contenders(capsys):
    assert main(["compare", "tiny_digit_sum"]) == 2
    assert "--algorithms NAME,NAME" in capsys.readouterr().err
    assert main(["compare", "tiny_digit_sum", "--algorithms", "magrpo,ppo"]) == 2
    assert "unknown algorithm 'ppo'" in capsys.readouterr().err
    assert main(["compare", "no_such_task", "--algorithms", "magrpo"]) == 2
    assert "neither an environment" in capsys.readouterr().err


def test_the_command_line_compares_and_writes_the_report(tiny_config_data, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_data(steps=5)))
    out = tmp_path / "out"
    assert main(["compare", str(config), "items_per_step=2", "--algorithms", "maremax", "--seeds", "3", "--steps",
                 "1", "--eval-items", "2", "--eval-samples", "1", "--threads", "1", "--out", str(out)]) == 0
    assert "| maremax | 1 |" in capsys.readouterr().out
    spec = json.loads((out / "results.json").read_text())["maremax-seed3"]["spec"]
    assert spec["overrides"] == ["items_per_step=2"] and spec["steps"] == 1 and spec["seed"] == 3
    assert spec["contender_overrides"] == ["algorithm.name=maremax"]  # nothing it does not read is set
    assert json.loads((out / "results.json").read_text())["maremax-seed3"]["machine"].endswith(
        "cores, torch " + torch.__version__ + " on 1 thread(s)")
    assert all((out / name).is_file() for name in ("results.md", "results.csv", "curve.png", "report.html"))
    (out / "results.md").unlink()
    assert main(["compare", str(config), "--report-only", "--out", str(out)]) == 0  # trains nothing
    assert "| maremax | 1 |" in capsys.readouterr().out and (out / "results.md").is_file()
    assert main(["compare", str(config), "--report-only", "--algorithms", "magrpo", "--out", str(out)]) == 2
    assert "no finished run of magrpo" in capsys.readouterr().err
