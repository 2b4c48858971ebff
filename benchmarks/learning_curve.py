"""Held-out joint reward against training time: how fast a config makes a better team, over seeds.

Trains each *variant* (a name and config overrides on a base config, default the main job's preset
``demo_tldr_cpu``) for every seed, scores the team on held-out items at step 0 and then every
``--eval-every-steps`` steps or ``--eval-every-minutes`` minutes of training (whichever comes first),
and stops after ``--minutes`` minutes of training or ``--steps`` steps. Training time is the sum of
the steps' own time (``time/step``): evaluation is not counted. As in ``teamrl demo``, the held-out
evaluation samples with its own seed (``--eval-seed``), so runs are scored on the same draws and
differ only by what training did.

Each run is a process of its own (run directory ``OUT/VARIANT-seedS``); ``OUT/results.json`` is
rewritten after every run and a re-run skips the runs already in it (a killed sweep continues where
it stopped); ``OUT/results.md`` holds the tables and ``OUT/curve.png`` the curves. ``--parallel N``
runs N at a time (each with ``--threads`` torch threads): their rewards are what one run alone gets,
their times are not (compare times only between runs made alone).

    python benchmarks/learning_curve.py --out runs/lc --seeds 0,1,2 --minutes 5 --eval-every-minutes 1 \\
        --variant "default:" --variant "lr5e-4: optim.lr=5e-4"
    python benchmarks/learning_curve.py --out /tmp/lc --seeds 0 --steps 1 --eval-items 2 --eval-samples 1 \\
        --variant "smoke: steps=1"                                             # smoke test of the script

A variant is ``NAME: field=value field=value ...`` (overrides split like a shell line); overrides after
the options apply to every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME: a=1 b=2"`` -> ``("NAME", ["a=1", "b=2"])``."""
    name, sep, overrides = text.partition(":")
    name = name.strip()
    if not sep or not name or "/" in name:
        raise ValueError(f"--variant {text!r}: write it as 'NAME: field=value ...' (a name without '/')")
    return name, shlex.split(overrides)


def run_key(variant: str, seed: int) -> str:
    """A run's name: its run directory under OUT and its key in results.json."""
    return f"{variant}-seed{seed}"


def train_with_evaluations(spec: dict) -> dict:
    """One run (in this process): held-out evaluations at step 0 and on the schedule, training between."""
    from teamrl.config import load_config
    from teamrl.train import Trainer

    overrides = [*spec["overrides"], f"seed={spec['seed']}", f"run_dir={spec['run_dir']}",
                 "logging.progress_bar=false", "checkpoint.save_every=0"]
    config = load_config(spec["config"], overrides)
    max_steps = min(config.steps, spec["steps"]) if spec["steps"] else config.steps
    evaluation = {"max_items": spec["eval_items"], "num_samples": spec["eval_samples"], "seed": spec["eval_seed"]}
    every_steps, every_seconds = spec["eval_every_steps"], 60 * spec["eval_every_minutes"]
    budget = 60 * spec["minutes"] if spec["minutes"] else float("inf")
    curve, steps = [], []
    with Trainer(config) as trainer:  # holds the run directory until the run is over

        def evaluate(train_seconds: float) -> None:
            began = time.perf_counter()
            result = trainer.evaluate(**evaluation)
            curve.append({"step": trainer.step, "train_seconds": train_seconds,
                          "eval_seconds": time.perf_counter() - began, **result})
            print(f"  step {trainer.step:3d}, {train_seconds / 60:5.2f} min of training: held-out "
                  f"{result['reward/mean']:.3f}", flush=True)

        evaluate(0.0)
        train_seconds, last_eval_step, last_eval_seconds = 0.0, 0, 0.0
        while trainer.step < max_steps and train_seconds < budget:
            metrics = trainer.train_step()
            steps.append(metrics)
            train_seconds += metrics["time/step"]
            done = trainer.step >= max_steps or train_seconds >= budget
            due = ((every_steps and trainer.step - last_eval_step >= every_steps)
                   or (every_seconds and train_seconds - last_eval_seconds >= every_seconds))
            if due or done:
                evaluate(train_seconds)
                last_eval_step, last_eval_seconds = trainer.step, train_seconds
        max_reward = trainer.env.max_reward
    return {"spec": spec, "max_reward": max_reward, "curve": curve,
            "steps": [{key: value for key, value in m.items() if key.startswith(("reward/", "time/", "step"))}
                      for m in steps]}


def reward_at(run: dict, seconds: float) -> float:
    """The held-out reward of the last evaluation at or before ``seconds`` of training."""
    return [point for point in run["curve"] if point["train_seconds"] <= seconds + 1e-9][-1]["reward/mean"]


def minutes_to_gain(run: dict, gain: float) -> float | None:
    """Training minutes at the first evaluation whose reward is ``gain`` above step 0's; None if never."""
    start = run["curve"][0]["reward/mean"]
    return next((point["train_seconds"] / 60 for point in run["curve"] if point["reward/mean"] - start >= gain), None)


