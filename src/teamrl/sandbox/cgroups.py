"""The cgroups of one graded program: one memory cap for all its processes, one CPU share, counted.

Resource limits (``setrlimit``) are per process, so a program that forks N children could take N
times ``SandboxLimits.memory_bytes`` from the host, and N cores. A memory cgroup caps what all of them
take together (RAM, and swap where the kernel accounts it; the sandbox's scratch tmpfs counts too):
past ``SandboxLimits.total_memory_bytes`` the kernel reclaims, then kills a process of that cgroup. A
cpu cgroup caps the CPU time all of them get per period of wall time to ``SandboxLimits.cpu_cores``
cores (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``): a program that spins ten threads or processes
gets its share and no more, so it cannot slow the other sandboxes or the trainer. The CPU time all its
processes used is read back from the cgroup (v2 ``cpu.stat``, v1 ``cpuacct.usage``) into
``ExecutionRecord.cpu_time_s``.

Where a cgroup can be used:

* **cgroup v2** (the unified hierarchy, e.g. systemd machines): the memory controller (and the cpu
  controller, for the CPU cap) must be enabled for the children of the cgroup teamrl runs in. That
  holds when the cgroup was delegated with them (``systemd-run --user --scope -p Delegate=yes teamrl
  ...``) and teamrl's process is alone in it: teamrl then moves itself into a leaf (``teamrl-trainer``)
  so that its cgroup may have controlled children (the kernel forbids controllers on a cgroup that
  holds processes).
* **cgroup v1** (a ``memory`` hierarchy, and ``cpu`` and ``cpuacct`` ones, as in many containers):
  teamrl needs write access to its own cgroup in each (as root in a container it usually has).

Otherwise (no writable memory cgroup, e.g. an unprivileged user without delegation) the sandbox falls
back to splitting the cap: each process's address-space limit becomes
``min(memory_bytes, total_memory_bytes // max_processes)``, and since at most ``max_processes``
processes can exist the total cannot exceed the cap either. That is strict, but it counts address
space rather than memory in use, so programs get less room than with a cgroup; the runner logs the
fallback once, and ``ExecutionRecord.memory_peak_bytes`` is None then. Without a cpu cgroup the
sandbox is pinned to ``ceil(cpu_cores)`` cores instead (``taskset``; the seccomp filter refuses
``sched_setaffinity`` so that a program cannot widen it), which caps it as tightly but takes the same
cores for every program so pinned (the runner deals them out in turn); ``cpu_time_s`` is None then.

Each program's cgroup is ``<teamrl's cgroup>/teamrl-<pid>/sandbox-<n>`` in each hierarchy; the sandbox
joins them before bubblewrap starts (``sh -c 'echo $$ > cgroup.procs; ...; exec bwrap ...'``), so
every process of the sandbox is in them from its first instruction. They are removed when the sandbox
has ended.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_log = logging.getLogger("teamrl.sandbox")

#: Name of the leaf teamrl moves its own process into on cgroup v2 (see the module docstring).
TRAINER_LEAF = "teamrl-trainer"


@dataclass(frozen=True)
class Hierarchy:
    """Where memory cgroups can be made: ``version`` 1 or 2 and teamrl's own cgroup directory."""

    version: int
    directory: Path


def cgroup_directories(mountinfo: str, proc_cgroup: str, controller: str = "memory") -> list[Hierarchy]:
    """The directories of this process's cgroups where ``controller`` may be, v2 first (any v2 cgroup:
    whether it has the controller is read from the cgroup itself), from the text of
    ``/proc/self/mountinfo`` and ``/proc/self/cgroup`` (pure: tested with made-up files).

    A mount's root (the 4th field of mountinfo) is the part of the hierarchy it shows: inside a
    container the cgroup path may be relative to it.
    """
    mounts: dict[str, tuple[str, str]] = {}  # "2" or "1" -> (mount root, mount point)
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _, options = line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup2":
            mounts.setdefault("2", (fields[3], fields[4]))
        elif fstype == "cgroup" and controller in options.split(","):
            mounts.setdefault("1", (fields[3], fields[4]))
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        key = "2" if controllers == "" else "1" if controller in controllers.split(",") else None
        if key is None or key not in mounts:
            continue
        root, point = mounts[key]
        relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        found.append(Hierarchy(int(key), Path(point) / ("" if relative == "." else relative)))
    return sorted(found, key=lambda hierarchy: -hierarchy.version)


