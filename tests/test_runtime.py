"""What every entry point sets up in its process: torch's threads, a warning when the machine is too busy for
them, and the allocator's freed memory handed back. (The libraries' quiet output: tests/test_cli.py,
tests/models/test_loading.py and, for Ray actors,
tests/distributed/test_ray_backend.py.)"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from teamrl import runtime
from teamrl.cli import main
from teamrl.runtime import _malloc_trim, busy_machine_warning, release_freed_memory, use_threads
from teamrl.train import memory_metrics


@pytest.fixture
def machine(monkeypatch):
    """``machine(load, cores)``: the 1-minute load average and core count the runtime sees."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def set_machine(load: float, cores: int) -> None:
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(runtime, "other_runnable_now", lambda: load)
        monkeypatch.setattr(os, "cpu_count", lambda: cores)

    return set_machine


@pytest.mark.parametrize(("load", "cores", "threads", "fitting"), [
    (3.0, 2, 2, 1),  # the smoke run: other work on both cores
    (1.0, 2, 2, 1),  # one core taken: torch's second thread waits on it
    (10.0, 16, 16, 6),
])
def test_a_busy_machine_is_named_in_one_line_with_the_threads_that_fit(machine, load, cores, threads, fitting):
    machine(load, cores)
    assert busy_machine_warning(threads) == (
        f"teamrl: the machine is busy (load {load:.1f} on {cores} cores): torch's {threads} threads will contend; "
        f"pass --threads {fitting} (or set OMP_NUM_THREADS={fitting})")


@pytest.mark.parametrize(("load", "cores", "threads"), [(0.0, 2, 2), (0.4, 2, 2), (3.0, 2, 1), (6.0, 16, 8)])
def test_threads_the_machine_has_room_for_need_no_warning(machine, load, cores, threads):
    machine(load, cores)
    assert busy_machine_warning(threads) is None


def test_a_load_average_that_only_trails_an_earlier_command_is_no_reason_to_warn(machine, monkeypatch):
    machine(1.2, 2)  # the average right after another teamrl command...
    monkeypatch.setattr(runtime, "other_runnable_now", lambda: 0)  # ...which has ended: nothing else runs
    assert busy_machine_warning(2) is None


def test_the_warning_is_for_torchs_own_count_only(machine, monkeypatch, capsys):
    machine(3.0, 2)
    torch.set_num_threads(2)  # torch's count on 2 cores (the _two_threads fixture restores the test's)
    use_threads(None)
    assert capsys.readouterr().err == busy_machine_warning(2) + "\n"
    use_threads(1)  # the user chose: torch runs on it, and nothing is said
    assert torch.get_num_threads() == 1 and capsys.readouterr().err == ""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # chosen too, through the environment
    use_threads(None)
    assert capsys.readouterr().err == ""


def test_commands_that_run_models_take_threads_and_warn_once(machine, tiny_config, tmp_path, capsys):
    from teamrl.train import Trainer

    team = str(Trainer(tiny_config(steps=1)).save_team(tmp_path / "team"))
    capsys.readouterr()
    machine(3.0, 2)
    assert main(["generate", team, "--split", "eval", "--limit", "1"]) == 0
    err = capsys.readouterr().err
    assert err.count("teamrl: the machine is busy") == 1 and err.count("\n") == 1, err
    assert main(["generate", team, "--split", "eval", "--limit", "1", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit):
        main(["generate", team, "--threads", "0"])
    assert "--threads: must be >= 1 (got 0)" in capsys.readouterr().err
    for command in ("train", "demo", "eval"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--threads" in capsys.readouterr().out, command


@pytest.mark.skipif(not sys.platform.startswith("linux") or _malloc_trim() is None, reason="glibc's malloc_trim")
def test_memory_a_thread_freed_among_what_it_kept_is_returned():
    kept = []

    def fragment():  # 3000 blocks of 48 KiB (under glibc's mmap threshold) in a thread's arena, every 30th kept
        blocks = [torch.ones(12 * 1024) for _ in range(3000)]
        kept.extend(blocks[::30])

    thread = threading.Thread(target=fragment)
    thread.start()
    thread.join()
    before = memory_metrics()["memory/rss_gib"]
    release_freed_memory()
    after = memory_metrics()["memory/rss_gib"]
    assert before - after > 0.05, (before, after)  # about 140 MiB freed, but held by the arena until released
    assert len(kept) == 100 and all(float(block[-1]) == 1.0 for block in kept)