def _mean_sd(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def markdown(runs: dict[str, list[dict]], gains: tuple[float, ...] = (0.5, 1.0)) -> str:
    """results.md: per variant over seeds, then per run (before, after, gain, steps, time, minutes to gains)."""
    max_reward = next(iter(runs.values()))[0]["max_reward"]
    lines = [f"Held-out joint reward (max {max_reward:g}); mean ± sd over seeds; training time excludes evaluation.",
             "", "| variant | seeds | before | after | gain | min gain | steps | s/step |", "|---" * 8 + "|"]
    for variant, mine in runs.items():
        before = [run["curve"][0]["reward/mean"] for run in mine]
        after = [run["curve"][-1]["reward/mean"] for run in mine]
        gain = [a - b for a, b in zip(after, before)]
        step_seconds = [s["time/step"] for run in mine for s in run["steps"]]
        lines.append(f"| {variant} | {len(mine)} | {_mean_sd(before)} | {_mean_sd(after)} | {_mean_sd(gain)} | "
                     f"{min(gain):+.3f} | {statistics.fmean(len(run['steps']) for run in mine):.1f} | "
                     f"{statistics.median(step_seconds) if step_seconds else 0:.1f} |")
    lines += ["", "| run | held-out reward at each evaluation (step: reward) | "
              + " | ".join(f"min to +{g:g}" for g in gains) + " |", "|---|---|" + "---|" * len(gains)]
    for variant, mine in runs.items():
        for run in mine:
            points = ", ".join(f"{p['step']}: {p['reward/mean']:.2f}" for p in run["curve"])
            reached = [minutes_to_gain(run, g) for g in gains]
            lines.append(f"| {run_key(variant, run['spec']['seed'])} | {points} | "
                         + " | ".join("-" if m is None else f"{m:.1f}" for m in reached) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Held-out reward against training minutes: each variant's seed mean, its band the seeds' min..max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for variant, mine in runs.items():
        ends = sorted({p["train_seconds"] for run in mine for p in run["curve"]})
        values = [[reward_at(run, t) for run in mine] for t in ends]
        minutes = [t / 60 for t in ends]
        line, = axes.plot(minutes, [statistics.fmean(v) for v in values], label=f"{variant} ({len(mine)} seeds)")
        axes.fill_between(minutes, [min(v) for v in values], [max(v) for v in values], alpha=0.2,
                          color=line.get_color(), step=None)
    axes.set_xlabel("training minutes (evaluation excluded)")
    axes.set_ylabel("held-out joint reward")
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo_tldr_cpu", help="config file or preset name")
    parser.add_argument("--variant", action="append", help="'NAME: field=value ...' (repeatable; required)")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    parser.add_argument("--minutes", type=float, default=0.0, help="training minutes per run (0 = no limit)")
    parser.add_argument("--steps", type=int, default=0, help="most training steps per run (0 = the config's)")
    parser.add_argument("--eval-every-steps", type=int, default=0, help="evaluate every N steps (0 = off)")
    parser.add_argument("--eval-every-minutes", type=float, default=0.0, help="evaluate every M training minutes")
    parser.add_argument("--eval-items", type=int, default=32, help="held-out items evaluated")
    parser.add_argument("--eval-samples", type=int, default=2, help="joint actions sampled per held-out item")
    parser.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out evaluation's sampling")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = torch's default)")
    parser.add_argument("--out", default="runs/learning_curve", help="folder for the runs and results")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC_JSON", "RESULT_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="field=value config overrides for every variant")
    args = parser.parse_args()
    if args.worker:
        spec_json, result_json = args.worker
        Path(result_json).write_text(json.dumps(train_with_evaluations(json.loads(spec_json))))
        return
    if not args.variant:
        parser.error("give at least one --variant 'NAME: field=value ...' ('default:' runs the config as it is)")
    try:
        variants = dict(parse_variant(text) for text in args.variant)
    except ValueError as err:
        parser.error(str(err))
    seeds = [int(seed) for seed in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / RESULTS_JSON
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    environment = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    pending: list[tuple[str, dict]] = []
    for variant, overrides in variants.items():
        for seed in seeds:
            key = run_key(variant, seed)
            spec = {"config": args.config, "overrides": [*args.overrides, *overrides], "seed": seed,
                    "run_dir": str(out / key), "minutes": args.minutes, "steps": args.steps,
                    "eval_every_steps": args.eval_every_steps, "eval_every_minutes": args.eval_every_minutes,
                    "eval_items": args.eval_items, "eval_samples": args.eval_samples, "eval_seed": args.eval_seed,
                    "threads": args.threads}
            if key in results:
                if results[key]["spec"] != spec:
                    sys.exit(f"{results_path}: {key} was run with other settings; use another --out or variant name")
                print(f"{key}: already in {results_path}, skipped", flush=True)
                continue
            pending.append((key, spec))
    running: list[tuple[str, subprocess.Popen, Path]] = []
    while pending or running:
        while pending and len(running) < args.parallel:
            key, spec = pending.pop(0)
            shutil.rmtree(spec["run_dir"], ignore_errors=True)  # a run killed before it reported: start again
            result_file = out / f"{key}.result.json"
            log = (out / f"{key}.log").open("w")
            print(f"{key}: training... (log {out / key}.log)", flush=True)
            process = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec), str(result_file)],
                                       stdout=log, stderr=subprocess.STDOUT, env=environment)
            running.append((key, process, result_file))
        time.sleep(2)
        for entry in [entry for entry in running if entry[1].poll() is not None]:
            running.remove(entry)
            key, process, result_file = entry
            if process.returncode != 0:
                sys.exit(f"{key}: failed (exit {process.returncode}); see {out / key}.log")
            results[key] = json.loads(result_file.read_text())
            result_file.unlink()
            results_path.write_text(json.dumps(results, indent=1))
            curve = results[key]["curve"]
            print(f"{key}: held-out {curve[0]['reward/mean']:.3f} -> {curve[-1]['reward/mean']:.3f} "
                  f"after {len(results[key]['steps'])} steps", flush=True)
    runs = {variant: [results[run_key(variant, seed)] for seed in seeds] for variant in variants}
    table = markdown(runs)
    (out / RESULTS_MD).write_text(table)
    plot(runs, out / "curve.png")
    print()
    print(table)
    print(f"Written: {results_path}, {out / RESULTS_MD}, {out / 'curve.png'}")


if __name__ == "__main__":
    main()
