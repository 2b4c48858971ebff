"""Resource limits for one sandboxed program."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class SandboxLimits:
    """What one program may use. Process limits are ``setrlimit`` values applied to every test process.

    Attributes:
        test_timeout_s: wall-clock seconds one test (loading the program + running the snippet) may take.
        program_timeout_s: wall-clock budget for all tests of a program; tests not started when it runs
            out fail as timed out. The host kills the whole sandbox at this budget plus a short grace.
        cpu_time_s: CPU seconds per process (RLIMIT_CPU; SIGXCPU at this, SIGKILL one second later).
        memory_bytes: address space per process (RLIMIT_AS). Python raises MemoryError beyond it.
        total_memory_bytes: memory all the processes of one program may hold together, the sandbox's
            scratch files included: a memory cgroup per sandbox where one can be made, else each
            process's address space is cut to ``total_memory_bytes // max_processes`` (see
            ``teamrl.sandbox.cgroups``).
        cpu_cores: CPU time all the processes of one program may use together per second of wall time
            (in cores; the rest of the machine is the other sandboxes' and the trainer's): a cpu cgroup
            per sandbox where one can be made, else the sandbox is pinned to ``ceil(cpu_cores)`` cores
            (see ``teamrl.sandbox.cgroups``).
        max_processes: processes and threads the sandbox user may have at once (RLIMIT_NPROC),
            the sandbox's own four (driver, program server, judge, program process) included; this
            is what stops fork bombs.
        max_file_bytes: largest file a process may write (RLIMIT_FSIZE).
        max_open_files: open file descriptors per process (RLIMIT_NOFILE).
        scratch_bytes: size of the private writable scratch directory (a tmpfs; bubblewrap only).
        max_output_bytes: bytes of stdout and of stderr kept in the record (the rest is read and dropped).
        max_message_chars: longest error message / expected / actual text kept per test.
    """

    test_timeout_s: float = 3.0
    program_timeout_s: float = 10.0
    cpu_time_s: int = 3
    memory_bytes: int = 1 << 30
    total_memory_bytes: int = 1 << 30
    cpu_cores: float = 1.0
    max_processes: int = 16
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    scratch_bytes: int = 64 << 20
    max_output_bytes: int = 8 << 10
    max_message_chars: int = 300

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            kinds = (int, float) if field.type == "float" else int  # annotations are strings here
            if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
                raise ValueError(f"SandboxLimits.{field.name} must be a positive number, got {value!r}")
        if self.program_timeout_s < self.test_timeout_s:
            raise ValueError(
                f"SandboxLimits.program_timeout_s ({self.program_timeout_s}) must be at least "
                f"test_timeout_s ({self.test_timeout_s})"
            )
        if self.max_processes < 5:
            raise ValueError(
                f"SandboxLimits.max_processes must be at least 5 (the driver, the program server, a "
                f"judge, a program process and one spare), got {self.max_processes}"
            )

    @property
    def split_memory_bytes(self) -> int:
        """Each process's address space when no cgroup caps the total: the total over the processes."""
        return min(self.memory_bytes, self.total_memory_bytes // self.max_processes)

    def to_dict(self) -> dict[str, float | int]:
        """The limits as a JSON-serialisable dict (what the in-sandbox driver receives)."""
        return asdict(self)
