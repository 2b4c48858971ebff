"""The trusted test driver that runs *inside* the sandbox (stdlib only; the trainer never runs it).

The host starts it as ``python -I -S -c <this file's source> RESULT_FD UID GID SANDBOXED`` and
writes one JSON payload ``{"code", "tests", "limits", "site_dirs"}`` to its stdin. Protocol on
RESULT_FD (a pipe only this process holds; one JSON object per line):

    {"ready": true}                      privileges dropped, payload read, before any model code runs
    {"index": i, "passed": ..., ...}     one line per test, in order
    {"done": true}                       every test reported

Why a process per test: model-written code can do anything its own process can do (``os._exit``,
closing or writing any descriptor it holds, patching modules), so each test runs in a forked child
that holds only a private pipe for its own outcome. The child closes RESULT_FD before any model code
runs, and this driver makes itself non-dumpable so no child can reopen the driver's descriptors through
``/proc/<pid>/fd`` or attach to it. A program can therefore at worst decide its *own* test's outcome
(which in-process code can always do), never another test's, never the record's framing, and never by
printing: the program's stdout/stderr are separate pipes the host only stores.
"""

import builtins
import json
import os
import re
import resource
import select
import signal
import sys
import time

_PR_SET_DUMPABLE = 4
_COMPARE_MARKER = "teamrl-compare"  # must equal teamrl.sandbox.asserts.COMPARE_MARKER
# Cheap standard modules imported before forking when the program imports them, so each test
# process inherits them instead of importing them again (third-party modules never: they would
# run in this driver, outside the test's resource limits).
_PRELOADABLE = {"typing", "math", "collections", "itertools", "functools", "heapq", "bisect", "string",
                "hashlib", "operator", "fractions", "decimal", "statistics"}
_IMPORTED = re.compile(r"^[ \t]*(?:from|import)[ \t]+([A-Za-z_]\w*)", re.MULTILINE)
_OUTCOME_KEYS = {"passed": bool, "error_type": str, "message": str, "expected": str, "actual": str,
                 "phase": str, "limit": str, "line": int}
_MAX_OUTCOME_BYTES = 1 << 16


def _safe_repr(value, limit):
    try:
        text = repr(value)
    except BaseException as error:  # a hostile __repr__ must not hide the failure itself
        text = "<repr failed: %s>" % type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _classify_exception(error):
    if isinstance(error, MemoryError):
        return "memory"
    if isinstance(error, OSError) and error.errno == 27:  # EFBIG: RLIMIT_FSIZE (Python ignores SIGXFSZ)
        return "file_size"
    if isinstance(error, BlockingIOError):  # EAGAIN from fork/spawn under RLIMIT_NPROC
        return "processes"
    return None


def describe_failure(error, phase, limit):
    """The outcome dict for a test that raised ``error`` (any BaseException, SystemExit included)."""
    outcome = {"passed": False, "error_type": type(error).__name__, "phase": phase}
    args = getattr(error, "args", ())
    if isinstance(error, AssertionError) and len(args) == 6 and args[0] == _COMPARE_MARKER:
        _, left, right, operator, message, left_is_actual = args
        left, right = _safe_repr(left, limit), _safe_repr(right, limit)
        outcome["actual"], outcome["expected"] = (left, right) if left_is_actual else (right, left)
        if operator == "==":
            detail = "expected %s, got %s" % (outcome["expected"], outcome["actual"])
        else:
            detail = "%s %s %s is false" % (left, operator, right)
        outcome["message"] = (_safe_repr(message, limit) + ": " + detail) if message is not None else detail
    else:
        try:
            outcome["message"] = str(error)[:limit]
        except BaseException:
            outcome["message"] = "<str failed>"
    kind = _classify_exception(error)
    if kind:
        outcome["limit"] = kind
    line = _program_line(error)
    if line is not None:
        outcome["line"] = line
    return outcome


def _program_line(error):
    """The line of the program where ``error`` was raised (or, for a SyntaxError, found), if any."""
    if isinstance(error, SyntaxError) and error.filename == "<program>":
        return error.lineno
    line, traceback = None, error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<program>":
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    return line


