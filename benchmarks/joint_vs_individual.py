"""Joint against individual rewards: MAGRPO's one shared reward against independent learners, all else equal.

Trains a config (default: the main job's preset ``demo_tldr_cpu``: two LoRA agents of the bundled
SmolLM2-135M-Instruct writing TL;DR-style summaries of ACL abstracts) once with
``algorithm.learners=joint`` and once with ``algorithm.learners=individual`` (each agent learns from its
own reward of its own completion, docs/tasks.md) for every seed, and reports the held-out
*joint* reward before and after training. The joint reward is the yardstick for both: it is the team's
task, whatever each run learned from. As in ``teamrl demo``, the held-out evaluation samples with its
own seed (``--eval-seed``), so runs are scored on the same draws and differ only by what training did;
the two runs of one seed start from the same weights, so their "before" agree.

Each run is a process of its own (run directory ``OUT/LEARNERS-seedS``), so every run starts with a
fresh memory and nothing of one leaks into the next. ``OUT/results.json`` is rewritten after every run
and a re-run skips the runs already in it (a killed comparison continues where it stopped);
``OUT/results.md`` holds the tables. The full comparison (3 seeds x 2 kinds of learner x the
preset's 20 steps, about 45 minutes on 2 CPU cores)::

    python benchmarks/joint_vs_individual.py --out runs/joint_vs_individual

Any ``field=value`` after the options overrides the config for every run (``steps=1``); for a smoke
test of the script::

    python benchmarks/joint_vs_individual.py --out /tmp/jvi --seeds 0 --eval-items 2 --eval-samples 1 steps=1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

LEARNERS = ("joint", "individual")
RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"


def run_key(learners: str, seed: int) -> str:
    """A run's name: its run directory under OUT and its key in results.json."""
    return f"{learners}-seed{seed}"


