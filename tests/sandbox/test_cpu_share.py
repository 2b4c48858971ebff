"""A program that spins many threads or processes gets its sandbox's CPU share (``SandboxLimits.cpu_cores``)
and no more: measured from outside the sandbox, as the CPU time its processes used over the wall time, and
as the share the kernel lets each of them have (its cpu cgroup's quota, or the cores it may run on), which
shows the cap even where other jobs leave a spinner less than its share anyway."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from teamrl.sandbox import Program, SandboxLimits, SandboxPool

SPIN = "def spin():\n    while True:\n        pass\n"
# Each spins on ten threads, or in ten processes, until its test's time limit ends it.
SPINNERS = {
    "threads": SPIN + "import threading\ndef entry():\n    for _ in range(9):\n"
                      "        threading.Thread(target=spin, daemon=True).start()\n    spin()\n",
    "processes": SPIN + "import os\ndef entry():\n    for _ in range(9):\n        if os.fork() == 0:\n"
                        "            spin()\n    spin()\n",
}
LIMITS = SandboxLimits(test_timeout_s=2.5, program_timeout_s=3.0, cpu_time_s=30, max_processes=32)
TICKS = os.sysconf("SC_CLK_TCK")
PF_EXITING = 0x4  # /proc/PID/stat flags: the process is exiting


def _quota_files(pid: int) -> list[tuple[Path, Path]]:
    """(quota file, its period file or None) of each cpu cgroup process ``pid`` is in: v1 ``cpu`` mounts,
    v2 (``cpu.max`` holds both); read here, independently of ``teamrl.sandbox.cgroups``."""
    mounts = {}
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields, (fstype, _, options) = line.split(), line.split(" - ", 1)[1].split()[:3]
            if fstype == "cgroup2" or (fstype == "cgroup" and "cpu" in options.split(",")):
                mounts["" if fstype == "cgroup2" else "cpu"] = (fields[3], Path(fields[4]))
    found = []
    with open(f"/proc/{pid}/cgroup") as cgroup:
        for line in cgroup:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            key = "" if controllers == "" else "cpu" if "cpu" in controllers.split(",") else None
            if key in mounts:
                root, point = mounts[key]
                directory = point / os.path.relpath(path, root)
                found.append((directory / "cpu.max", None) if key == "" else
                             (directory / "cpu.cfs_quota_us", directory / "cpu.cfs_period_us"))
    return found


def _cores_allowed(pid: int) -> float | None:
    """The cores the kernel lets process ``pid`` use: its cpu cgroup's quota, or the cores it may run on;
    None where its cgroup is gone (it ended and the sandbox removed the cgroup between two reads)."""
    allowed = float(len(os.sched_getaffinity(pid)))
    for quota_file, period_file in _quota_files(pid):
        try:
            quota, period = quota_file.read_text().split() if period_file is None \
                else (quota_file.read_text().strip(), period_file.read_text().strip())
        except (OSError, ValueError):
            if not quota_file.parent.is_dir():
                return None
            continue  # no quota file there: this cgroup caps nothing (the root cgroup, no cpu controller)
        if quota not in ("max", "-1"):
            allowed = min(allowed, int(quota) / int(period))
    return allowed


def _ours(pid: int) -> bool:
    """Whether process ``pid`` descends from this one (other jobs on the host may run sandboxes too)."""
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            with open(f"/proc/{pid}/stat") as stat:
                pid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
    return False


def _stat(pid: int) -> tuple[str, int, int, int]:
    """Process ``pid``'s state letter, flags, user and system CPU ticks (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as stat:
        state, *rest = stat.read().rsplit(")", 1)[1].split()
    return state, int(rest[5]), int(rest[10]), int(rest[11])


def _running(state: str, flags: int) -> bool:
    return state not in ("Z", "X") and not flags & PF_EXITING