def run_test(code, test, index, limit):
    """Load the program and run one test snippet in a fresh namespace; return the outcome dict."""
    namespace = {"__name__": "__teamrl_program__", "__builtins__": builtins}
    phase = "program"
    try:
        exec(compile(code, "<program>", "exec"), namespace)
        phase = "test"
        exec(compile(test, "<test %d>" % index, "exec"), namespace)
    except BaseException as error:  # SystemExit and KeyboardInterrupt are failures too
        return describe_failure(error, phase, limit)
    return {"passed": True}


def _set_limits(limits):
    cpu = int(limits["cpu_time_s"])
    for kind, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1),
                             (resource.RLIMIT_AS, limits["memory_bytes"], limits["memory_bytes"]),
                             (resource.RLIMIT_NPROC, limits["max_processes"], limits["max_processes"]),
                             (resource.RLIMIT_FSIZE, limits["max_file_bytes"], limits["max_file_bytes"]),
                             (resource.RLIMIT_NOFILE, limits["max_open_files"], limits["max_open_files"]),
                             (resource.RLIMIT_CORE, 0, 0)):
        _, current_hard = resource.getrlimit(kind)
        if current_hard != resource.RLIM_INFINITY:  # an unprivileged process cannot raise its hard limit
            soft, hard = min(soft, current_hard), min(hard, current_hard)
        resource.setrlimit(kind, (soft, hard))


def _child(code, test, index, limits, write_fd, result_fd):
    """Body of a forked test process: never returns."""
    me = os.getpid()
    try:
        os.close(result_fd)
        os.setpgid(0, 0)
        _set_limits(limits)
        outcome = run_test(code, test, index, limits["max_message_chars"])
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        if os.getpid() == me:  # processes the program forked also return here; only the test reports
            os.write(write_fd, json.dumps(outcome).encode()[:_MAX_OUTCOME_BYTES])
    finally:
        os._exit(0)


def _parse_outcome(data):
    """Keep only well-typed known keys of a child's report; None when it is not a report."""
    try:
        raw = json.loads(data.decode())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("passed"), bool):
        return None
    return {key: raw[key] for key, kind in _OUTCOME_KEYS.items() if isinstance(raw.get(key), kind)}


def _kill_leftovers(pgid, own_pid_namespace):
    try:
        if own_pid_namespace:
            # kill(-1) reaches every process of the namespace but init and ourselves: that also ends
            # daemons that left the test's process group (setsid).
            os.kill(-1, signal.SIGKILL)
        else:
            os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_name(number):
    try:
        return signal.Signals(number).name
    except ValueError:
        return "SIG%d" % number


def _unreported(status, rusage, limits, timed_out):
    """Outcome of a test process that ended without reporting (killed, os._exit, crash)."""
    cpu = rusage.ru_utime + rusage.ru_stime
    if timed_out:
        return {"passed": False, "error_type": "Timeout", "timed_out": True, "limit": "wall_time",
                "message": "test did not finish in time (limits: %.1f s per test, %.1f s per program)"
                           % (limits["test_timeout_s"], limits["program_timeout_s"])}
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        outcome = {"passed": False, "error_type": "Killed", "signal": _signal_name(number),
                   "message": "test process killed by %s" % _signal_name(number)}
        if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= limits["cpu_time_s"]):
            outcome["limit"] = "cpu_time"
            outcome["message"] += " (CPU time limit of %s s)" % limits["cpu_time_s"]
        elif number == signal.SIGXFSZ:
            outcome["limit"] = "file_size"
        return outcome
    return {"passed": False, "error_type": "NoResult",
            "message": "test process exited with status %d without reporting a result" % os.WEXITSTATUS(status)}


