"""The README's Python example runs as written and the team it trains learns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_example_trains_a_team(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no Python example"
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    before, after = map(float, re.search(r"held-out joint reward ([\d.]+) -> ([\d.]+)", printed).groups())
    assert after > before + 0.5
    assert (tmp_path / "runs/readme/team/team.json").exists()


def test_readme_commands_point_at_files_that_exist():
    text = README.read_text()
    assert "bash scripts/test.sh" in text
    main_job = re.findall(r"```bash\n(.*?)```", text, flags=re.S)[0]  # the first command: the main job
    assert main_job.strip().endswith("teamrl demo"), main_job
    from teamrl.config import presets

    for name in re.findall(r"teamrl train (\w+)", text):
        assert name in presets() or name == "CONFIG", name
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci


def test_readme_names_every_shipped_preset_and_no_other():
    from teamrl.config import presets

    paragraph = re.search(r"^Shipped presets: (.*?)\n\n", README.read_text(), flags=re.S | re.M).group(1)
    assert paragraph.rstrip().endswith("."), paragraph  # a whole sentence
    assert sorted(re.findall(r"`(\w+)`", paragraph)) == presets()
