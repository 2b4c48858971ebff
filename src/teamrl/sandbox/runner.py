"""Run programs in the sandbox: one at a time (``run_program``) or many at once (``SandboxPool``)."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import py_compile
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from teamrl.sandbox.asserts import rewrite_asserts, standard_modules_read
from teamrl.sandbox.bubblewrap import (
    SCRATCH_DIR,
    Bubblewrap,
    SandboxUnavailableError,
    bwrap_command,
    find_bubblewrap,
    package_dirs,
    python_interpreter,
    python_roots,
)
from teamrl.sandbox.cgroups import CgroupFactory, SandboxCgroup, sandbox_cgroups
from teamrl.sandbox.limits import SandboxLimits
from teamrl.sandbox.program import Call, Program
from teamrl.sandbox.records import ABORTED, COMPLETED, TIMED_OUT, ExecutionRecord, TestOutcome
from teamrl.sandbox.seccomp import SeccompUnavailableError, filter_descriptor, syscall_filter

_log = logging.getLogger("teamrl.sandbox")

_HARNESS = Path(__file__).with_name("_harness.py")
#: Where the sandbox sees the compiled driver (a read-only bind of the host's compiled copy).
HARNESS_IN_SANDBOX = "/teamrl/harness.pyc"
# The host's own deadline is the program budget plus this, so the driver's own accounting
# (which marks unfinished tests precisely) normally wins.
_GRACE_S = 2.0
# After the sandbox process exits, how long to keep reading pipes that something else still holds
# open (only possible without bubblewrap, where a detached process can outlive the driver).
_STRAGGLER_S = 0.5
_MAX_RESULT_BYTES = 4 << 20
# Fresh unprivileged uids for root-run sandboxes: one per run, so RLIMIT_NPROC counts only that run.
_UID_BASE, _UID_SPAN = 1 << 30, 1 << 24


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it): e.g. the driver never started."""


@dataclass(frozen=True)
class _Backend:
    bwrap: Bubblewrap | None  # None: unsandboxed, by the user's explicit choice
    roots: tuple[str, ...]
    hidden: tuple[str, ...] = ()  # site-/dist-packages directories the sandbox replaces by empty ones
    seccomp: bytes | None = None  # the system calls refused to graded code (teamrl.sandbox.seccomp)
    cgroups: CgroupFactory | None = None  # None: the memory cap is split over the processes


def _resolve_backend(allow_unsandboxed: bool) -> _Backend:
    cgroups = _sandbox_cgroups()
    try:
        bwrap, roots = find_bubblewrap(), python_roots()
    except SandboxUnavailableError as error:
        if not allow_unsandboxed:
            raise
        _log.warning(
            "Running model-written code WITHOUT a sandbox because allow_unsandboxed=True (%s). Programs "
            "get resource limits and a clean environment only: they can read and write your files, "
            "reach the network, signal your processes and so forge their own test results.", error)
        return _Backend(None, (), cgroups=cgroups)
    return _Backend(bwrap, roots, package_dirs(roots), _seccomp_filter(bwrap), cgroups)


@functools.cache
def _sandbox_cgroups() -> CgroupFactory | None:
    factory = sandbox_cgroups()
    if factory is None:
        _log.info("no writable memory cgroup: each sandboxed process gets total_memory_bytes / max_processes "
                  "of address space instead (see teamrl.sandbox.cgroups)")
    if factory is None or factory.cpu is None:
        _log.info("no cpu cgroup: each sandbox is pinned to cpu_cores cores instead (see teamrl.sandbox.cgroups)")
    return factory


class _Cores:
    """Deals out this process's cores to sandboxes pinned by affinity (no cpu cgroup), in turn."""

    def __init__(self) -> None:
        self.cores = sorted(os.sched_getaffinity(0))
        self._next = itertools.count()
        self._lock = threading.Lock()

    def pin(self, count: int) -> list[str]:
        """``taskset`` arguments that run a command on ``count`` of the cores (all, if fewer), or nothing
        where ``taskset`` is missing (then no CPU cap applies, and the runner says so once)."""
        taskset = _taskset()
        if taskset is None:
            return []
        with self._lock:
            start = next(self._next)
        chosen = [self.cores[(start + offset) % len(self.cores)] for offset in range(min(count, len(self.cores)))]
        return [taskset, "-c", ",".join(map(str, sorted(chosen)))]


@functools.cache
def _taskset() -> str | None:
    path = shutil.which("taskset")
    if path is None:
        _log.warning("neither a cpu cgroup nor `taskset` (util-linux) here: a sandboxed program may use every "
                     "core; install util-linux or run with a cpu cgroup (see teamrl.sandbox.cgroups)")
    return path


