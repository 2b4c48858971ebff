"""The pages a newcomer follows run as written, top to bottom: README.md, docs/quickstart.md, docs/environments.md and
docs/serving.md. A page that breaks itself (a flag that changed, a command that needs a file no earlier command
writes, a snippet that cannot load what the page exported) fails here.

Each page runs in a fresh folder, in page order:

* a code block titled with a file name (```python title="my_rewards.py"```) is written to that file;
* every line of a ```bash block is a command (``&&`` chains split, ``\\`` continuations joined, ``# comments``
  dropped): ``teamrl ...`` runs through :func:`teamrl.cli.main` and must exit 0, ``python SCRIPT`` in a new process;
* a ```python block without a title runs (one namespace per page).

What keeps a page quick is :data:`QUICK`: arguments appended to a command, where the last of a repeated option or
``field=value`` wins. Every command that loads models gets the tiny test model (``team.model=tiny``, whose
vocabulary is the task's) and a small budget; ``teamrl serve`` gets ``--port 0`` and runs in the background until
the page ends (then SIGTERM, and it must exit 0), and a snippet that talks to ``http://127.0.0.1:PORT`` reaches the
server the page started on PORT. What is not run, each for the reason :func:`not_run` gives: installs (the extras
they name must exist), the test suite itself, vLLM (an NVIDIA GPU). README.md's Python example (the quickstart's
too) runs in tests/test_readme.py.
"""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from teamrl.cli import main
from teamrl.imports import ENVIRONMENT_GROUP

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)(?: title=\"([^\"]+)\")?\n(.*?)^```", re.MULTILINE | re.DOTALL)
TINY = ["team.model=tiny", "logging.progress_bar=false"]
# Appended to each `teamrl SUBCOMMAND`: the tiny model and a budget of seconds (the last value of a flag wins).
QUICK = {
    "train": [*TINY, "steps=2", "algorithm.num_generations=2", "eval.items=1"],
    "demo": [*TINY, "steps=1", "algorithm.num_generations=2", "--eval-items", "1", "--eval-samples", "1"],
    "eval": [*TINY, "--max-items", "2"],
    "compare": [*TINY, "--seeds", "0", "--minutes", "0", "--steps", "1", "--eval-items", "1", "--eval-samples", "1"],
}
# Appended to `python SCRIPT`: a few requests, one cell.
SCRIPTS = {"benchmarks/serve_load.py": ["--concurrency", "1", "--requests", "1", "--batching", "10", "--methods",
                                        "team"]}
README_EXAMPLE = "from teamrl import Team, Trainer, load_config, make_env"


def blocks(page: Path) -> list[tuple[str, str | None, str]]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def commands(text: str) -> list[list[str]]:
    """The commands of a bash block, as argument lists."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        while argv:
            end = argv.index("&&") if "&&" in argv else len(argv)
            found.append(argv[:end])
            argv = argv[end + 1:]
    return found


def not_run(argv: list[str]) -> str | None:
    """Why a command is checked rather than run, or None (it runs)."""
    if argv[:2] == ["pip", "install"]:
        extras = importlib.metadata.metadata("teamrl").get_all("Provides-Extra")
        for spec in argv[2:]:
            named = re.fullmatch(r"\.\[([\w,-]+)\]", spec)
            for extra in named.group(1).split(",") if named else ():
                assert extra in extras, f"`{shlex.join(argv)}`: pyproject.toml has no extra {extra!r}"
        return "an install: what it installs is this test's environment"
    if argv[:2] == ["bash", "scripts/test.sh"]:
        assert (ROOT / "scripts" / "test.sh").is_file()
        return "the test suite itself"
    if argv[:2] == ["vllm", "serve"]:
        return "vLLM serves on an NVIDIA GPU only"
    return None


class Page:
    """One page being run: its folder, its servers (by the port the page gives them) and its snippets' namespace."""

    def __init__(self, folder: Path, teamrl_server):
        self.folder = folder
        self.start_server = teamrl_server
        self.servers: dict[str, str] = {}
        self.namespace: dict = {}

    def run(self, argv: list[str]) -> None:
        if not_run(argv):
            return
        if argv[0] == "teamrl" and argv[1] == "serve":
            port = argv[argv.index("--port") + 1] if "--port" in argv else "8000"
            self.servers[port] = self.start_server(argv[2:], cwd=self.folder).url
        elif argv[0] == "teamrl":
            assert main([*argv[1:], *QUICK.get(argv[1], [])]) == 0, shlex.join(argv)
        elif argv[0] == "python":
            done = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:], *SCRIPTS[argv[1]]],
                                  cwd=self.folder, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{shlex.join(argv)}: {done.stderr[-2000:]}"
        else:
            raise AssertionError(f"`{shlex.join(argv)}`: not a command this test knows to run or to skip")

    def snippet(self, text: str, name: str) -> None:
        for port, url in self.servers.items():
            text = text.replace(f"http://127.0.0.1:{port}", url)
        exec(compile(text, name, "exec"), self.namespace)


