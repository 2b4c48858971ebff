"""What running a program produces: one outcome per test and a record for the whole program."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: ``ExecutionRecord.status`` values.
COMPLETED = "completed"  # the driver reported every test (each may still have failed)
TIMED_OUT = "timed_out"  # the host's wall-clock deadline for the whole program passed
ABORTED = "aborted"  # the driver ended before reporting every test (the program killed it)


@dataclass(frozen=True)
class TestOutcome:
    """How one test snippet went.

    Attributes:
        index: position of the test in the program's test list.
        passed: the snippet ran to the end without raising.
        error_type: exception class name; or ``Timeout``, ``Killed`` (the program process, by a
            signal), ``NoResult`` (the program process exited without answering, e.g. ``os._exit``,
            or answered with something that is not a reply), ``NotRun`` (the sandbox, or its program
            server, ended before this test).
        message: the exception message; for a failed comparison assert, ``expected A == B`` text.
        expected, actual: ``repr`` of the two sides of a failed comparison assert (``actual`` is the
            side that calls the program).
        phase: ``program`` when loading the program failed (then every test fails the same way),
            ``test`` when the snippet failed.
        line: line of the joined program where the error was raised, when it was in the program.
        timed_out: the test hit its wall-clock limit.
        signal: name of the signal that killed the test process (``SIGKILL``, ``SIGSEGV``...).
        limit: the resource limit that stopped it, when one did: ``wall_time``, ``cpu_time``,
            ``memory`` (MemoryError, or a process killed for the program's total memory cap),
            ``file_size`` (EFBIG), ``processes`` (fork failed with EAGAIN).
        duration_s: wall time of the test, program loading included.
        opaque_results: type names of the objects that calls into the program returned to the test
            as opaque handles (not plain data), in order, at most 8; the type name is the program's
            word (a program can name its class ``int``).
    """

    __test__ = False  # not a pytest test class despite the name

    index: int
    passed: bool
    error_type: str | None = None
    message: str | None = None
    expected: str | None = None
    actual: str | None = None
    phase: str | None = None
    line: int | None = None
    timed_out: bool = False
    signal: str | None = None
    limit: str | None = None
    duration_s: float = 0.0
    opaque_results: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestOutcome:
        """Build from ``to_dict`` output (or the driver's report); unknown keys are an error."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown TestOutcome fields: {sorted(unknown)}")
        return cls(**{**data, "opaque_results": tuple(data.get("opaque_results", ()))})


@dataclass(frozen=True)
class ExecutionRecord:
    """The result of running one program against its tests.

    Attributes:
        tests: one outcome per test, in order (always ``len(program.tests)`` of them).
        status: ``completed``, ``timed_out`` or ``aborted`` (see the module constants).
        exit_code: exit status of the sandbox process (negative: killed by that signal).
        stdout, stderr: what the program printed, truncated to ``max_output_bytes`` each.
        stdout_truncated, stderr_truncated: whether output was dropped.
        wall_time_s: wall time of the whole run, sandbox start-up included.
        sandboxed: False when the program ran without bubblewrap (``allow_unsandboxed``).
        memory_peak_bytes: most memory all the program's processes held at once, as its memory
            cgroup measured it (None without a cgroup, see ``teamrl.sandbox.cgroups``).
    """

    tests: tuple[TestOutcome, ...]
    status: str
    exit_code: int | None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0
    sandboxed: bool = True
    memory_peak_bytes: int | None = None

    @property
    def passed(self) -> int:
        """Number of tests that passed."""
        return sum(outcome.passed for outcome in self.tests)

    @property
    def total(self) -> int:
        """Number of tests."""
        return len(self.tests)

    @property
    def all_passed(self) -> bool:
        """Every test passed (False for a program without tests)."""
        return self.total > 0 and self.passed == self.total

    @property
    def timed_out(self) -> bool:
        """The program or any of its tests ran out of wall-clock time."""
        return self.status == TIMED_OUT or any(outcome.timed_out for outcome in self.tests)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``json.dumps`` works on it as is)."""
        data = asdict(self)
        data["tests"] = [asdict(outcome) for outcome in self.tests]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExecutionRecord:
        """Inverse of ``to_dict``."""
        fields = dict(data)
        fields["tests"] = tuple(TestOutcome.from_dict(outcome) for outcome in data["tests"])
        return cls(**fields)
