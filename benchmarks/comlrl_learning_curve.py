"""teamrl vs CoMLRL learning efficiency: held-out joint reward against training minutes, each library at its own
settings, on the same items, reward and evaluation.

Where ``comlrl_side_by_side.py`` makes both libraries do identical work to compare their speed, this asks
what a user gets per minute: teamrl trains its main job's preset as it ships (``demo_tldr_cpu``: LoRA
adapters on one shared base; its steps, about 5 minutes' worth, scaled to the budget so that its
learning-rate schedule spans it: :func:`teamrl_steps`), CoMLRL its published defaults (two fully
fine-tuned SmolLM2-135M-Instruct, lr 5e-6, G = 4, one abstract per update, 64 new tokens, temperature
0.7). Both train on teamrl's ``tldr`` task over the offline ``aclsum`` abstracts with its joint reward,
from the bundled model's local directory, for ``--minutes`` of training (wall clock, evaluations left
out). One evaluation function (``side_by_side_worker.evaluate``: Hugging Face ``generate`` on each
agent's model, seeded) scores both teams on the same held-out abstracts at the start, every
``--eval-every-minutes`` and at the end, at each library's own sampling temperature. Each run is a
worker process of its own; libraries alternate which goes first per seed.

    pip install -e '.[bench]'                                    # CoMLRL 1.4.3 next to teamrl
    python benchmarks/comlrl_learning_curve.py --out runs/learning_curve_vs_comlrl --minutes 15 \\
        --eval-every-minutes 3 --seeds 0,1,2
    python benchmarks/comlrl_learning_curve.py --out /tmp/lc_smoke --minutes 0.2 --eval-every-minutes 0.1 \\
        --seeds 0 --eval-items 2 --eval-samples 1                 # smoke run, a few minutes

``OUT/results.json`` keeps every run and a re-run skips those already there; ``results.md``,
``results.csv``, ``curve.png`` and ``report.html`` are ``teamrl compare``'s tables and plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from comlrl_side_by_side import RunSpec, run_worker

from teamrl.evaluation import compare

#: Each library's own settings: teamrl's main-job preset; CoMLRL 1.4.3's published defaults.
TEAMRL_PRESET = "demo_tldr_cpu"
COMLRL_DEFAULTS = {"items": 1, "num_generations": 4, "max_new_tokens": 64, "lr": 5e-6, "temperature": 0.7}
#: Steps a CoMLRL run may take at most: more than any budget here buys (it needs its items listed up front).
MAX_STEPS = 2000
#: The training minutes the preset's ``steps`` take on 2 cores (docs/reports/learning-sweep.md): its learning-rate
#: schedule decays to 0 at the last step, so a budget of M minutes gets the preset's steps x M / PRESET_MINUTES.
PRESET_MINUTES = 5.0


def teamrl_steps(preset_steps: int, minutes: float) -> int:
    """teamrl's steps for a budget of ``minutes``: the preset's, scaled so that its schedule spans the budget
    (a faster machine ends them early; a slower one runs out of minutes first, its learning rate not yet 0)."""
    return max(1, math.ceil(preset_steps * minutes / PRESET_MINUTES))


def specs(args: argparse.Namespace, seed: int) -> dict[str, RunSpec]:
    """The two entrants' specs for ``seed``: teamrl's preset, CoMLRL's defaults; shared evaluation settings."""
    from teamrl.config import load_config

    preset = load_config(TEAMRL_PRESET)
    shared = {"turns": 1, "seed": seed, "minutes": args.minutes,
              "eval_every_minutes": args.eval_every_minutes, "eval_items": args.eval_items,
              "eval_samples": args.eval_samples, "eval_seed": args.eval_seed, "threads": args.threads,
              "max_text_chars": preset.env.kwargs["max_text_chars"]}
    teamrl = RunSpec(**shared, steps=teamrl_steps(preset.steps, args.minutes), items=preset.items_per_step,
                     num_generations=preset.algorithm.num_generations,
                     max_new_tokens=preset.team.sampling.max_new_tokens,
                     temperature=preset.team.sampling.temperature, teamrl_training=preset.team.training,
                     teamrl_lr=preset.optim.lr, teamrl_preset=TEAMRL_PRESET)
    return {"teamrl": teamrl, "comlrl": RunSpec(**shared, steps=MAX_STEPS, **COMLRL_DEFAULTS)}


def as_compare_run(entrant: str, spec: RunSpec, result: dict[str, Any]) -> dict[str, Any]:
    """A worker's learning curve in ``teamrl compare``'s run format, so its tables and plot apply (the worker
    ran on this machine, so it is this machine's name)."""
    overrides = (["(preset as shipped)"] if entrant == "teamrl" else
                 [f"{key}={value}" for key, value in COMLRL_DEFAULTS.items()])
    return {"spec": {"seed": spec.seed, "contender": entrant, "contender_overrides": overrides,
                     "config": TEAMRL_PRESET if entrant == "teamrl" else "CoMLRL 1.4.3 defaults", "overrides": [],
                     "minutes": spec.minutes, "steps": 0, "eval_items": spec.eval_items,
                     "eval_samples": spec.eval_samples, "eval_seed": spec.eval_seed, "parallel": 1,
                     "threads": spec.threads or 0},
            "max_reward": 3.0, "curve": result["curve"], "steps": [{"time/step": s} for s in result["step_times"]],
            "peak_rss_bytes": int(result["peak_rss_gb"] * 1e9), "machine": compare.machine()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for results and worker logs")
    parser.add_argument("--minutes", type=float, default=15.0, help="training minutes per run")
    parser.add_argument("--eval-every-minutes", type=float, default=3.0, help="evaluate every M training minutes")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    parser.add_argument("--eval-items", type=int, default=32, help="held-out abstracts per evaluation")
    parser.add_argument("--eval-samples", type=int, default=2, help="joint actions per held-out abstract")
    parser.add_argument("--eval-seed", type=int, default=1234, help="seed of every evaluation's sampling")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: torch's)")
    parser.add_argument("--python", default=sys.executable, help="interpreter with teamrl and comlrl")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.eval_items < 1 or args.eval_samples < 1:
        parser.error("--minutes must be > 0, --eval-items and --eval-samples >= 1")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / compare.RESULTS_JSON
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for index, seed in enumerate(seeds):
        entrants = list(specs(args, seed).items())
        for entrant, spec in entrants if index % 2 == 0 else entrants[::-1]:
            key = compare.run_key(entrant, seed)
            if key in results:
                print(f"{key}: already in {results_path}, skipped", flush=True)
                continue
            print(f"{key}: training {args.minutes:g} minutes...", flush=True)
            results[key] = as_compare_run(entrant, spec, run_worker(args.python, entrant, spec, args.out))
            results_path.write_text(json.dumps(results, indent=1))
            curve = results[key]["curve"]
            print(f"{key}: held-out {curve[0]['reward/mean']:.3f} -> {curve[-1]['reward/mean']:.3f} "
                  f"after {len(results[key]['steps'])} steps", flush=True)
    runs = {entrant: [results[compare.run_key(entrant, seed)] for seed in seeds] for entrant in ("teamrl", "comlrl")}
    compare.write_report(runs, args.out)
    print((args.out / compare.RESULTS_MD).read_text())


if __name__ == "__main__":
    main()