_CORES = _Cores()


def _seccomp_filter(bwrap: Bubblewrap) -> bytes | None:
    try:
        return syscall_filter()
    except SeccompUnavailableError as error:
        if bwrap.privileged or not bwrap.supports_disable_userns:
            # Nothing else would stop graded code from creating user namespaces.
            raise SandboxUnavailableError(str(error)) from None
        _log.info("%s; bubblewrap's --disable-userns keeps user namespaces out of the sandbox", error)
        return None


def _environment(home: str) -> dict[str, str]:
    # Nothing of the trainer's environment (tokens, keys) is passed on. One BLAS/OpenMP thread:
    # numeric libraries otherwise start a thread per core and run into RLIMIT_NPROC.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home,
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Collector:
    """Feed the payload to the driver and read its three output pipes, each with a size cap."""

    def __init__(self, proc: subprocess.Popen, result_fd: int, payload: bytes, limits: SandboxLimits):
        self.proc = proc
        self.selector = selectors.DefaultSelector()
        self.payload, self.written = payload, 0
        self.data = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray()}
        self.caps = {"stdout": limits.max_output_bytes, "stderr": limits.max_output_bytes,
                     "results": _MAX_RESULT_BYTES}
        self.dropped = {"stdout": 0, "stderr": 0, "results": 0}
        for name, fd in (("stdout", proc.stdout.fileno()), ("stderr", proc.stderr.fileno()),
                         ("results", result_fd), ("stdin", proc.stdin.fileno())):
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_WRITE if name == "stdin" else selectors.EVENT_READ, name)

    def run(self, deadline: float) -> bool:
        """Collect until every pipe is closed or ``deadline``; True when the deadline passed."""
        exited_at = None
        while self.selector.get_map():
            now = time.monotonic()
            if now >= deadline:
                return True
            if exited_at is None and self.proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > _STRAGGLER_S:
                return False
            for key, _ in self.selector.select(min(deadline - now, 0.25)):
                if key.data == "stdin":
                    self._write(key.fd)
                else:
                    self._read(key.fd, key.data)
        return False

    def _write(self, fd: int) -> None:
        try:
            self.written += os.write(fd, self.payload[self.written:self.written + (1 << 16)])
        except BrokenPipeError:
            self.written = len(self.payload)
        if self.written >= len(self.payload):
            self.selector.unregister(fd)
            self.proc.stdin.close()

    def _read(self, fd: int, name: str) -> None:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.selector.unregister(fd)
            return
        room = self.caps[name] - len(self.data[name])
        self.data[name] += chunk[:max(room, 0)]
        self.dropped[name] += max(len(chunk) - max(room, 0), 0)

    def close(self) -> None:
        """Unregister everything still open."""
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fd)
        self.selector.close()


def _parse_results(data: bytes, n_tests: int) -> tuple[bool, list[TestOutcome], bool]:
    """Read the driver's framed lines: (ready seen, outcomes in order, done seen).

    Only the trusted driver writes this pipe; anything out of protocol (a line cut short when the
    sandbox was killed) ends the parse, and the tests not reported are filled in by the caller.
    """
    ready, outcomes = False, []
    for line in data.split(b"\n"):
        try:
            message = json.loads(line)
        except ValueError:
            break
        if not ready:
            if message != {"ready": True}:
                break
            ready = True
        elif message == {"done": True}:
            return ready, outcomes, len(outcomes) == n_tests
        elif isinstance(message, dict) and message.get("index") == len(outcomes) < n_tests:
            outcomes.append(TestOutcome.from_dict(message))
        else:
            break
    return ready, outcomes, False


def _not_run(index: int, status: str) -> TestOutcome:
    reason = {TIMED_OUT: "the program's wall-clock deadline passed before this test reported",
              ABORTED: "the sandbox ended before this test reported (the program killed the test driver)"}
    return TestOutcome(index=index, passed=False, error_type="NotRun", message=reason[status],
                       timed_out=status == TIMED_OUT, limit="wall_time" if status == TIMED_OUT else None)


@functools.cache
def _compiled_harness() -> str:
    """The driver compiled once per process into a private directory (a sandbox would otherwise compile its
    ~40 kB of source at every start), removed at exit."""
    directory = tempfile.mkdtemp(prefix="teamrl-harness-")
    os.chmod(directory, 0o755)  # the sandbox's unprivileged user reads it
    compiled = os.path.join(directory, "harness.pyc")
    py_compile.compile(str(_HARNESS), cfile=compiled, dfile="teamrl-sandbox-harness", doraise=True)
    os.chmod(compiled, 0o644)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return compiled