class _Watch:
    """Samples, from the host, the CPU time of every process running as a sandbox user (by uid), the cores
    each may run on and the cores the kernel lets it use, until stopped."""

    def __init__(self, sandbox_processes) -> None:
        self.sandbox_processes = sandbox_processes
        self.cpu: dict[tuple[int, int], float] = {}  # (uid, pid) -> CPU seconds at the last sample
        self.cores: dict[int, set[str]] = {}  # uid -> Cpus_allowed_list values seen
        self.allowed: dict[int, float] = {}  # uid -> the most cores a process of it was allowed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for pid in filter(_ours, self.sandbox_processes()):
                try:
                    with open(f"/proc/{pid}/status") as status:
                        fields = dict(line.split(":", 1) for line in status if ":" in line)
                    state, flags, utime, stime = _stat(pid)
                    # a process exiting (or exited) has left its cgroups but still counts its CPU time
                    allowed = _cores_allowed(pid) if _running(state, flags) else 0.0
                    if allowed is None or not _running(*_stat(pid)[:2]):  # it ended while being read
                        allowed = 0.0
                except (OSError, ValueError):
                    continue
                if fields["Name"].strip() == "sh":  # the launcher, before it joins the cgroups and execs bubblewrap
                    continue
                uid = int(fields["Uid"].split()[1])
                self.allowed[uid] = max(self.allowed.get(uid, 0.0), allowed)
                self.cpu[uid, pid] = (utime + stime) / TICKS
                self.cores.setdefault(uid, set()).add(fields["Cpus_allowed_list"].strip())

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_by_sandbox(self) -> list[float]:
        """CPU seconds each sandbox (uid) used, as last sampled."""
        totals: dict[int, float] = {}
        for (uid, _), seconds in self.cpu.items():
            totals[uid] = totals.get(uid, 0.0) + seconds
        return sorted(totals.values())


def _spin_concurrently(pool: SandboxPool, sandbox_processes) -> tuple[list, list[float], float, _Watch]:
    with _Watch(sandbox_processes) as watch:
        started = time.monotonic()
        records = pool.run([Program(code, ["entry()"]) for code in SPINNERS.values()])
        wall = time.monotonic() - started
    return records, watch.cpu_by_sandbox(), wall, watch


@pytest.mark.usefixtures("no_stray_processes")
def test_a_spinning_program_gets_one_core_however_many_threads_or_processes(bubblewrap, sandbox_processes):
    """Both spinners run at once, one sandbox each: each gets at most its one core (with the sampling's
    slack) over the whole run, counted from the host and, where a cgroup counts it, by the cgroup."""
    with SandboxPool(LIMITS, workers=2) as pool:
        pool.run([Program("def f():\n    return 1\n", ["assert f() == 1"])] * 2)  # warm-up
        records, cpu, wall, watch = _spin_concurrently(pool, sandbox_processes)
    assert [record.tests[0].limit for record in records] == ["wall_time", "wall_time"]
    assert sorted(watch.allowed.values()) == [LIMITS.cpu_cores] * 2
    assert len(cpu) == 2 and max(cpu) / wall <= LIMITS.cpu_cores * 1.15, (cpu, wall)
    for record in records:
        if record.cpu_time_s is not None:
            assert record.cpu_time_s / record.wall_time_s <= LIMITS.cpu_cores * 1.1, record.cpu_time_s


@pytest.mark.slow
@pytest.mark.usefixtures("no_stray_processes")
def test_without_a_cpu_cgroup_each_sandbox_is_pinned_to_its_core(bubblewrap, sandbox_processes, monkeypatch):
    from teamrl.sandbox import runner

    monkeypatch.setattr(runner, "_sandbox_cgroups", lambda: None)
    with SandboxPool(LIMITS, workers=2) as pool:
        records, cpu, wall, watch = _spin_concurrently(pool, sandbox_processes)
    assert [record.cpu_time_s for record in records] == [None, None]
    assert sorted(watch.allowed.values()) == [LIMITS.cpu_cores] * 2
    assert len(cpu) == 2 and max(cpu) / wall <= LIMITS.cpu_cores * 1.15, (cpu, wall)
    # every process of a sandbox on one core, the two sandboxes on different ones
    assert sorted(len(cores) for cores in watch.cores.values()) == [1, 1]
    assert all("," not in core and "-" not in core for cores in watch.cores.values() for core in cores)
    assert len({core for cores in watch.cores.values() for core in cores}) == min(2, len(os.sched_getaffinity(0)))


def test_a_program_cannot_widen_its_affinity(pool):
    code = "import os\ndef widen():\n    os.sched_setaffinity(0, os.sched_getaffinity(0))\n    return 'widened'\n"
    record = pool.run([Program(code, ["assert widen() == 'widened'"])])[0]
    assert record.tests[0].error_type == "PermissionError", record.tests[0]