PAGES = [
    pytest.param("README.md", marks=pytest.mark.slow),
    pytest.param("docs/quickstart.md", marks=pytest.mark.slow),
    "docs/environments.md",
    pytest.param("docs/serving.md", marks=pytest.mark.slow),
]
# What a page's commands leave behind, as its text says.
WRITTEN = {
    "README.md": ["runs/demo_tldr_cpu/team/team.json", "runs/marloo/team/team.json", "exports/digits/README.md",
                  "runs/tiny_digit_sum/reward_curve.png", "runs/compare-tiny_digit_sum/results.md"],
    "docs/quickstart.md": ["runs/tiny_digit_sum/team/team.json", "runs/marloo/team/team.json", "exported/README.md"],
    "docs/environments.md": ["runs/fact_qa/team/team.json", "runs/brainstorm/team/team.json",
                             "runs/fact_qa/eval/report.html"],
    "docs/serving.md": ["exports/tldr-team/summarizer/adapter_config.json", "exports/tldr-merged/summarizer",
                        "exports/tldr-hub/base", "exports/team/base", "results.json"],
}


@pytest.mark.parametrize("name", PAGES)
def test_the_page_runs_as_written(name, tmp_path, monkeypatch, teamrl_server, capsys):
    monkeypatch.chdir(tmp_path)
    page = Page(tmp_path, teamrl_server)
    ran = 0
    for number, (language, title, text) in enumerate(blocks(ROOT / name), 1):
        if title:
            (tmp_path / title).write_text(text)
        elif language == "bash":
            for argv in commands(text):
                page.run(argv)
                ran += 1
        elif language == "python" and not text.startswith(README_EXAMPLE):
            page.snippet(text, f"{name}, code block {number}")
    assert ran >= 5, f"{name}: only {ran} commands"
    missing = [path for path in WRITTEN[name] if not (tmp_path / path).exists()]
    assert not missing, f"{name}: its commands did not write {missing}"
    capsys.readouterr()


def test_every_command_is_run_or_said_why_not():
    """A command in a page's bash block is one of what Page.run knows, and the QUICK budgets name real flags."""
    for name in ("README.md", "docs/quickstart.md", "docs/environments.md", "docs/serving.md"):
        for language, title, text in blocks(ROOT / name):
            if language == "bash" and not title:
                for argv in commands(text):
                    known = argv[0] in ("teamrl", "python") or not_run(argv) is not None
                    assert known, f"{name}: `{shlex.join(argv)}`"
                    assert argv[0] != "python" or argv[1] in SCRIPTS, f"{name}: `{shlex.join(argv)}` has no budget"
    assert commands("a b && c \\\n  d  # e") == [["a", "b"], ["c", "d"]]


def test_the_entry_point_example_names_teamrls_group():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    tables = [tomllib.loads(text) for language, _, text in blocks(ROOT / "docs" / "environments.md")
              if language == "toml"]
    assert tables and all(ENVIRONMENT_GROUP in table["project"]["entry-points"] for table in tables)
