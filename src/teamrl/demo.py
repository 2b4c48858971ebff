"""The main job: two agents of the bundled SmolLM2-135M-Instruct learn to cooperate on a laptop CPU.

``teamrl demo`` trains a LoRA adapter per agent on one shared frozen base with MAGRPO, offline, on
TL;DR-style two-level summaries of ACL paper abstracts (agent 0: one concise sentence; agent 1: a
detailed summary; one joint reward, DESIGN section 4), and reports the joint reward on held-out
papers before and after, an example, a reward-curve plot and the saved team.
"""

from __future__ import annotations

import textwrap
import time

from teamrl.config import load_config
from teamrl.run_dir import CURVE_FILE, METRICS_FILE
from teamrl.train import Trainer

DEMO_PRESET = "demo_tldr_cpu"


def run_demo(config_path: str | None = None, overrides: list[str] | None = None, *,
             eval_items: int = 32, eval_samples: int = 2, eval_seed: int = 0, overwrite: bool = False) -> int:
    """Run the demo; returns the process exit code. ``overwrite``: replace an earlier run in the run directory.

    The held-out evaluation samples with ``eval_seed``, not the training seed: runs with different
    training seeds are scored on the same draws, so their results differ only by what training did.
    Before and after are the run's own evaluations (``config.eval``) at step 0 and at its last step; the
    demo evaluates between them only when ``eval.every_steps`` is set (each costs as much as those two).
    """
    config = load_config(config_path or DEMO_PRESET, [*(overrides or []), f"eval.items={eval_items}",
                                                      f"eval.samples={eval_samples}", f"eval.seed={eval_seed}"])
    if not config.eval.every_steps:
        config.eval.every_steps = config.steps
    start = time.perf_counter()
    print(f"teamrl demo: {len(config.team.agents)} agents on {config.team.model!r} "
          f"({config.team.training}), task {config.env.name!r}, {config.steps} MAGRPO steps "
          f"(G={config.algorithm.num_generations}); run directory {config.run_dir}")
    print("Loading the model (the first run installs and converts the bundled model once)...", flush=True)
    with Trainer(config, overwrite=overwrite) as trainer:
        if not trainer.held_out_items:
            raise ValueError(f"env: {config.env.name!r} has no 'eval' items: the demo scores the team on them "
                             f"before and after training")
        print(f"Held-out evaluation before and after training ({eval_items} items x {eval_samples} samples)...",
              flush=True)
        evaluations: list[tuple[dict, list[dict]]] = []
        trainer.train(after_evaluation=lambda record, samples: evaluations.append((record, samples)))
        (before, before_samples), (after, after_samples) = evaluations[0], evaluations[-1]
        team_dir = trainer.save_team()

    print()
    print(f"Held-out joint reward (max {trainer.env.max_return(config.algorithm.num_turns):g}): "
          f"before {before['reward/mean']:.3f} ± {before['reward/std']:.3f}  ->  "
          f"after {after['reward/mean']:.3f} ± {after['reward/std']:.3f}")
    for label, prefix in (("by level (mean)", "reward/"), ("counts (mean, not reward)", "count/")):
        names = [k.removeprefix(prefix) for k in after
                 if k.startswith(prefix) and k not in ("reward/mean", "reward/std")]
        if names:
            print(f"  {label}:  " + "  ".join(
                f"{name} {before.get(prefix + name, 0):.2f}->{after[prefix + name]:.2f}" for name in names))
    print()
    row = typical_row([s["reward"] for s in before_samples], [s["reward"] for s in after_samples])
    print(f"Example: held-out item {before_samples[row]['item']}, before -> after "
          "(the joint action whose rewards are nearest the before and after means):")
    for label, sample in (("BEFORE", before_samples[row]), ("AFTER", after_samples[row])):
        print(f"[{label}] joint reward {sample['reward']:.2f}")
        for agent, text in zip(trainer.team, sample["actions"]):
            print(textwrap.indent(textwrap.fill(f"{agent.name}: {text}", 100), "  "))
    print()
    print(f"Reward curve: {trainer.run_dir / CURVE_FILE}")
    print(f"Saved team:   {team_dir}   (try: teamrl generate {team_dir})")
    print(f"Metrics:      {trainer.run_dir / METRICS_FILE}")
    print(f"Total time:   {time.perf_counter() - start:.0f} s")
    return 0


def typical_row(before: list[float], after: list[float]) -> int:
    """The evaluation row whose before and after rewards are together nearest their means: an example
    of what training typically changed, neither the best case nor the worst."""
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    return min(range(len(before)), key=lambda row: abs(before[row] - mean_before) + abs(after[row] - mean_after))
