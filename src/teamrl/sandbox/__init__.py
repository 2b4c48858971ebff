"""Isolated execution of model-written code.

Model-written code is hostile: it never runs in the trainer's process. Each program runs in a
bubblewrap sandbox (no network, its own PID namespace, a read-only file system but for a private
scratch tmpfs and without third-party packages, a clean environment, no new user namespaces,
per-process resource limits, one memory cap and one CPU share for all its processes, a wall-clock
budget), in a fresh process per test that never holds a test: each test's trusted code runs in a
separate judge process that calls the program's functions by proxy, gets their results back as plain
data, and alone reports the outcome (see ``teamrl.sandbox._harness``; what a program can reach:
docs/sandbox.md). ``SandboxPool`` runs many programs concurrently.

    pool = SandboxPool()
    record = pool.run([Program(code, humaneval_tests(test, entry_point))])[0]
    record.passed, record.total, record.tests[0].message
"""

from teamrl.sandbox.bubblewrap import SandboxUnavailableError, find_bubblewrap
from teamrl.sandbox.limits import SandboxLimits
from teamrl.sandbox.program import RUN, Call, Program, humaneval_tests
from teamrl.sandbox.records import ABORTED, COMPLETED, TIMED_OUT, ExecutionRecord, RecordedCall, TestOutcome
from teamrl.sandbox.runner import SandboxError, SandboxPool, run_program

__all__ = [
    "ABORTED",
    "COMPLETED",
    "RUN",
    "TIMED_OUT",
    "Call",
    "ExecutionRecord",
    "Program",
    "RecordedCall",
    "SandboxError",
    "SandboxLimits",
    "SandboxPool",
    "SandboxUnavailableError",
    "TestOutcome",
    "find_bubblewrap",
    "humaneval_tests",
    "run_program",
]
