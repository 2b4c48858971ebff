"""Hostile programs: each is contained, reported as what it is, and leaves the host unchanged."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from teamrl.sandbox import ABORTED, COMPLETED, TIMED_OUT, Program, SandboxLimits, SandboxPool

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


def test_host_files_cannot_be_seen_written_or_deleted(pool, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    protected = [str(canary), os.path.realpath(sys.executable), "/usr/bin/env"]
    before = {path: _digest(path) for path in protected}
    attempts = [
        f"open({str(canary)!r}, 'w').write('pwned')",
        f"os.remove({str(canary)!r})",
        f"open({os.path.realpath(sys.executable)!r}, 'ab').write(b'pwned')",
        "os.remove('/usr/bin/env')",
        "open('/usr/teamrl_evil', 'w').write('pwned')",
        "os.makedirs('/etc/teamrl_evil')",
        f"os.listdir({os.path.dirname(os.path.abspath(__file__))!r})",
    ]
    tests = [f"import os\ntry:\n    {attempt}\nexcept OSError:\n    pass\nelse:\n    raise AssertionError('did it')"
             for attempt in attempts]
    tests.append(f"import os\nassert not os.path.exists({str(canary)!r})")
    tests.append("open('scratch.txt', 'w').write('fine')\nimport os\nassert os.getcwd() == '/tmp'")
    record = pool.run([Program("", tests)])[0]
    assert [outcome.passed for outcome in record.tests] == [True] * len(tests), record.tests
    assert {path: _digest(path) for path in protected} == before
    assert canary.read_text() == "untouched"
    assert not os.path.exists("/usr/teamrl_evil") and not os.path.exists("/etc/teamrl_evil")


def test_environment_secrets_are_not_visible(pool, monkeypatch):
    monkeypatch.setenv("TEAMRL_FAKE_SECRET", "hunter2")
    code = "import os\nprint(dict(os.environ))\n"
    tests = ["import os\nassert 'TEAMRL_FAKE_SECRET' not in os.environ",
             "import os\nassert set(os.environ) <= {'PATH', 'LANG', 'HOME', 'TMPDIR', 'LC_CTYPE', 'PWD', "
             "'OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS', 'MKL_NUM_THREADS'}, sorted(os.environ)"]
    record = pool.run([Program(code, tests)])[0]
    assert record.all_passed, record.tests
    assert "hunter2" not in record.stdout and "PATH" in record.stdout


def test_network_is_unreachable(pool):
    tests = [
        "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
        "except OSError:\n    pass\nelse:\n    raise AssertionError('connected')",
        "import socket\ntry:\n    socket.getaddrinfo('pypi.org', 443)\nexcept OSError:\n    pass\n"
        "else:\n    raise AssertionError('resolved')",
        "import socket\nassert [name for _, name in socket.if_nameindex()] == ['lo']",
    ]
    record = pool.run([Program("", tests)])[0]
    assert record.all_passed, record.tests


def test_sandbox_user_is_unprivileged_and_sees_only_its_processes(pool):
    tests = [
        "import os\nassert os.getuid() != 0 and os.geteuid() != 0",
        "status = open('/proc/self/status').read()\n"
        "assert [l.split()[1] for l in status.splitlines() if l.startswith('CapEff')] == ['0000000000000000']",
        "import os\ntry:\n    os.setuid(0)\nexcept PermissionError:\n    pass\nelse:\n    raise AssertionError('root')",
        "import os\nassert len([p for p in os.listdir('/proc') if p.isdigit()]) <= 4",
        "try:\n    open('/proc/sys/kernel/hostname', 'w').write('x')\nexcept OSError:\n    pass\n"
        "else:\n    raise AssertionError('wrote /proc/sys')",
    ]
    record = pool.run([Program("", tests)])[0]
    assert record.all_passed, record.tests


@pytest.mark.parametrize("kill", ["os.kill(os.getppid(), 9)", "os.kill(-1, 9)"])
def test_killing_the_driver_aborts_only_this_program(pool, kill):
    hostile = Program(f"import os\ndef f():\n    {kill}\n", ["assert 1 == 1", "f()", "assert 2 == 2"])
    sibling = Program("import time\ndef g():\n    time.sleep(0.5)\n    return 1\n", ["assert g() == 1"] * 2)
    record, neighbour = pool.run([hostile, sibling])
    assert record.status == ABORTED
    assert [(o.passed, o.error_type) for o in record.tests] == [(True, None), (False, "NotRun"), (False, "NotRun")]
    assert neighbour.all_passed  # the concurrent sandbox was out of reach


def test_stopping_the_driver_is_ended_by_the_host_deadline(bubblewrap):
    limits = SandboxLimits(test_timeout_s=1.0, program_timeout_s=1.0)
    with SandboxPool(limits, workers=1) as short_pool:
        record = short_pool.run([Program("import os, signal\n", ["os.kill(os.getppid(), signal.SIGSTOP)"])])[0]
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
    assert [(o.passed, o.error_type) for o in forged.tests] == [(False, "NoResult"), (False, "AssertionError")]
    assert forged.status == COMPLETED and '"passed": true' in forged.stdout
    assert [(o.passed, o.error_type) for o in exited.tests] == [(False, "SystemExit"), (False, "AssertionError")]


def test_the_driver_descriptors_are_out_of_reach(pool):
    probe = (
        "import os\n"
        "def reach():\n"
        "    driver = f'/proc/{os.getppid()}'\n"
        "    reached = []\n"
        "    try:\n"
        "        reached.append(os.listdir(driver + '/fd'))\n"
        "    except PermissionError:\n"
        "        pass\n"
        "    for fd in range(64):\n"
        "        try:\n"
        "            os.close(os.open(f'{driver}/fd/{fd}', os.O_WRONLY))\n"
        "            reached.append(fd)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return reached\n"
    )
    record = pool.run([Program(probe, ["assert reach() == []"])])[0]
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
