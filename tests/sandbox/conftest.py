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


def _sandbox_processes() -> list[int]:
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
    return found


@pytest.fixture
def sandbox_processes():
    """A function listing the pids of processes running as a sandbox user on the host."""
    return _sandbox_processes


@pytest.fixture
def no_stray_processes(bubblewrap):
    """After the test, no process running as a sandbox uid may be left on the host."""
    yield
    deadline = time.monotonic() + 2.0  # processes being torn down may take a moment
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_processes() == []