def run_one(code, test, index, limits, result_fd, deadline, own_pid_namespace):
    """Fork a test process, wait for its report or the deadline, clean up; return the outcome."""
    started = time.monotonic()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(code, test, index, limits, write_fd, result_fd)
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child already did it, or already exited
        pass
    pidfd = os.pidfd_open(pid)
    os.set_blocking(read_fd, False)
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    data, exited, reading = b"", False, True
    while not exited:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for fd, _ in poller.poll(remaining * 1000):
            if fd == pidfd:
                exited = True
            elif reading:
                data, reading = _read_some(read_fd, data, poller)
    if exited and reading:
        data, _ = _read_some(read_fd, data, poller)
    timed_out = not exited
    _kill_leftovers(pid, own_pid_namespace)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status, rusage = os.wait4(pid, 0)
    os.close(read_fd)
    os.close(pidfd)
    outcome = None if timed_out else _parse_outcome(data)
    if outcome is None:
        outcome = _unreported(status, rusage, limits, timed_out)
    outcome["duration_s"] = round(time.monotonic() - started, 4)
    return outcome


def _read_some(fd, data, poller):
    """Read what is available (capped); returns the data and whether the pipe is still open."""
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return data, True
    if not chunk:
        poller.unregister(fd)
        return data, False
    return (data + chunk)[:_MAX_OUTCOME_BYTES], True


def _drop_privileges(uid, gid, sandboxed):
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    if not sandboxed:
        return
    with open("/proc/self/status") as status:
        effective = [line.split()[1] for line in status if line.startswith("CapEff:")]
    if effective and int(effective[0], 16) != 0:
        raise SystemExit("teamrl sandbox harness: refusing to run with capabilities %s" % effective[0])


def _make_undumpable():
    # Switching uid from root already made us non-dumpable (then /proc/self belongs to root, not
    # to us); otherwise say so explicitly. Non-dumpable: no test process can open our descriptors
    # through /proc/<pid>/fd, read our memory, or ptrace us.
    if os.stat("/proc/self").st_uid != os.getuid():
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise SystemExit("teamrl sandbox harness: prctl(PR_SET_DUMPABLE) failed: errno %d" % ctypes.get_errno())


def _preload(code):
    for name in set(_IMPORTED.findall(code)) & _PRELOADABLE:
        try:
            __import__(name)
        except ImportError:  # the test process will report it
            pass


def _emit(fd, obj):
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def main(argv):
    """Entry point: argv = [RESULT_FD, UID, GID, SANDBOXED] (UID -1: keep the current user).

    SANDBOXED "1" means we run inside bubblewrap: in our own PID namespace, and with no capability
    left once privileges are dropped (checked: the harness refuses to run otherwise).
    """
    result_fd, uid, gid, sandboxed = int(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1"
    _drop_privileges(uid, gid, sandboxed)
    if sandboxed:
        _make_undumpable()
    payload = json.loads(sys.stdin.buffer.read().decode())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    code, tests, limits = payload["code"], payload["tests"], payload["limits"]
    sys.path.extend(path for path in payload["site_dirs"] if path not in sys.path)  # started with -S
    _preload(code)
    _emit(result_fd, {"ready": True})
    program_deadline = time.monotonic() + limits["program_timeout_s"]
    program_failure = None
    for index, test in enumerate(tests):
        if program_failure is not None:
            # Loading the program is the same for every test: its failure is every test's failure.
            outcome = dict(program_failure, duration_s=0.0)
        elif time.monotonic() >= program_deadline:
            outcome = {"passed": False, "error_type": "Timeout", "timed_out": True, "limit": "wall_time",
                       "message": "program time budget of %.1f s used up before this test ran"
                                  % limits["program_timeout_s"], "duration_s": 0.0}
        else:
            deadline = min(time.monotonic() + limits["test_timeout_s"], program_deadline)
            outcome = run_one(code, test, index, limits, result_fd, deadline, sandboxed)
            if not outcome["passed"] and outcome.get("phase") == "program":
                program_failure = {k: v for k, v in outcome.items() if k != "duration_s"}
        outcome["index"] = index
        _emit(result_fd, outcome)
    _emit(result_fd, {"done": True})


if __name__ == "__main__":
    main(sys.argv[1:])
