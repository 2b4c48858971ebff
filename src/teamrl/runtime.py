"""What every teamrl entry point sets up in its process the same way: the libraries' console output
(:func:`quiet_libraries`), torch's threads (:func:`use_threads`) and the global random generators
(:func:`seed_everything`: the Trainer's process and each Ray agent actor), and the allocator's freed memory
(:func:`release_freed_memory`).

The command line calls both before it loads a model. A Ray actor is a process of its own, which inherits
neither the driver's warning filters nor, on a cluster, its environment: it calls :func:`quiet_libraries`
itself when its driver is quiet (:func:`libraries_quiet`).

This module imports neither torch nor transformers until a function needs them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import sys
import warnings

#: The settings of a quiet process that the libraries, and the child processes it starts (``teamrl compare``'s
#: runs, the workers of a Ray it starts), read from the environment when they start.
QUIET_ENVIRONMENT = {
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' own bars follow this one
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}

#: Cores' worth of other work the busy-machine check lets pass (a shell, an editor, a finishing command).
BUSY_SLACK = 0.5

_quiet = False


def quiet_libraries() -> None:
    """Keep the console to what teamrl reports: no progress bars (loading, GGUF conversion, writing model
    shards), info messages, FutureWarnings or DeprecationWarnings (about their own or each other's versions)
    from transformers, huggingface_hub, PEFT and torch, in this process and in the processes it starts.

    Set before the libraries are imported, as they read these settings then (what the user set in the
    environment stays), or directly when they already are (``teamrl.cli.main`` called in a Python session,
    a Ray actor).
    """
    global _quiet
    _quiet = True
    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def libraries_quiet() -> bool:
    """Whether this process has called :func:`quiet_libraries` (what a Ray actor is then told to do too)."""
    return _quiet


def use_threads(threads: int | None) -> None:
    """Run torch's operations on ``threads`` threads. ``None`` keeps torch's count (one per core, or
    ``OMP_NUM_THREADS``) and, when nobody chose it and other work keeps the machine busy, prints
    :func:`busy_machine_warning`'s line on stderr."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ and (warning := busy_machine_warning(torch.get_num_threads())):
        print(warning, file=sys.stderr)


def other_runnable_now() -> float:
    """Processes running or ready to run right now besides this one (Linux's /proc/loadavg); infinity
    where the system does not say."""
    try:
        with open("/proc/loadavg") as f:
            runnable = f.read().split()[3].split("/")[0]
    except (OSError, IndexError):
        return math.inf
    return max(0, int(runnable) - 1)


def busy_machine_warning(threads: int) -> str | None:
    """One line saying what to set when ``threads`` torch threads would contend with the machine's other
    work (its 1-minute load average), else ``None``.

    torch splits each operation over its threads and waits for the slowest: one thread whose core another
    process holds stalls them all, so on a busy 2-core machine a smoke run took 5x as long on torch's two
    threads as on one.
    """
    try:
        # The 1-minute average trails: right after an earlier command it still counts that command's
        # work. What runs now bounds it.
        load = min(os.getloadavg()[0], other_runnable_now())
    except (AttributeError, OSError):  # a platform without a load average
        return None
    cores = os.cpu_count() or 1
    fitting = max(1, math.floor(cores - load + BUSY_SLACK))  # the cores other work leaves, one at least
    if threads <= fitting:
        return None
    return (f"teamrl: the machine is busy (load {load:.1f} on {cores} cores): torch's {threads} threads will "
            f"contend; pass --threads {fitting} (or set OMP_NUM_THREADS={fitting})")


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global RNGs (what building a team may draw from, e.g. LoRA init)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand the memory this process freed back to the system, where the C library keeps it (glibc).

    Why: glibc keeps what a thread frees in that thread's arena for reuse, and decoding whose batch changes shape at
    every step (continuous batching: rows join and leave, each with its own length), spread over the threads of a
    gateway and its episodes, leaves those arenas fragmented: a program task's training measured 4.4 -> 8.0 GiB
    resident over 5 steps with 0.77 GiB of live tensors throughout, and 1.4 GiB after ``malloc_trim`` at every
    step (docs/reports/programs.md). Elsewhere a no-op."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
