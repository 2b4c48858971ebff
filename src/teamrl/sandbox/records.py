"""What running a program produces: one outcome per test and a record for the whole program."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from teamrl.sandbox._harness import ProtocolError, decode

#: ``ExecutionRecord.status`` values.
COMPLETED = "completed"  # the driver reported every test (each may still have failed)
TIMED_OUT = "timed_out"  # the host's wall-clock deadline for the whole program passed
ABORTED = "aborted"  # the driver ended before reporting every test (the program killed it)


def _no_handle(body: object) -> None:
    raise ProtocolError("a recorded value holds a handle")


@dataclass(frozen=True)
class RecordedCall:
    """One call a test made of the program's recorded function (``Program.record``), or a direct call
    (``teamrl.sandbox.Call``), as the judge sent and received it.

    Attributes:
        args, kwargs: the arguments.
        result: what the call returned (None when it raised).
        raised: the call raised instead of returning.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any = None
    raised: bool = False


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
        calls: the calls of the program's recorded function this test made (``Program.record``), or
            the call a ``Call`` test made, as the judge wrote them; read them with :meth:`recorded_calls`.
        relayed: the calls of the program's relayed function (``Program.relay``) during this test, as
            the program reported them; read them with :meth:`relayed_calls`.
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
    calls: tuple[dict[str, Any], ...] = ()
    relayed: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestOutcome:
        """Build from ``to_dict`` output (or the driver's report); unknown keys are an error."""
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown TestOutcome fields: {sorted(unknown)}")
        return cls(**{**data, "calls": tuple(data.get("calls", ())), "relayed": tuple(data.get("relayed", ()))})

    def recorded_calls(self) -> tuple[RecordedCall, ...] | None:
        """The calls of :attr:`calls`, their values rebuilt; None when one of them could not be recorded
        (not plain data, or too many or too large to report)."""
        return _rebuilt(self.calls)

    def relayed_calls(self) -> tuple[RecordedCall, ...] | None:
        """The calls of :attr:`relayed` (arguments only), their values rebuilt; None when one of them could
        not be recorded."""
        return _rebuilt(self.relayed)


def _rebuilt(recorded: tuple[dict[str, Any], ...]) -> tuple[RecordedCall, ...] | None:
    """Recorded calls as the judge wrote them, their values rebuilt; None where one is not readable."""
    calls = []
    for call in recorded:
        try:
            args = decode(call["args"], _no_handle)
            kwargs = decode(call["kwargs"], _no_handle)
            result = decode(call["result"], _no_handle) if "result" in call else None
        except (KeyError, TypeError, ProtocolError):
            return None
        if not (isinstance(args, list) and isinstance(kwargs, dict)):
            return None
        calls.append(RecordedCall(tuple(args), kwargs, result, raised=call.get("raised") is True))
    return tuple(calls)


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
        cpu_time_s: CPU seconds all the program's processes used together, as its cgroup counted them
            (None without a cgroup that counts CPU time).
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
    cpu_time_s: float | None = None

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
