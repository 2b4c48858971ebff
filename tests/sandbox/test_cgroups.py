"""Finding a memory cgroup hierarchy, and per-sandbox cgroups that come and go."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from teamrl.sandbox import Program, SandboxPool
from teamrl.sandbox.cgroups import Hierarchy, SandboxCgroup, cgroup_directories, sandbox_cgroups

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


@pytest.mark.parametrize("version", [1, 2])
def test_a_sandbox_cgroup_caps_memory_and_cpu_and_counts_cpu_time(tmp_path, version):
    """The files each hierarchy's cgroup gets, on plain directories standing for cgroupfs."""
    memory, cpu, cpuacct = (tmp_path / name for name in ("memory", "cpu", "cpuacct"))
    if version == 2:
        cgroup = SandboxCgroup(2, memory, 1 << 20, cpu_cores=1.5, cpu=memory)
        assert (memory / "cpu.max").read_text() == "150000 100000" and (memory / "memory.max").read_text() == "1048576"
        (memory / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\n")
    else:
        cgroup = SandboxCgroup(1, memory, 1 << 20, cpu_cores=0.5, cpu=cpu, cpuacct=cpuacct)
        assert (cpu / "cpu.cfs_quota_us").read_text() == "50000" and (cpu / "cpu.cfs_period_us").read_text() == "100000"
        (cpuacct / "cpuacct.usage").write_text("2500000000\n")
    assert cgroup.cpu_capped and cgroup.cpu_seconds() == 2.5
    joined = cgroup.wrap(["bwrap", "..."])
    assert joined[-2:] == ["bwrap", "..."] and joined[4] == str(len(cgroup.paths))
    assert joined[5:5 + len(cgroup.paths)] == [str(path / "cgroup.procs") for path in cgroup.paths]


def test_without_a_cpu_controller_nothing_is_capped_or_counted(tmp_path):
    cgroup = SandboxCgroup(1, tmp_path / "memory", 1 << 20, cpu_cores=1.0)
    assert not cgroup.cpu_capped and cgroup.cpu_seconds() is None and cgroup.paths == [tmp_path / "memory"]
