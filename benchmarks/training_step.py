"""Where a training step's time and memory go, for one or more versions of teamrl side by side.

Runs ``--steps`` MAGRPO steps of a config (default: the main job, ``demo_tldr_cpu``) and reports,
per step, the time spent generating, updating and on everything else (rewards, advantages: ``reward_s``),
generated tokens/s, joint actions/s and
the process's resident memory after the step (so growth over a run shows), then the peak RSS.

Each ``--src`` is a source tree (a checkout's ``src`` folder) run in its own fresh process with that
tree first on ``sys.path``, alternating over ``--repeats`` rounds so that machine noise hits every
version alike; the table gives medians and each version's ratios against the first. Without
``--src`` the installed teamrl is measured alone. To compare with an older commit::

    git worktree add /tmp/teamrl-before <commit>
    python benchmarks/training_step.py --src /tmp/teamrl-before/src --src src --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    """This process's resident memory now (MB), read from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(config: str, overrides: list[str], steps: int) -> dict:
    """Run ``steps`` training steps in this process; return per-step timings and memory."""
    import torch

    from teamrl.config import load_config
    from teamrl.train import Trainer

    torch.set_num_threads(int(os.environ.get("TEAMRL_BENCH_THREADS", "2")))
    # A run directory of its own: the config's may hold a real run, which a Trainer refuses to build on.
    with tempfile.TemporaryDirectory(prefix="teamrl-bench-") as run_dir:
        cfg = load_config(config, ["logging.sample_every=0", "logging.progress_bar=false", f"run_dir={run_dir}",
                                   *overrides])
        trainer = Trainer(cfg)
        records = []
        for _ in range(steps):
            metrics = trainer.train_step()
            joint_actions = sum(v for k, v in metrics.items() if k.endswith("/joint_actions"))
            records.append({
                "step_s": metrics["time/step"],
                "generation_s": metrics["time/generation"],
                "update_s": metrics["time/update"],
                "reward_s": metrics["time/step"] - metrics["time/generation"] - metrics["time/update"],
                "tokens": metrics["tokens/generated"],
                "joint_actions": joint_actions,
                "reward": metrics["reward/mean"],
                "rss_mb": _rss_mb(),
            })
    return {"steps": records, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def summarise(run: dict, skip_first: bool) -> dict[str, float]:
    """Medians over a run's steps (the first, which warms caches up, left out when there are others)."""
    steps = run["steps"][1:] if skip_first and len(run["steps"]) > 1 else run["steps"]
    med = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    return {
        "step_s": med["step_s"], "generation_s": med["generation_s"], "reward_s": med["reward_s"],
        "update_s": med["update_s"],
        "tokens_per_s": statistics.median(s["tokens"] / s["step_s"] for s in steps),
        "joint_actions_per_s": statistics.median(s["joint_actions"] / s["step_s"] for s in steps),
        "peak_rss_mb": run["peak_rss_mb"],
        "rss_growth_mb": run["steps"][-1]["rss_mb"] - run["steps"][0]["rss_mb"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo_tldr_cpu", help="config file or preset name")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per version (medians are reported)")
    parser.add_argument("--src", action="append", default=[], help="a teamrl source tree to measure (repeatable)")
    parser.add_argument("--out", default=None, help="write every measurement as JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.config, args.overrides, args.steps)))
        return

    versions = args.src or [None]
    runs: dict[str, list[dict]] = {str(v): [] for v in versions}
    for _ in range(args.repeats):
        for version in versions:
            env = dict(os.environ)
            if version is not None:
                env["PYTHONPATH"] = os.pathsep.join([str(Path(version).resolve()), env.get("PYTHONPATH", "")])
            command = [sys.executable, __file__, "--worker", "--config", args.config, "--steps", str(args.steps),
                       *args.overrides]
            started = time.perf_counter()
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                sys.exit(f"{version or 'installed teamrl'} failed:\n{out.stderr[-3000:]}")
            runs[str(version)].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  {version or 'installed'}: run done in {time.perf_counter() - started:.0f} s", file=sys.stderr)

    rows = {}
    for version, version_runs in runs.items():
        summaries = [summarise(r, skip_first=True) for r in version_runs]
        rows[version] = {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}
    baseline = rows[str(versions[0])]
    keys = list(baseline)
    print(f"\n{args.config} {' '.join(args.overrides)}: {args.steps} steps x {args.repeats} runs, medians")
    print("| version | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for version, row in rows.items():
        print(f"| {version} | " + " | ".join(f"{row[k]:.2f}" for k in keys) + " |")
    if len(rows) > 1:
        for version, row in list(rows.items())[1:]:
            print(f"\n{version} vs {versions[0]}: step time x{row['step_s'] / baseline['step_s']:.2f}, "
                  f"throughput x{row['joint_actions_per_s'] / baseline['joint_actions_per_s']:.2f}, "
                  f"peak RSS x{row['peak_rss_mb'] / baseline['peak_rss_mb']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"config": args.config, "overrides": args.overrides, "runs": runs,
                                              "medians": rows}, indent=2))


if __name__ == "__main__":
    main()
