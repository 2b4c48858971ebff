"""docs/environments.md is a tutorial whose files and commands run: each titled code block is written to
its file, each `teamrl` command runs (on the tiny test model, for a few steps), in order."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from teamrl.cli import main
from teamrl.imports import ENVIRONMENT_GROUP

PAGE = Path(__file__).parents[1] / "docs" / "environments.md"
BLOCK = re.compile(r"^```(\w+)(?: title=\"([^\"]+)\")?\n(.*?)^```", re.MULTILINE | re.DOTALL)
# What keeps a tutorial command to seconds here: the test model, two steps, small groups.
QUICK = {"train": ["team.model=tiny", "steps=2", "algorithm.num_generations=2", "logging.progress_bar=false",
                   "eval.items=1"],
         "eval": ["team.model=tiny"], "generate": []}


def blocks() -> list[tuple[str, str | None, str]]:
    return BLOCK.findall(PAGE.read_text())


def test_the_tutorial_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = 0
    for language, title, text in blocks():
        if title:
            (tmp_path / title).write_text(text)
        elif language == "bash":
            for line in text.strip().splitlines():
                argv = shlex.split(line)
                assert argv[0] == "teamrl", line
                assert main([*argv[1:], *QUICK[argv[1]]]) == 0, line
                commands += 1
    assert commands >= 5
    assert (tmp_path / "runs" / "fact_qa" / "team" / "team.json").is_file()
    assert (tmp_path / "runs" / "brainstorm" / "team" / "team.json").is_file()


def test_the_entry_point_example_names_teamrls_group():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    tables = [tomllib.loads(text) for language, _, text in blocks() if language == "toml"]
    assert tables and all(ENVIRONMENT_GROUP in table["project"]["entry-points"] for table in tables)
