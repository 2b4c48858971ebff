"""Fixtures for the sandbox tests: a working bubblewrap, a pool over it, a stray-process check."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from teamrl.sandbox import SandboxLimits, SandboxPool, find_bubblewrap
from teamrl.sandbox.runner import _UID_BASE, _UID_SPAN

# Where the privileged (root-run) sandbox takes its fresh uids from.
SANDBOX_UIDS = range(_UID_BASE, _UID_BASE + _UID_SPAN)


@pytest.fixture(scope="session")
def bubblewrap():
    """The probed bubblewrap; skips only where it is not installed at all (a broken one fails)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    return find_bubblewrap()


@pytest.fixture(scope="session")
def fast_limits():
    """Limits that keep hostile programs quick to contain."""
    return SandboxLimits(test_timeout_s=2.0, program_timeout_s=6.0, cpu_time_s=2,
                         memory_bytes=256 << 20, max_output_bytes=4096)


@pytest.fixture(scope="module")
def pool(bubblewrap, fast_limits):
    """A two-worker pool with ``fast_limits``."""
    with SandboxPool(fast_limits, workers=2) as sandbox_pool:
        yield sandbox_pool


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"; comm may hold ")"


def _other_test_workers() -> set[int]:
    """The other pytest-xdist workers (this worker's siblings), whose own sandboxes may be running now."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return set()
    siblings = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(entry) != os.getpid() and _parent(int(entry)) == os.getppid():
                siblings.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return siblings


def _descends_from(pid: int, ancestors: set[int]) -> bool:
    try:
        while pid > 1:
            pid = _parent(pid)
            if pid in ancestors:
                return True
    except (OSError, IndexError, ValueError):  # exited meanwhile
        pass
    return False


def _sandbox_processes() -> list[int]:
    """Processes running as a sandbox uid, but for those of another test worker's sandboxes still at work. An
    escaped process (re-parented to init) is found whichever worker let it out."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                uid_line = next(line for line in status if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if int(uid_line.split()[1]) in SANDBOX_UIDS:
            found.append(int(entry))
    others = _other_test_workers() if found else set()
    return [pid for pid in found if not _descends_from(pid, others)]


@pytest.fixture
def no_stray_processes(bubblewrap):
    """After the test, no process running as a sandbox uid may be left on the host."""
    yield
    deadline = time.monotonic() + 2.0  # processes being torn down may take a moment
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []
