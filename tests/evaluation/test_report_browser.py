"""report.html as a person sees it: rendered by headless Chromium, and the screenshot checked pixel by pixel.

Needs Debian's ``chromium`` (scripts/test.sh installs it). Without it the test fails, saying how to
install it; ``TEAMRL_SKIP_BROWSER=1`` skips it instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from teamrl.evaluation.report import HEADER_COLOUR, read_history, render_html, write_report

WIDTH, HEIGHT = 1200, 1600
#: Without these flags Chromium waits on the network (closed here) or on a sandbox root cannot use.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
BAR_COLOUR = "#1f77b4"  # matplotlib's first colour: the normalised-return bars of methods.png

pytestmark = pytest.mark.skipif(os.environ.get("TEAMRL_SKIP_BROWSER") == "1", reason="TEAMRL_SKIP_BROWSER=1")


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: run scripts/test.sh (it installs it) or apt-get install -y chromium; "
                    "set TEAMRL_SKIP_BROWSER=1 to skip this test")
    return path


def screenshot(page: Path, tmp_path: Path) -> np.ndarray:
    """The page rendered at WIDTH x HEIGHT, as an (H, W, 3) array of 0..255."""
    png = tmp_path / f"{page.stem}.png"
    result = subprocess.run([chromium(), *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                             f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={png}", page.resolve().as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and png.is_file(), result.stderr[-2000:]
    return np.round(imread(png)[..., :3] * 255)


def pixels_of(image: np.ndarray, colour: str) -> int:
    """How many pixels are ``colour`` (``#rrggbb``), give or take anti-aliasing."""
    rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int(np.all(np.abs(image - rgb) <= 12, axis=-1).sum())


def test_report_renders_its_tables_and_plots(tiny_eval, tmp_path):
    files = write_report(tiny_eval.results, tmp_path / "eval", read_history(tiny_eval.run_dir))
    bare = tmp_path / "bare.html"
    bare.write_text(render_html(tiny_eval.results, {}))  # the same report without its plots

    full, plain = screenshot(files["report.html"], tmp_path), screenshot(bare, tmp_path)
    assert full.shape == plain.shape == (HEIGHT, WIDTH, 3)
    for image in (full, plain):
        ink = np.any(image < 200, axis=-1)
        assert 0.02 < ink.mean() < 0.6  # text and tables on a white page: not blank, not a solid fill
        assert pixels_of(image, HEADER_COLOUR) > 5_000  # the header rows of the results tables
        assert pixels_of(image, "#ffffff") > 0.3 * WIDTH * HEIGHT
    assert pixels_of(full, BAR_COLOUR) > 2_000  # the bars of the methods plot
    assert pixels_of(plain, BAR_COLOUR) < 50
    assert np.abs(full - plain).mean() > 1.0
