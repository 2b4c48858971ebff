"""One memory cap for all the processes of one graded program: a memory cgroup per sandbox.

Resource limits (``setrlimit``) are per process, so a program that forks N children could take N
times ``SandboxLimits.memory_bytes`` from the host. A memory cgroup caps what all of them take
together (RAM, and swap where the kernel accounts it; the sandbox's scratch tmpfs counts too): past
``SandboxLimits.total_memory_bytes`` the kernel reclaims, then kills a process of that cgroup.

Where a cgroup can be used:

* **cgroup v2** (the unified hierarchy, e.g. systemd machines): the memory controller must be
  enabled for the children of the cgroup teamrl runs in. That holds when the cgroup was delegated
  with it (``systemd-run --user --scope -p Delegate=yes teamrl ...``) and teamrl's process is alone
  in it: teamrl then moves itself into a leaf (``teamrl-trainer``) so that its cgroup may have
  controlled children (the kernel forbids controllers on a cgroup that holds processes).
* **cgroup v1** (a ``memory`` hierarchy, as in many containers): teamrl needs write access to its
  own memory cgroup (as root in a container it usually has).

Otherwise (no writable memory cgroup, e.g. an unprivileged user without delegation) the sandbox falls
back to splitting the cap: each process's address-space limit becomes
``min(memory_bytes, total_memory_bytes // max_processes)``, and since at most ``max_processes``
processes can exist the total cannot exceed the cap either. That is strict, but it counts address
space rather than memory in use, so programs get less room than with a cgroup; the runner logs the
fallback once, and ``ExecutionRecord.memory_peak_bytes`` is None then.

Each program's cgroup is ``<teamrl's cgroup>/teamrl-<pid>/sandbox-<n>``; the sandbox joins it before
bubblewrap starts (``sh -c 'echo $$ > cgroup.procs; exec bwrap ...'``), so every process of the
sandbox is in it from its first instruction. The cgroup is removed when the sandbox has ended.
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


def cgroup_directories(mountinfo: str, proc_cgroup: str) -> list[Hierarchy]:
    """The directories of this process's memory-capable cgroups, v2 first, from the text of
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
        elif fstype == "cgroup" and "memory" in options.split(","):
            mounts.setdefault("1", (fields[3], fields[4]))
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        key = "2" if controllers == "" else "1" if "memory" in controllers.split(",") else None
        if key is None or key not in mounts:
            continue
        root, point = mounts[key]
        relative = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        found.append(Hierarchy(int(key), Path(point) / ("" if relative == "." else relative)))
    return sorted(found, key=lambda hierarchy: -hierarchy.version)


class MemoryCgroup:
    """The memory cgroup of one sandbox."""

    def __init__(self, version: int, path: Path, limit_bytes: int):
        self.version, self.path = version, path
        path.mkdir()
        try:
            if version == 2:
                (path / "memory.max").write_text(str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            else:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                if (path / "memory.memsw.limit_in_bytes").exists():  # swap accounting on
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        except OSError:
            path.rmdir()
            raise

    @property
    def procs_file(self) -> Path:
        """Writing a pid here moves that process into the cgroup."""
        return self.path / "cgroup.procs"

    def wrap(self, command: list[str]) -> list[str]:
        """``command`` run by a shell that first joins this cgroup (so everything it starts is in it)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.procs_file), *command]

    def peak_bytes(self) -> int | None:
        """Most memory the cgroup's processes held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes the kernel killed for the cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            lines = (self.path / name).read_text().splitlines()
        except OSError:
            return 0
        return next((int(line.split()[1]) for line in lines if line.startswith("oom_kill ")), 0)



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
    """Makes a :class:`MemoryCgroup` per sandbox under ``<hierarchy>/teamrl-<pid>``."""

    def __init__(self, hierarchy: Hierarchy, parent: Path):
        self.version, self.parent = hierarchy.version, parent
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._pending: list[Path] = []  # released cgroups the kernel had not emptied yet

    def create(self, limit_bytes: int) -> MemoryCgroup:
        """A new cgroup capped at ``limit_bytes``."""
        with self._lock:
            name = f"sandbox-{next(self._counter)}"
            self._pending = [path for path in self._pending if not remove_cgroup(path)]
        return MemoryCgroup(self.version, self.parent / name, limit_bytes)

    def release(self, cgroup: MemoryCgroup) -> None:
        """Remove a sandbox's cgroup once it has ended; one the kernel still holds is removed later,
        so that no sandbox waits for it."""
        if not remove_cgroup(cgroup.path):
            with self._lock:
                self._pending.append(cgroup.path)

    def remove(self) -> None:
        """Remove teamrl's cgroups (at exit, once its sandboxes are gone)."""
        for child in self.parent.glob("sandbox-*"):
            if not remove_cgroup(child, patience_s=1.0):
                _log.warning("could not remove the sandbox cgroup %s (processes still in it?)", child)
        remove_cgroup(self.parent)


def _prepare(hierarchy: Hierarchy) -> Path | None:
    """teamrl's parent cgroup in ``hierarchy`` with the memory controller on for its children, or None."""
    directory = hierarchy.directory
    if hierarchy.version == 2 and not _v2_memory_delegated(directory):
        return None
    parent = directory / f"teamrl-{os.getpid()}"
    try:
        parent.mkdir(exist_ok=True)
        if hierarchy.version == 2:
            (parent / "cgroup.subtree_control").write_text("+memory")
        elif not (parent / "memory.limit_in_bytes").exists():
            parent.rmdir()
            return None
    except OSError:
        try:
            parent.rmdir()
        except OSError:
            pass
        return None
    return parent


def _v2_memory_delegated(directory: Path) -> bool:
    """Whether children of ``directory`` can get the memory controller, moving teamrl into a leaf
    first when it is alone in ``directory`` (see the module docstring)."""
    try:
        if "memory" not in (directory / "cgroup.controllers").read_text().split():
            return False
        if "memory" in (directory / "cgroup.subtree_control").read_text().split():
            return True
        members = {int(pid) for pid in (directory / "cgroup.procs").read_text().split()}
        if members != {os.getpid()}:
            return False
        leaf = directory / TRAINER_LEAF
        leaf.mkdir(exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
        (directory / "cgroup.subtree_control").write_text("+memory")
        return True
    except (OSError, ValueError):
        return False


@functools.cache
def memory_cgroups() -> CgroupFactory | None:
    """The factory of per-sandbox memory cgroups, or None where none can be made here (cached)."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        return None
    for hierarchy in cgroup_directories(mountinfo, proc_cgroup):
        parent = _prepare(hierarchy)
        if parent is not None:
            factory = CgroupFactory(hierarchy, parent)
            atexit.register(factory.remove)
            return factory
    return None