def _command(backend: _Backend, limits: SandboxLimits, result_fd: int, seccomp_fd: int | None) -> list[str]:
    # -S: no site module, so no .pth start-up hooks of the host run in the sandbox (and start-up is
    # several times faster), and no third-party package is importable there. The interpreter is the
    # one python_roots() binds, which find_bubblewrap() tried.
    compiled, python = _compiled_harness(), python_interpreter()
    if backend.bwrap is None:
        return [python, "-I", "-S", compiled, str(result_fd), "-1", "-1", "0"]
    uid = _UID_BASE + secrets.randbelow(_UID_SPAN) if backend.bwrap.privileged else -1
    sandbox = bwrap_command(backend.bwrap, limits.scratch_bytes, backend.roots, hidden=backend.hidden,
                            binds=((compiled, HARNESS_IN_SANDBOX),), seccomp_fd=seccomp_fd)
    return sandbox + [python, "-I", "-S", HARNESS_IN_SANDBOX, str(result_fd), str(uid), str(uid), "1"]


def _create_cgroup(backend: _Backend, limits: SandboxLimits) -> SandboxCgroup | None:
    """This program's cgroup; None without cgroups, or when the kernel refuses one (then the memory cap
    is split over the processes and the CPU share kept by affinity for this program, as without cgroups)."""
    if backend.cgroups is None:
        return None
    try:
        return backend.cgroups.create(limits.total_memory_bytes, limits.cpu_cores)
    except OSError as error:
        _log.warning("could not create a cgroup for a sandbox (%s); splitting its memory cap instead", error)
        return None


def _driver_limits(limits: SandboxLimits, cgroup: SandboxCgroup | None) -> dict[str, float | int]:
    """The per-process limits the driver applies: with no cgroup to cap the total, the total split."""
    values = limits.to_dict()
    if cgroup is None:
        values["memory_bytes"] = limits.split_memory_bytes
    return values


def _memory_kills(outcomes: list[TestOutcome], limits: SandboxLimits) -> list[TestOutcome]:
    """Outcomes of processes the cgroup's cap killed (SIGKILL, no other limit), marked as such."""
    note = f" (the program's memory cap of {limits.total_memory_bytes} bytes for all its processes)"
    return [dataclasses.replace(o, limit="memory", message=(o.message or "") + note)
            if o.signal == "SIGKILL" and o.limit is None else o for o in outcomes]


def _end(proc: subprocess.Popen, grace_s: float) -> None:
    """Let the sandbox process exit on its own for ``grace_s``, then kill its process group; reap it."""
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        # Not reaped yet, so its process group id cannot have been reused by someone else.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()


def _execute(program: Program, limits: SandboxLimits, backend: _Backend) -> ExecutionRecord:
    started = time.monotonic()
    tests = [test.payload() if isinstance(test, Call) else rewrite_asserts(test) for test in program.tests]
    modules = [() if isinstance(test, Call) else standard_modules_read(test) for test in program.tests]
    cgroup = _create_cgroup(backend, limits)
    payload = json.dumps({"code": program.code, "setup": program.setup, "tests": tests, "modules": modules,
                          "limits": _driver_limits(limits, cgroup), "sys_path": [], "relay": program.relay,
                          "record": program.record})
    scratch_dir = tempfile.TemporaryDirectory(prefix="teamrl-unsandboxed-") if backend.bwrap is None \
        else contextlib.nullcontext()  # bubblewrap provides the scratch directory itself
    try:
        with scratch_dir as scratch:
            proc, collector, timed_out = _run_sandbox(backend, limits, cgroup, payload, scratch, started)
        memory_peak = cgroup.peak_bytes() if cgroup is not None else None
        cpu_time = cgroup.cpu_seconds() if cgroup is not None else None
        memory_kills = cgroup.oom_kills() if cgroup is not None else 0
    finally:
        if cgroup is not None:
            backend.cgroups.release(cgroup)
    ready, outcomes, done = _parse_results(bytes(collector.data["results"]), len(program.tests))
    stderr = bytes(collector.data["stderr"]).decode(errors="replace")
    if not ready:
        raise SandboxError(f"the sandbox did not start (exit status {proc.returncode}): {stderr.strip()!r}")
    status = COMPLETED if done else TIMED_OUT if timed_out else ABORTED
    outcomes += [_not_run(index, status) for index in range(len(outcomes), len(program.tests))]
    if memory_kills:
        outcomes = _memory_kills(outcomes, limits)
    return ExecutionRecord(
        tests=tuple(outcomes), status=status, exit_code=proc.returncode,
        stdout=bytes(collector.data["stdout"]).decode(errors="replace"), stderr=stderr,
        stdout_truncated=collector.dropped["stdout"] > 0, stderr_truncated=collector.dropped["stderr"] > 0,
        wall_time_s=round(time.monotonic() - started, 4), sandboxed=backend.bwrap is not None,
        memory_peak_bytes=memory_peak, cpu_time_s=round(cpu_time, 4) if cpu_time is not None else None)


