"""``teamrl eval`` end to end on the bundled SmolLM2-135M-Instruct: every prompt-only baseline on a
2-item HumanEval slice (graded in the sandbox) and a 2-item TL;DR slice, with short completions."""

from __future__ import annotations

import json
import shutil

import pytest

from teamrl.cli import main

pytestmark = pytest.mark.slow

METHODS = ("single agent", "naive concatenation (untrained team)", "sequential pipeline", "one-round discussion")


@pytest.mark.parametrize("task, extra", [
    pytest.param("humaneval", ["--k", "1"], marks=pytest.mark.skipif(shutil.which("bwrap") is None,
                                                                      reason="bubblewrap is not installed")),
    ("tldr", ["env.kwargs.max_text_chars=300"]),
])
def test_eval_on_the_bundled_model_writes_the_table_and_the_report(task, extra, tmp_path, capsys):
    out = tmp_path / task
    code = main(["eval", task, "--model", "bundled", "--max-items", "2", "--out", str(out),
                 "team.sampling.max_new_tokens=8", *extra])
    printed, errors = capsys.readouterr()
    assert code == 0, errors
    for title in METHODS:
        assert f"| {title} |" in printed
    assert (out / "report.html").stat().st_size > 10_000
    record = json.loads((out / "results.json").read_text())
    assert [m["method"] for m in record["methods"]] == ["single", "concat", "sequential", "discussion"]
    for method in record["methods"]:
        assert len(method["samples"]) == 2 and method["metrics"]["tokens"] > 0
        assert 0.0 <= method["metrics"]["normalised_return"] <= 1.0
        if task == "humaneval":
            assert {"pass@1", "accuracy@1", "tests_passed", "scheme/trivial"} <= set(method["metrics"])
            assert all("scheme" in sample for sample in method["samples"])