def train_and_evaluate(spec: dict) -> dict:
    """One run (in this process): held-out joint reward before training, training, and after."""
    from teamrl.config import load_config
    from teamrl.train import Trainer

    overrides = [*spec["overrides"], f"algorithm.learners={spec['learners']}", f"seed={spec['seed']}",
                 f"run_dir={spec['run_dir']}", "logging.progress_bar=false",
                 "eval.every_steps=0"]  # evaluated before and after below, not by the trainer
    config = load_config(spec["config"], overrides)
    evaluation = {"max_items": spec["eval_items"], "num_samples": spec["eval_samples"], "seed": spec["eval_seed"]}
    start = time.perf_counter()
    with Trainer(config) as trainer:  # holds the run directory until the run is over
        before = trainer.evaluate(**evaluation)
        history = trainer.train()
        after = trainer.evaluate(**evaluation)
        max_reward = trainer.env.max_reward
    return {"spec": spec, "learners": spec["learners"], "seed": spec["seed"], "steps": len(history),
            "max_reward": max_reward, "before": before, "after": after, "seconds": time.perf_counter() - start}


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarise(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind of learner: mean and spread (sample standard deviation over seeds) of the held-out joint
    reward before and after training and of the gain, and the mean of each reward part after."""
    summary = {}
    for learners in dict.fromkeys(run["learners"] for run in runs):
        mine = [run for run in runs if run["learners"] == learners]
        before, after = ([run[when]["reward/mean"] for run in mine] for when in ("before", "after"))
        row = {"seeds": float(len(mine))}
        for name, values in (("before", before), ("after", after), ("gain", [a - b for a, b in zip(after, before)])):
            row[f"{name}_mean"], row[f"{name}_std"] = _mean_std(values)
        parts = sorted({key for run in mine for key in run["after"]} - {"reward/mean", "reward/std"})
        # A gated reward's unreached parts are absent from a run's metrics: they count as zero.
        row.update({f"after_{key}": statistics.fmean(run["after"].get(key, 0.0) for run in mine) for key in parts})
        summary[learners] = row
    return summary


def markdown(runs: list[dict], summary: dict[str, dict[str, float]]) -> str:
    """The tables of results.md: per kind of learner over seeds, per run, and the reward parts after."""
    max_reward = runs[0]["max_reward"]
    lines = [f"Held-out joint reward (max {max_reward:g}), mean ± spread over seeds:", "",
             "| learners | seeds | before | after | gain |", "|---|---|---|---|---|"]
    for learners, row in summary.items():
        cells = [f"{row[f'{name}_mean']:.3f} ± {row[f'{name}_std']:.3f}" for name in ("before", "after", "gain")]
        lines.append(f"| {learners} | {int(row['seeds'])} | " + " | ".join(cells) + " |")
    lines += ["", "| learners | seed | steps | before | after | gain | minutes |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        before, after = run["before"]["reward/mean"], run["after"]["reward/mean"]
        lines.append(f"| {run['learners']} | {run['seed']} | {run['steps']} | {before:.3f} | {after:.3f} | "
                     f"{after - before:+.3f} | {run['seconds'] / 60:.1f} |")
    parts = sorted({key for row in summary.values() for key in row if key.startswith("after_reward/")})
    names = [key.removeprefix("after_reward/") for key in parts]
    lines += ["", "Joint reward parts after training (mean over seeds):", "",
              "| learners | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for learners, row in summary.items():
        lines.append(f"| {learners} | " + " | ".join(f"{row.get(key, 0.0):.3f}" for key in parts) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="demo_tldr_cpu", help="config file or preset name")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    parser.add_argument("--learners", default=",".join(LEARNERS), help="kinds of learner, comma-separated")
    parser.add_argument("--eval-items", type=int, default=16, help="held-out items evaluated (teamrl demo's)")
    parser.add_argument("--eval-samples", type=int, default=2, help="joint actions sampled per held-out item")
    parser.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out evaluation's sampling")
    parser.add_argument("--out", default="runs/joint_vs_individual", help="folder for the runs and results")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC_JSON", "RESULT_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="field=value config overrides for every run")
    args = parser.parse_args()
    if args.worker:
        spec_json, result_json = args.worker
        Path(result_json).write_text(json.dumps(train_and_evaluate(json.loads(spec_json))))
        return

    learner_kinds = args.learners.split(",")
    unknown = set(learner_kinds) - set(LEARNERS)
    if unknown:
        parser.error(f"--learners: unknown {sorted(unknown)}; use {', '.join(LEARNERS)}")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / RESULTS_JSON
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for seed in seeds:
        for learners in learner_kinds:
            key = run_key(learners, seed)
            run_dir = out / key
            spec = {"config": args.config, "overrides": args.overrides, "learners": learners, "seed": seed,
                    "run_dir": str(run_dir), "eval_items": args.eval_items, "eval_samples": args.eval_samples,
                    "eval_seed": args.eval_seed}
            if key in results:
                if results[key]["spec"] != spec:
                    sys.exit(f"{results_path}: {key} was run with other settings ({results[key]['spec']}); "
                             "use another --out")
                print(f"{key}: already in {results_path}, skipped", flush=True)
                continue
            shutil.rmtree(run_dir, ignore_errors=True)  # a run killed before it reported: start it again
            print(f"{key}: training...", flush=True)
            result_file = out / f"{key}.json"
            subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec), str(result_file)], check=True)
            results[key] = json.loads(result_file.read_text())
            result_file.unlink()
            results_path.write_text(json.dumps(results, indent=1))
            run = results[key]
            print(f"{key}: held-out joint reward {run['before']['reward/mean']:.3f} -> "
                  f"{run['after']['reward/mean']:.3f} ({run['seconds'] / 60:.1f} min)", flush=True)
    runs = [results[run_key(learners, seed)] for learners in learner_kinds for seed in seeds]
    table = markdown(runs, summarise(runs))
    (out / RESULTS_MD).write_text(table)
    print()
    print(table)
    print(f"Written: {results_path}, {out / RESULTS_MD}")


if __name__ == "__main__":
    main()