def _run_sandbox(backend: _Backend, limits: SandboxLimits, cgroup: SandboxCgroup | None, payload: str,
                 scratch: str | None, started: float) -> tuple[subprocess.Popen, _Collector, bool]:
    """Start the sandbox (in ``cgroup``), feed it the payload, collect its output until it ends or the
    program's budget (plus a grace) is spent; (process, collector, whether the deadline passed)."""
    result_r, result_w = os.pipe()
    seccomp_fd = filter_descriptor(backend.seccomp) if backend.seccomp is not None else None
    passed = (result_w,) if seccomp_fd is None else (result_w, seccomp_fd)
    command = _command(backend, limits, result_w, seccomp_fd)
    if cgroup is None or not cgroup.cpu_capped:
        command = _CORES.pin(math.ceil(limits.cpu_cores)) + command
    try:
        proc = subprocess.Popen(
            cgroup.wrap(command) if cgroup is not None else command, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=passed,
            env=_environment(scratch or SCRATCH_DIR), cwd=scratch, start_new_session=True)
    except BaseException:
        os.close(result_r)
        raise
    finally:
        for fd in passed:
            os.close(fd)
    collector = _Collector(proc, result_r, payload.encode(), limits)
    timed_out = True
    try:
        timed_out = collector.run(started + limits.program_timeout_s + _GRACE_S)
    finally:
        collector.close()
        _end(proc, grace_s=0.0 if timed_out else _STRAGGLER_S)
        os.close(result_r)
    return proc, collector, timed_out


def run_program(program: Program, limits: SandboxLimits | None = None, *,
                allow_unsandboxed: bool = False) -> ExecutionRecord:
    """Run one program's tests in a fresh sandbox and return its record.

    Raises:
        SandboxUnavailableError: bubblewrap is missing or unusable and ``allow_unsandboxed`` is False.
        SandboxError: the sandbox failed to start (an infrastructure fault, not the program's).
    """
    return _execute(program, limits or SandboxLimits(), _resolve_backend(allow_unsandboxed))


class SandboxPool:
    """Runs many programs concurrently, each in its own sandbox, with a fixed number of workers.

    Each worker thread drives one sandbox process at a time (the threads only wait on pipes; the
    work happens in the sandboxed processes), so ``workers`` is how many programs run at once;
    the default is one per CPU core.

    Args:
        limits: resource limits for every program (defaults: ``SandboxLimits()``).
        workers: concurrent sandboxes; default ``os.cpu_count()``.
        allow_unsandboxed: where bubblewrap is unavailable, run programs as plain subprocesses with
            resource limits only (logged as a warning) instead of raising ``SandboxUnavailableError``.
    """

    def __init__(self, limits: SandboxLimits | None = None, workers: int | None = None, *,
                 allow_unsandboxed: bool = False):
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"SandboxPool workers must be a positive int, got {workers!r}")
        self.limits = limits or SandboxLimits()
        self.workers = workers or os.cpu_count() or 1
        self._backend = _resolve_backend(allow_unsandboxed)
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="teamrl-sandbox")

    @property
    def sandboxed(self) -> bool:
        """Whether programs run inside bubblewrap (False only with ``allow_unsandboxed``)."""
        return self._backend.bwrap is not None

    def submit(self, program: Program) -> Future[ExecutionRecord]:
        """Schedule one program; the future's result is its ``ExecutionRecord``."""
        return self._executor.submit(_execute, program, self.limits, self._backend)

    def run(self, programs: Iterable[Program]) -> list[ExecutionRecord]:
        """Run programs concurrently; records come back in the order of ``programs``."""
        futures = [self.submit(program) for program in programs]
        return [future.result() for future in futures]

    def close(self) -> None:
        """Wait for running programs and stop the workers."""
        self._executor.shutdown(wait=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
