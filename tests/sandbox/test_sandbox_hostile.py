"""Hostile programs: each is contained, reported as what it is, and leaves the host unchanged."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys

import pytest

from teamrl.sandbox import ABORTED, COMPLETED, TIMED_OUT, Program, SandboxLimits, SandboxPool, run_program
from teamrl.sandbox.runner import _UID_BASE, _UID_SPAN

DAEMON_MARK = "TEAMRL_DAEMON_" + "CANARY"
pytestmark = pytest.mark.usefixtures("no_stray_processes")


def _digest(path: str) -> tuple[str, int]:
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest(), os.stat(path).st_mtime_ns


def _host_processes_with(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if mark.encode() in handle.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_infinite_loop_hits_the_wall_clock_limit(pool):
    code = "import time\ndef spin():\n    while True:\n        time.sleep(0.01)\n"
    record = pool.run([Program(code, ["spin()", "assert 1 + 1 == 2"])])[0]
    stuck, after = record.tests
    assert not stuck.passed and stuck.timed_out and stuck.limit == "wall_time"
    assert stuck.error_type == "Timeout" and 1.9 < stuck.duration_s < 3.0
    assert after.passed and record.status == COMPLETED


def test_busy_loop_hits_the_cpu_limit(bubblewrap):
    limits = SandboxLimits(test_timeout_s=8.0, program_timeout_s=8.0, cpu_time_s=1)
    with SandboxPool(limits, workers=1) as slow_pool:
        record = slow_pool.run([Program("def spin():\n    while True:\n        pass\n", ["spin()"])])[0]
    (outcome,) = record.tests
    assert not outcome.passed and outcome.error_type == "Killed"
    assert outcome.signal == "SIGXCPU" and outcome.limit == "cpu_time" and not outcome.timed_out


def test_program_that_never_loads_uses_up_its_budget_not_more(bubblewrap):
    limits = SandboxLimits(test_timeout_s=1.0, program_timeout_s=2.5, cpu_time_s=5)
    with SandboxPool(limits, workers=1) as slow_pool:
        record = slow_pool.run([Program("import time\nwhile True:\n    time.sleep(0.01)\n", ["pass"] * 5)])[0]
    assert [outcome.error_type for outcome in record.tests] == ["Timeout"] * 5
    assert "budget" in record.tests[-1].message
    assert record.wall_time_s < 2.5 + 1.0


def test_fork_bomb_is_stopped_by_the_process_limit(pool):
    code = "import os\ndef bomb():\n    while True:\n        os.fork()\n"
    record = pool.run([Program(code, ["bomb()", "assert 2 * 2 == 4"])])[0]
    bomb, after = record.tests
    assert not bomb.passed and bomb.error_type == "BlockingIOError" and bomb.limit == "processes"
    assert after.passed  # the next test still gets processes: the bomb's survivors were killed
    assert record.wall_time_s < 3.0


@pytest.mark.parametrize("allocation", [
    "bytearray(10 ** 10)",
    "[bytearray(10 ** 7) for _ in range(10 ** 4)]",
])
def test_memory_bomb_raises_memory_error(pool, allocation):
    record = pool.run([Program(f"def hog():\n    return {allocation}\n", ["hog()", "assert len('ok') == 2"])])[0]
    hog, after = record.tests
    assert not hog.passed and hog.error_type == "MemoryError" and hog.limit == "memory"
    assert after.passed


def test_huge_output_is_truncated_and_does_not_block(pool, fast_limits):
    code = "def shout():\n    for _ in range(3000):\n        print('x' * 10000)\n    return 1\n"
    record = pool.run([Program(code, ["assert shout() == 1"])])[0]
    assert record.all_passed  # 30 MB printed, drained by the host, only the start kept
    assert len(record.stdout) == fast_limits.max_output_bytes and record.stdout_truncated
    endless = pool.run([Program("def shout():\n    while True:\n        print('y' * 10000)\n", ["shout()"])])[0]
    assert endless.tests[0].timed_out and len(endless.stdout) == fast_limits.max_output_bytes


def test_big_files_hit_the_file_size_and_scratch_limits(pool):
    big_file = "def write():\n    with open('big', 'wb') as f:\n        f.write(b'0' * (32 << 20))\n"
    many_files = ("def fill():\n    for i in range(100):\n"
                  "        with open(f'part{i}', 'wb') as f:\n            f.write(b'0' * (8 << 20))\n")
    big, full = pool.run([Program(big_file, ["write()"]), Program(many_files, ["fill()"])])
    assert big.tests[0].error_type == "OSError" and big.tests[0].limit == "file_size"
    assert full.tests[0].error_type == "OSError" and "No space left" in full.tests[0].message


def _attempts(attempts: list[str]) -> Program:
    """A program whose ``attempt(i)`` tries the i-th hostile statement and says whether it worked;
    each test asserts that one did not."""
    branches = "".join(f"    if i == {i}:\n        {attempt}\n" for i, attempt in enumerate(attempts))
    code = ("import os, socket\ndef attempt(i):\n    try:\n"
            + "\n".join("    " + line for line in branches.splitlines())
            + "\n    except OSError:\n        return 'blocked'\n    return 'did it'\n")
    return Program(code, [f"assert attempt({i}) == 'blocked'" for i in range(len(attempts))])


def test_host_files_cannot_be_seen_written_or_deleted(pool, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    protected = [str(canary), os.path.realpath(sys.executable), "/usr/bin/env"]
    before = {path: _digest(path) for path in protected}
    program = _attempts([
        f"open({str(canary)!r}, 'w').write('pwned')",
        f"os.remove({str(canary)!r})",
        f"open({os.path.realpath(sys.executable)!r}, 'ab').write(b'pwned')",
        "os.remove('/usr/bin/env')",
        "open('/usr/teamrl_evil', 'w').write('pwned')",
        "os.makedirs('/etc/teamrl_evil')",
        f"os.listdir({os.path.dirname(os.path.abspath(__file__))!r})",
        f"open({str(canary)!r}).read()",
    ])
    scratch = Program("import os\ndef scratch():\n    open('scratch.txt', 'w').write('fine')\n    return os.getcwd()\n",
                      ["assert scratch() == '/tmp'"])
    record, scratch_record = pool.run([program, scratch])
    assert [outcome.passed for outcome in record.tests] == [True] * len(program.tests), record.tests
    assert scratch_record.all_passed, scratch_record.tests
    assert {path: _digest(path) for path in protected} == before
    assert canary.read_text() == "untouched"
    assert not os.path.exists("/usr/teamrl_evil") and not os.path.exists("/etc/teamrl_evil")


def test_environment_secrets_are_not_visible(pool, monkeypatch):
    monkeypatch.setenv("TEAMRL_FAKE_SECRET", "hunter2")
    code = "import os\nprint(dict(os.environ))\ndef names():\n    return set(os.environ)\n"
    tests = ["assert 'TEAMRL_FAKE_SECRET' not in names()",
             "assert names() <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE', 'PWD', "
             "'OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'}"]
    record = pool.run([Program(code, tests)])[0]
    assert record.all_passed, record.tests
    assert "hunter2" not in record.stdout and "PATH" in record.stdout


def test_network_is_unreachable(pool):
    program = _attempts([
        "socket.create_connection(('1.1.1.1', 80), timeout=1)",
        "socket.getaddrinfo('pypi.org', 443)",
    ])
    interfaces = Program("import socket\ndef interfaces():\n    return [name for _, name in socket.if_nameindex()]\n",
                         ["assert interfaces() == ['lo']"])
    records = pool.run([program, interfaces])
    assert all(record.all_passed for record in records), [record.tests for record in records]


def test_sandbox_user_is_unprivileged_and_sees_only_its_processes(pool):
    code = ("import os\n"
            "def ids():\n    return os.getuid(), os.geteuid()\n"
            "def capabilities():\n    status = open('/proc/self/status').read()\n"
            "    return [l.split()[1] for l in status.splitlines() if l.startswith('CapEff')]\n"
            "def processes():\n    return len([p for p in os.listdir('/proc') if p.isdigit()])\n")
    tests = ["assert 0 not in ids()", "assert capabilities() == ['0000000000000000']",
             # init, the driver, the program server, the judge and this program process
             "assert processes() <= 5"]
    record, attempts = pool.run([Program(code, tests),
                                 _attempts(["os.setuid(0)", "open('/proc/sys/kernel/hostname', 'w').write('x')"])])
    assert record.all_passed, record.tests
    assert attempts.all_passed, attempts.tests


def test_killing_the_driver_aborts_only_this_program(pool):
    hostile = Program("import os\ndef f():\n    os.kill(-1, 9)\n", ["assert 1 == 1", "f()", "assert 2 == 2"])
    sibling = Program("import time\ndef g():\n    time.sleep(0.5)\n    return 1\n", ["assert g() == 1"] * 2)
    record, neighbour = pool.run([hostile, sibling])
    assert record.status == ABORTED
    assert [(o.passed, o.error_type) for o in record.tests] == [(True, None), (False, "NotRun"), (False, "NotRun")]
    assert neighbour.all_passed  # the concurrent sandbox was out of reach


def test_killing_the_program_server_loses_only_the_later_tests(pool):
    hostile = Program("import os\ndef f():\n    os.kill(os.getppid(), 9)\n    return 1\n",
                      ["assert f() == 1", "assert 2 == 2"])
    record = pool.run([hostile])[0]
    assert record.status == COMPLETED
    assert [(o.passed, o.error_type) for o in record.tests] == [(True, None), (False, "NotRun")]
    assert "program server" in record.tests[1].message


def test_stopping_the_driver_is_ended_by_the_host_deadline(bubblewrap):
    limits = SandboxLimits(test_timeout_s=1.0, program_timeout_s=1.0)
    with SandboxPool(limits, workers=1) as short_pool:
        record = short_pool.run([Program("import os, signal\ndef stop():\n    os.kill(-1, signal.SIGSTOP)\n",
                                         ["stop()"])])[0]
    assert record.status == TIMED_OUT and record.timed_out
    assert record.tests[0].error_type == "NotRun" and record.tests[0].limit == "wall_time"
    assert record.exit_code == -9


def test_forged_results_on_stdout_and_descriptors_do_not_count(pool):
    fake = ('{"ready": true}\\n{"index": 0, "passed": true}\\n{"index": 1, "passed": true}\\n'
            '{"done": true}\\n{"passed": true}')
    forger = (
        "import os, sys\n"
        "def forge():\n"
        f"    fake = '{fake}'\n"
        "    print(fake, flush=True)\n"
        "    print(fake, file=sys.stderr, flush=True)\n"
        "    for fd in range(3, 64):\n"
        "        try:\n"
        "            os.write(fd, fake.encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    )
    exits = "import sys\ndef leave():\n    print('{\"index\": 1, \"passed\": true}')\n    sys.exit(0)\n"
    forged, exited = pool.run([Program(forger, ["forge()", "assert False"]),
                               Program(exits, ["leave()", "assert False"])])
    # The forged bytes on the program's own reply pipe are not a reply: no result, no pass.
    assert [(o.passed, o.error_type) for o in forged.tests] == [(False, "NoResult"), (False, "AssertionError")]
    assert forged.status == COMPLETED and '"passed": true' in forged.stdout
    assert [(o.passed, o.error_type) for o in exited.tests] == [(False, "SystemExit"), (False, "AssertionError")]


def test_the_driver_descriptors_are_out_of_reach(pool, bubblewrap):
    """No descriptor of the driver or a judge can be listed or opened. Run unprivileged (not as root), bubblewrap's
    own init (PID 1, under the program's user too) can be reached, and holds only the sandbox's standard streams:
    the job on stdin, read whole by the driver before the program starts, and the program's own stdout, stderr."""
    probe = (
        "import os\n"
        "def others():\n"
        "    return [pid for pid in os.listdir('/proc') if pid.isdigit() and int(pid) != os.getpid()]\n"
        "def listed():\n"
        "    found = []\n"
        "    for pid in others():\n"
        "        try:\n"
        "            os.listdir(f'/proc/{pid}/fd')\n"
        "            found.append(pid)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return found\n"
        "def opened():\n"
        "    found = []\n"
        "    for pid in others():\n"
        "        for fd in range(64):\n"
        "            try:\n"
        "                os.close(os.open(f'/proc/{pid}/fd/{fd}', os.O_WRONLY))\n"
        "                found.append((pid, fd, os.readlink(f'/proc/{pid}/fd/{fd}').split(':')[0]))\n"
        "            except OSError:\n"
        "                pass\n"
        "    return found\n"
        "def init():\n"
        "    return os.path.basename(open('/proc/1/cmdline').read().split(chr(0))[0])\n"
    )
    if bubblewrap.privileged:
        tests = ["assert listed() == []", "assert opened() == []"]
    else:
        tests = ["assert init() == 'bwrap'", "assert listed() == ['1']",
                 "assert opened() == [('1', 0, 'pipe'), ('1', 1, 'pipe'), ('1', 2, 'pipe')]"]
    record = pool.run([Program(probe, tests)])[0]
    assert record.all_passed, record.tests


def test_recursion_bombs_are_contained(pool):
    python_level = "def f(n):\n    return f(n + 1) + 1\n"
    c_level = ("import functools, sys\nsys.setrecursionlimit(10 ** 8)\n"
               "@functools.lru_cache(maxsize=None)\ndef f(n):\n    return f(n + 1) + 1\n")
    plain, deep = pool.run([Program(python_level, ["f(0)", "assert 1 == 1"]),
                            Program(c_level, ["f(0)", "assert 1 == 1"])])
    assert plain.tests[0].error_type == "RecursionError" and plain.tests[1].passed
    assert deep.tests[0].error_type == "Killed" and deep.tests[0].signal == "SIGSEGV"
    assert deep.tests[1].passed


def test_detached_daemon_does_not_outlive_its_test(pool):
    code = (
        "import os, sys, time\n"
        "def daemons():\n"
        "    found = []\n"
        "    for pid in os.listdir('/proc'):\n"
        "        try:\n"
        f"            if pid.isdigit() and b'{DAEMON_MARK}' in open(f'/proc/{{pid}}/cmdline', 'rb').read():\n"
        "                found.append(pid)\n"
        "        except OSError:  # exited meanwhile\n"
        "            pass\n"
        "    return found\n"
        "def spawn():\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            os.execv(sys.executable, [sys.executable, '-S', '-c',\n"
        "                     'import time; time.sleep(20); open(\"/tmp/late\", \"w\")', "
        f"'{DAEMON_MARK}'])\n"
        "        os._exit(0)\n"
        "    deadline = time.monotonic() + 1.5\n"
        "    while not daemons() and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    return len(daemons())\n"
    )
    record = pool.run([Program(code, ["assert spawn() == 1", "assert daemons() == []"])])[0]
    assert record.all_passed, record.tests  # running during its test, gone before the next
    assert record.wall_time_s < 5.0
    assert _host_processes_with(DAEMON_MARK) == []


USERNS_PROBE = (
    "import ctypes, os, subprocess, sys, threading\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def new_user_namespace():\n"
    "    result = libc.unshare(0x10000000)  # CLONE_NEWUSER\n"
    "    return result, ctypes.get_errno()\n"
    "def ordinary_processes_and_threads():\n"
    "    box = []\n"
    "    thread = threading.Thread(target=box.append, args=(1,))\n"
    "    thread.start()\n"
    "    thread.join()\n"
    "    child = os.fork()\n"
    "    if child == 0:\n"
    "        os._exit(7)\n"
    "    _, status = os.waitpid(child, 0)\n"
    "    out = subprocess.run([sys.executable, '-S', '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout\n"
    "    return box, os.WEXITSTATUS(status), out.strip()\n"
)


def test_graded_code_cannot_create_user_namespaces(pool):
    """No nested user namespaces: in root mode by the seccomp filter, in user mode by --disable-userns too.
    Threads, fork and subprocess (clone, and clone3's fallback to it) keep working."""
    record = pool.run([Program(USERNS_PROBE, ["assert new_user_namespace() == (-1, 1)",  # EPERM
                                              "assert ordinary_processes_and_threads() == ([1], 7, '42')"])])[0]
    assert record.all_passed, record.tests


# The numbers the probes below call by, per architecture (asm/unistd_64.h; asm-generic/unistd.h).
SYSCALLS = {
    "x86_64": {"add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298, "bpf": 321,
               "userfaultfd": 323, "io_uring_setup": 425},
    "aarch64": {"add_key": 217, "request_key": 218, "keyctl": 219, "perf_event_open": 241, "bpf": 280,
                "userfaultfd": 282, "io_uring_setup": 425},
}.get(platform.machine())
needs_syscall_numbers = pytest.mark.skipif(SYSCALLS is None, reason=f"no syscall table for {platform.machine()}")
KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_KEYRING = -3, -4
KEYCTL_GET_KEYRING_ID, KEYCTL_INVALIDATE, KEYCTL_READ, KEYCTL_SEARCH = 0, 21, 11, 10

KERNEL_PROBE = (
    "import ctypes, os, struct\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    f"NR = {SYSCALLS!r}\n"
    "def call(name, *args):\n"
    "    ctypes.set_errno(0)\n"
    "    return libc.syscall(ctypes.c_long(NR[name]), *args), ctypes.get_errno()\n"
    "def add_keys(n):\n"
    f"    return [call('add_key', b'user', b'k%d' % i, b'x' * 90, 90, ctypes.c_int({KEY_SPEC_USER_KEYRING}))\n"
    "            for i in range(n)][-1]\n"
    "def user_keyring():  # created on first use, and kept by the kernel after the program\n"
    f"    return call('keyctl', {KEYCTL_GET_KEYRING_ID}, ctypes.c_int({KEY_SPEC_USER_KEYRING}), 1)\n"
    "def requested_key():\n"
    f"    return call('request_key', b'user', b'teamrl-probe', None, ctypes.c_int({KEY_SPEC_USER_KEYRING}))\n"
    "def host_key(description, key):\n"
    f"    found = call('keyctl', {KEYCTL_SEARCH}, ctypes.c_int({KEY_SPEC_SESSION_KEYRING}), b'user', description, 0)\n"
    "    payload = ctypes.create_string_buffer(64)\n"
    f"    read = call('keyctl', {KEYCTL_READ}, ctypes.c_long(key), payload, 64)\n"
    "    return found, read, payload.value\n"
    "def perf_events():  # a software clock of this very process, which perf_event_paranoid <= 2 allows\n"
    "    attr = ctypes.create_string_buffer(128)\n"
    "    struct.pack_into('<IIQ', attr, 0, 1, 64, 0)  # PERF_TYPE_SOFTWARE, attr size, CPU clock\n"
    "    struct.pack_into('<Q', attr, 40, 0x60)  # exclude_kernel, exclude_hv\n"
    "    return call('perf_event_open', attr, 0, -1, -1, 0)\n"
    "def userfaultfd():\n"
    "    return call('userfaultfd', os.O_CLOEXEC | 1)  # UFFD_USER_MODE_ONLY: no privilege needed\n"
    "def io_uring():\n"
    "    return call('io_uring_setup', 1, ctypes.create_string_buffer(120))\n"
    "def bpf_map():\n"
    "    attr = ctypes.create_string_buffer(128)\n"
    "    struct.pack_into('<IIII', attr, 0, 2, 4, 4, 1)  # BPF_MAP_TYPE_ARRAY of one 4-byte value\n"
    "    return call('bpf', 0, attr, 128)  # BPF_MAP_CREATE\n"
)


def _key_users(uids) -> dict[int, str]:
    """The lines of /proc/key-users (the kernel's per-uid key accounting) for ``uids``."""
    with open("/proc/key-users") as table:
        rows = (line.split(":", 1) for line in table)
        return {int(uid): usage.strip() for uid, usage in rows if int(uid) in uids}


def _syscall(name: str, *args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(ctypes.c_long(SYSCALLS[name]), *args)


@needs_syscall_numbers
def test_graded_code_leaves_no_kernel_keys_behind(pool, bubblewrap):
    """Keys outlive their process: the sandbox's uid would keep what a program put in its keyrings, and in
    root mode every sandbox has a fresh uid. add_key, keyctl and request_key are refused, and no sandbox
    uid has keys afterwards (in user mode the sandbox shares the trainer's uid, so only the refusals show)."""
    sandbox_uids = range(_UID_BASE, _UID_BASE + _UID_SPAN)
    before = _key_users(sandbox_uids)
    record = pool.run([Program(KERNEL_PROBE, ["assert add_keys(20) == (-1, 1)",  # EPERM
                                              "assert user_keyring() == (-1, 1)",
                                              "assert requested_key() == (-1, 1)"])])[0]
    if bubblewrap.privileged:
        assert _key_users(sandbox_uids) == before
    assert record.all_passed, record.tests


@needs_syscall_numbers
def test_graded_code_cannot_read_the_trainers_session_keys(bubblewrap, fast_limits):
    """The sandbox inherits the session keyring of the thread that starts it; possessing it, a program could
    read the keys in it, and /proc/keys would list them (run_program starts it from this thread, which
    holds the key)."""
    key = _syscall("add_key", b"user", b"teamrl-host-secret", b"hunter2", 7, ctypes.c_int(KEY_SPEC_SESSION_KEYRING))
    if key < 0:
        pytest.skip(f"this host refuses kernel keys to the tests (errno {ctypes.get_errno()})")
    try:
        record = run_program(Program(KERNEL_PROBE, [f"print(host_key(b'teamrl-host-secret', {key}))",
                                                    "assert 'teamrl-host-secret' not in open('/proc/keys').read()"]),
                             fast_limits)
    finally:
        _syscall("keyctl", KEYCTL_INVALIDATE, ctypes.c_long(key))
    assert record.all_passed, record.tests
    assert "hunter2" not in record.stdout and record.stdout.strip() == "((-1, 1), (-1, 1), b'')"  # EPERM twice


@needs_syscall_numbers
def test_graded_code_cannot_reach_kernel_interfaces_it_does_not_need(pool):
    """perf events, userfaultfd, io_uring and BPF: large kernel surfaces no graded program needs (without the
    filter the first three work here as the sandbox user; BPF is also up to the host's sysctl)."""
    record = pool.run([Program(KERNEL_PROBE, [f"assert {probe}() == (-1, 1)"
                                              for probe in ("perf_events", "userfaultfd", "io_uring", "bpf_map")])])[0]
    assert record.all_passed, record.tests


def test_site_packages_are_hidden_from_the_program(pool):
    """The directory an installed package lies in shows the program nothing, whatever the layout: an empty
    folder where the sandbox binds it (a system or pyenv Python's own site-packages), or no folder at all
    where it binds nothing (a virtual environment's, e.g. under /tmp)."""
    import yaml  # installed with teamrl, so its directory exists on the host

    code = ("import importlib.util, os\n"
            "def visible(name):\n    return importlib.util.find_spec(name) is not None\n"
            "def listing(path):\n    try:\n        return os.listdir(path)\n"
            "    except FileNotFoundError:\n        return []\n"
            "def readable(path):\n    try:\n        open(path).close()\n    except OSError:\n"
            "        return False\n    return True\n")
    site_packages = os.path.dirname(os.path.dirname(yaml.__file__))
    record = pool.run([Program(code, ["assert visible('yaml') is False", f"assert listing({site_packages!r}) == []",
                                      f"assert readable({yaml.__file__!r}) is False",
                                      "assert visible('json') is True"])])[0]
    assert record.all_passed, record.tests


FORKING_HOG = (
    "import os, time\n"
    "def hog(children, size):\n"
    "    pids = []\n"
    "    for _ in range(children):\n"
    "        pid = os.fork()\n"
    "        if pid == 0:\n"
    "            try:\n"
    "                block = bytearray(size)\n"
    "                for page in range(0, size, 4096):\n"
    "                    block[page] = 1\n"
    "                print('allocated', flush=True)\n"
    "                time.sleep(3)\n"
    "            finally:\n"
    "                os._exit(0)\n"
    "        pids.append(pid)\n"
    "    for pid in pids:\n"
    "        os.waitpid(pid, 0)\n"
    "    return len(pids)\n"
)


def test_forked_children_share_one_memory_cap(bubblewrap):
    """Four children of 0.9 GiB each, each under the per-process limit, together far over the total: the
    program's processes never hold more than the cap, whichever way it is enforced."""
    cap = 1536 << 20
    limits = SandboxLimits(memory_bytes=1 << 30, total_memory_bytes=cap, test_timeout_s=8, program_timeout_s=8,
                           cpu_time_s=8)
    with SandboxPool(limits, workers=1) as hog_pool:
        record = hog_pool.run([Program(FORKING_HOG, [f"hog(4, {900 << 20})"])])[0]
    allocated = record.stdout.count("allocated")
    if hog_pool._backend.cgroups is not None:
        # The cgroup's OOM killer ends the largest process when the group reaches the cap: often a child
        # that already printed, so the next one then gets its block too. What holds is the group's peak.
        assert record.memory_peak_bytes is not None and record.memory_peak_bytes <= cap
    else:  # each process gets its share of the cap, below one child's block
        assert limits.split_memory_bytes < 900 << 20 and allocated == 0


def test_without_a_cgroup_the_cap_is_split_over_the_processes(bubblewrap, monkeypatch):
    from teamrl.sandbox import runner

    monkeypatch.setattr(runner, "_sandbox_cgroups", lambda: None)
    limits = SandboxLimits(memory_bytes=1 << 30, total_memory_bytes=1536 << 20, test_timeout_s=8,
                           program_timeout_s=8, cpu_time_s=8)
    with SandboxPool(limits, workers=1) as hog_pool:
        record = hog_pool.run([Program(FORKING_HOG + "def small():\n    return len(bytearray(10 << 20))\n",
                                       [f"hog(4, {900 << 20})", "assert small() == 10 << 20"])])[0]
    assert record.stdout.count("allocated") == 0 and record.memory_peak_bytes is None
    assert record.tests[1].passed  # 96 MiB per process still runs ordinary code
