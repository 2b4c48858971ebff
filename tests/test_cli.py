"""The command line answers at once where it can, says its version, and keeps libraries' noise off."""

from __future__ import annotations

import subprocess
import sys

import teamrl
from teamrl.cli import main

HEAVY = ("torch", "transformers", "peft", "fastapi", "uvicorn")


def test_help_presets_config_and_envs_import_neither_torch_nor_transformers():
    # What takes seconds to import must not be imported by commands that never need a model (nor a web server).
    script = f"""
import sys
from teamrl.cli import main
for argv in (["--help"], ["train", "--help"], ["serve", "--help"], ["presets"], ["config"], ["envs"]):
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    assert code == 0, (argv, code)
print(sorted(name for name in {HEAVY!r} if name in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
    assert "tiny_digit_sum" in result.stdout and "digit_sum" in result.stdout
    assert "algorithm.num_generations" in result.stdout


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit:
        assert exit.code == 0
    assert capsys.readouterr().out == f"teamrl {teamrl.__version__}\n"


def test_library_noise_is_off_unless_verbose(tiny_config, tmp_path):
    from teamrl.train import Trainer

    team = Trainer(tiny_config(steps=1)).save_team(tmp_path / "team")
    # --threads: nothing to say about a machine other work keeps busy (tests/test_runtime.py)
    command = [sys.executable, "-m", "teamrl.cli", "generate", str(team), "--split", "eval", "--limit", "1",
               "--threads", "1"]
    quiet = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "", quiet.stderr  # no loading bars, no FutureWarnings: only teamrl's report, on stdout
    verbose = subprocess.run([*command, "--verbose"], capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0, verbose.stderr
    # the libraries' own output, kept
    assert "Warning" in verbose.stderr or "it/s" in verbose.stderr, verbose.stderr
    assert verbose.stdout.count("joint reward") == quiet.stdout.count("joint reward") == 1


def test_presets_lists_each_preset_with_a_whole_sentence(capsys):
    import re

    from teamrl.config import presets

    assert main(["presets"]) == 0
    # One entry per preset: its name, then its text, wrapped onto indented lines.
    entries = dict(entry.split(None, 1) for entry in re.split(r"\n(?=\S)", capsys.readouterr().out.strip()))
    assert sorted(entries) == presets()
    for name, text in entries.items():
        text = " ".join(text.split())
        assert text.endswith(".") and text.count("(") == text.count(")"), (name, text)  # no sentence cut short


def test_serve_refuses_a_folder_that_is_not_a_saved_team(tmp_path, capsys):
    # Before any model loads or any port is taken: one line saying what to give.
    assert main(["serve", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a saved team (no team.json)" in err and "RUN_DIR/team" in err


def test_a_reader_that_stops_early_gets_no_traceback():
    # `teamrl presets | head -1`: the pipe closes while teamrl still writes.
    result = subprocess.run(f"{sys.executable} -m teamrl.cli presets | head -1", shell=True, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.count("\n") == 1 and result.stderr == "", result.stderr