#: The period the CPU cap is counted over, in microseconds (the kernel's default).
CPU_PERIOD_US = 100_000
# The sandbox joins each cgroup given (their count, then their cgroup.procs files), then runs the command.
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'


class SandboxCgroup:
    """The cgroups of one sandbox (module docstring): memory capped; CPU capped and counted where the
    hierarchy allows.

    Attributes:
        version: 1 or 2.
        memory: the memory cgroup (on v2 the one cgroup, which holds the cpu cap too).
        cpu: where the CPU cap is set (None: no cpu controller, the cap is not set here).
        cpuacct: where the CPU time is counted (None: not counted).
    """

    def __init__(self, version: int, memory: Path, limit_bytes: int, cpu_cores: float | None = None,
                 cpu: Path | None = None, cpuacct: Path | None = None):
        self.version, self.memory, self.cpu, self.cpuacct = version, memory, cpu, cpuacct
        self.paths = list(dict.fromkeys(path for path in (memory, cpu, cpuacct) if path is not None))
        made = []
        try:
            for path in self.paths:
                path.mkdir()
                made.append(path)
            self._limit_memory(limit_bytes)
            if cpu is not None and cpu_cores is not None:
                quota = max(int(cpu_cores * CPU_PERIOD_US), 1000)
                if version == 2:
                    (cpu / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")
                else:
                    (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (cpu / "cpu.cfs_quota_us").write_text(str(quota))
            elif cpu is not None:
                self.cpu = None
        except OSError:
            for path in reversed(made):
                path.rmdir()
            raise

    def _limit_memory(self, limit_bytes: int) -> None:
        if self.version == 2:
            (self.memory / "memory.max").write_text(str(limit_bytes))
            if (self.memory / "memory.swap.max").exists():
                (self.memory / "memory.swap.max").write_text("0")
        else:
            (self.memory / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if (self.memory / "memory.memsw.limit_in_bytes").exists():  # swap accounting on
                (self.memory / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))

    @property
    def cpu_capped(self) -> bool:
        """Whether this cgroup caps the sandbox's CPU share."""
        return self.cpu is not None

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` run by a shell that first joins these cgroups (so everything it starts is in them)."""
        procs = [str(path / "cgroup.procs") for path in self.paths]
        return ["/bin/sh", "-c", _JOIN, "teamrl-sandbox-cgroup", str(len(procs)), *procs, *command]

    def peak_bytes(self) -> int | None:
        """Most memory the cgroup's processes held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.memory / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed for the cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            lines = (self.memory / name).read_text().splitlines()
        except OSError:
            return 0
        return next((int(line.split()[1]) for line in lines if line.startswith("oom_kill ")), 0)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the cgroup's processes used together (None where it is not counted)."""
        try:
            if self.version == 2:
                lines = (self.memory / "cpu.stat").read_text().splitlines()
                return next(int(line.split()[1]) / 1e6 for line in lines if line.startswith("usage_usec "))
            if self.cpuacct is not None:
                return int((self.cpuacct / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError, StopIteration):
            return None
        return None


def remove_cgroup(path: Path, patience_s: float = 0.0) -> bool:
    """Remove an emptied cgroup directory, trying for up to ``patience_s`` (the kernel may take a moment
    to see the last process of a sandbox go); whether it is gone."""
    give_up = time.monotonic() + patience_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.01)


class CgroupFactory:
    """Makes a :class:`SandboxCgroup` per sandbox under ``<hierarchy>/teamrl-<pid>`` in each hierarchy.

    Args:
        version: the memory hierarchy's version.
        parent: teamrl's memory cgroup (on v2 the one cgroup of every controller).
        cpu: teamrl's cgroup where sandboxes get their CPU cap (on v2 ``parent`` itself, with the cpu
            controller on for its children; None: none can be capped).
        cpuacct: teamrl's cgroup where sandboxes' CPU time is counted (v1; None on v2 or where none).
    """

    def __init__(self, version: int, parent: Path, cpu: Path | None = None, cpuacct: Path | None = None):
        self.version, self.parent, self.cpu, self.cpuacct = version, parent, cpu, cpuacct
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._pending: list[Path] = []  # released cgroups the kernel had not emptied yet

    @property
    def parents(self) -> list[Path]:
        """teamrl's own cgroup in each hierarchy used."""
        return list(dict.fromkeys(path for path in (self.parent, self.cpu, self.cpuacct) if path is not None))

    def create(self, limit_bytes: int, cpu_cores: float | None = None) -> SandboxCgroup:
        """A new sandbox cgroup capped at ``limit_bytes`` of memory and, where a cpu controller is on,
        ``cpu_cores`` cores."""
        with self._lock:
            name = f"sandbox-{next(self._counter)}"
            self._pending = [path for path in self._pending if not remove_cgroup(path)]
        if self.version == 2:
            return SandboxCgroup(2, self.parent / name, limit_bytes, cpu_cores,
                                 cpu=self.parent / name if self.cpu is not None else None)
        return SandboxCgroup(1, self.parent / name, limit_bytes, cpu_cores,
                             cpu=self.cpu / name if self.cpu is not None else None,
                             cpuacct=self.cpuacct / name if self.cpuacct is not None else None)

    def release(self, cgroup: SandboxCgroup) -> None:
        """Remove a sandbox's cgroups once it has ended; one the kernel still holds is removed later,
        so that no sandbox waits for it."""
        for path in cgroup.paths:
            if not remove_cgroup(path):
                with self._lock:
                    self._pending.append(path)

    def remove(self) -> None:
        """Remove teamrl's cgroups (at exit, once its sandboxes are gone)."""
        for parent in self.parents:
            for child in parent.glob("sandbox-*"):
                if not remove_cgroup(child, patience_s=1.0):
                    _log.warning("could not remove the sandbox cgroup %s (processes still in it?)", child)
            remove_cgroup(parent)


def _prepare(hierarchy: Hierarchy, controller: str) -> Path | None:
    """teamrl's parent cgroup in ``hierarchy`` with ``controller`` on for its children (v2; on v1 the
    hierarchy is the controller's), or None."""
    directory = hierarchy.directory
    if hierarchy.version == 2 and not _v2_delegated(directory, controller):
        return None
    parent = directory / f"teamrl-{os.getpid()}"
    files = {"memory": "memory.limit_in_bytes", "cpu": "cpu.cfs_quota_us", "cpuacct": "cpuacct.usage"}
    try:
        parent.mkdir(exist_ok=True)
        if hierarchy.version == 2:
            (parent / "cgroup.subtree_control").write_text(f"+{controller}")
        elif not (parent / files[controller]).exists():
            parent.rmdir()
            return None
    except OSError:
        try:
            parent.rmdir()
        except OSError:
            pass
        return None
    return parent


def _v2_delegated(directory: Path, controller: str) -> bool:
    """Whether children of ``directory`` can get ``controller``, moving teamrl into a leaf first when it
    is alone in ``directory`` (see the module docstring)."""
    try:
        if controller not in (directory / "cgroup.controllers").read_text().split():
            return False
        if controller in (directory / "cgroup.subtree_control").read_text().split():
            return True
        members = {int(pid) for pid in (directory / "cgroup.procs").read_text().split()}
        if members != {os.getpid()} and members != set():
            return False
        if members:
            leaf = directory / TRAINER_LEAF
            leaf.mkdir(exist_ok=True)
            (leaf / "cgroup.procs").write_text(str(os.getpid()))
        (directory / "cgroup.subtree_control").write_text(f"+{controller}")
        return True
    except (OSError, ValueError):
        return False


@functools.cache
def sandbox_cgroups() -> CgroupFactory | None:
    """The factory of per-sandbox cgroups, or None where no memory cgroup can be made here (cached)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for hierarchy in cgroup_directories(mountinfo, proc_cgroup):
        parent = _prepare(hierarchy, "memory")
        if parent is None:
            continue
        if hierarchy.version == 2:
            factory = CgroupFactory(2, parent, cpu=parent if _v2_cpu(hierarchy.directory, parent) else None)
        else:
            factory = CgroupFactory(1, parent, cpu=_first_v1(mountinfo, proc_cgroup, "cpu"),
                                    cpuacct=_first_v1(mountinfo, proc_cgroup, "cpuacct"))
        atexit.register(factory.remove)
        return factory
    return None


def _v2_cpu(directory: Path, parent: Path) -> bool:
    """Whether the cpu controller could be turned on for the children of teamrl's cgroup ``parent``."""
    if not _v2_delegated(directory, "cpu"):
        return False
    try:
        (parent / "cgroup.subtree_control").write_text("+cpu")
    except OSError:  # e.g. a real-time thread in the way
        return False
    return True


def _first_v1(mountinfo: str, proc_cgroup: str, controller: str) -> Path | None:
    """teamrl's parent cgroup in the v1 hierarchy of ``controller``, or None."""
    for hierarchy in cgroup_directories(mountinfo, proc_cgroup, controller):
        if hierarchy.version == 1:
            return _prepare(hierarchy, controller)
    return None
