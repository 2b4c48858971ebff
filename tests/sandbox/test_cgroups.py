"""Finding a memory cgroup hierarchy, and per-sandbox cgroups that come and go."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from teamrl.sandbox import Program, SandboxPool
from teamrl.sandbox.cgroups import Hierarchy, cgroup_directories, sandbox_cgroups

V1_MOUNTINFO = """\
28 22 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
33 28 0:30 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
36 28 0:33 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 28 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_CGROUP = "9:name=systemd:/\n4:memory:/process_api/abc\n1:cpu:/\n0::/\n"

# A container whose cgroup namespace root is /docker/xyz: paths in /proc/self/cgroup are relative to it.
V2_MOUNTINFO = "30 25 0:27 /docker/xyz /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V2_CGROUP = "0::/docker/xyz/app\n"


def test_v1_memory_hierarchy_is_found_at_the_process_cgroup():
    found = cgroup_directories(V1_MOUNTINFO, V1_CGROUP)
    assert found[0] == Hierarchy(2, Path("/sys/fs/cgroup/unified"))  # v2 first, even when it has no memory
    assert Hierarchy(1, Path("/sys/fs/cgroup/memory/process_api/abc")) in found


def test_v2_paths_are_read_relative_to_the_mount_root():
    assert cgroup_directories(V2_MOUNTINFO, V2_CGROUP) == [Hierarchy(2, Path("/sys/fs/cgroup/app"))]


def test_no_memory_controller_means_no_hierarchy():
    mountinfo = "33 28 0:30 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    assert cgroup_directories(mountinfo, "1:cpu:/\n") == []


def test_each_sandbox_gets_its_own_cgroup_removed_afterwards(bubblewrap):
    factory = sandbox_cgroups()
    if factory is None:
        pytest.skip("no writable memory cgroup on this machine (the split-limit fallback is tested instead)")
    with SandboxPool(workers=2) as pool:
        records = pool.run([Program("def f():\n    return 1\n", ["assert f() == 1"]) for _ in range(3)])
    assert all(record.memory_peak_bytes and record.memory_peak_bytes < 256 << 20 for record in records)
    assert all(record.all_passed for record in records)
    # Each new cgroup first removes those the kernel still held on to when their sandbox ended.
    for _ in range(50):
        factory.release(factory.create(1 << 20))
        if not list(factory.parent.glob("sandbox-*")):
            break
        time.sleep(0.02)
    assert list(factory.parent.glob("sandbox-*")) == []
