"""The main-job command end to end (on the tiny model so it runs in seconds): it trains, evaluates on
held-out items before and after, writes a reward-curve PNG and saves the team."""

from __future__ import annotations

import json
import re

from teamrl.demo import run_demo, typical_row


def test_demo_reports_before_after_plot_and_saved_team(tmp_path, capsys):
    code = run_demo("tiny_digit_sum", [f"run_dir={tmp_path / 'demo'}", "steps=30", "logging.progress_bar=false"],
                    eval_items=8, eval_samples=2)
    out = capsys.readouterr().out
    assert code == 0
    assert "Held-out joint reward (max 1): before" in out
    assert "[BEFORE] joint reward" in out and "[AFTER] joint reward" in out
    png = tmp_path / "demo" / "reward_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (tmp_path / "demo" / "team" / "team.json").exists()
    before, after = map(float, re.search(r"before ([\d.]+) ± [\d.]+  ->  after ([\d.]+)", out).groups())
    assert after > before + 0.3  # the tiny team learns digit_sum within 30 steps
    # Before and after are the run's own held-out evaluations, at step 0 and its last step, and only those.
    evaluations = [json.loads(line) for line in (tmp_path / "demo" / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["items"], e["samples"]) for e in evaluations] == [(0, 8, 2), (30, 8, 2)]
    assert [f"{e['reward/mean']:.3f}" for e in evaluations] == [f"{before:.3f}", f"{after:.3f}"]


def test_the_example_is_the_row_nearest_both_means():
    before = [0.0, 1.0, 2.0, 1.0]  # mean 1.0
    after = [3.0, 1.0, 2.0, 2.0]   # mean 2.0
    assert typical_row(before, after) == 3  # |1-1| + |2-2| = 0; row 1 is off by 1 after, row 2 by 1 before
