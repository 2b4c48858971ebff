"""teamrl vs CoMLRL side by side: the same MAGRPO work through both libraries, ratios from one invocation.

Both libraries train the same two-agent team of the bundled SmolLM2-135M-Instruct (the same local
transformers directory, full fine-tuning: CoMLRL 1.4.3 has no LoRA) on teamrl's ``tldr`` task over
the offline ``aclsum`` abstracts, with the same prompts, the same joint reward, G, turns, max new
tokens, items per update, number of updates, learning rate, optimiser and advantage. Each library
runs in its own subprocess (``side_by_side_worker.py``) so its peak RSS is its own; the held-out joint
reward before and after training comes from one evaluation function shared by both workers.

    pip install -e '.[bench]'            # CoMLRL 1.4.3 next to teamrl (see docs/performance.md)
    python benchmarks/comlrl_side_by_side.py --out runs/side_by_side.json
    python benchmarks/comlrl_side_by_side.py --turns 1 --steps 1 --items 1 --num-generations 2 \\
        --max-new-tokens 24 --eval-items 2 --eval-samples 1 --repeats 1 --threads 1 \\
        --out /tmp/smoke.json                                               # smoke run, ~2 minutes
    python benchmarks/comlrl_side_by_side.py --teamrl-training full lora --out runs/side_by_side.json
                                     # adds teamrl's default (LoRA) against CoMLRL's only mode (full)

This module holds the orchestration and the pure parts (matched configs, medians, ratios, the
table); it imports neither torch nor either library, so its tests run in well under a second.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What the table compares: teamrl doing CoMLRL's work (full fine-tuning), teamrl with its default LoRA
#: (``--teamrl-training lora``: no longer identical work, CoMLRL has no LoRA), and CoMLRL.
ENTRANTS = ("teamrl", "teamrl-lora", "comlrl")
#: Each teamrl entrant's ratio row (``ratio`` keeps the matched comparison's name).
RATIOS = {"teamrl": "ratio", "teamrl-lora": "ratio_lora"}
WORKER = Path(__file__).with_name("side_by_side_worker.py")
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Seat names of the two agents (teamrl needs names; CoMLRL indexes agents).
AGENT_NAMES = ("summarizer", "elaborator")

#: torch.optim.AdamW's default weight decay. CoMLRL builds ``AdamW(params, lr=...)`` and so uses it;
#: teamrl's default is 0, so teamrl is given this value to run the same optimiser.
TORCH_ADAMW_WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class RunSpec:
    """The work both libraries do in one run; every field means the same thing on both sides."""

    turns: int
    steps: int = 4
    items: int = 2
    num_generations: int = 4
    max_new_tokens: int = 64
    lr: float = 5e-6
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_text_chars: int = 500
    eval_items: int = 8
    eval_samples: int = 2
    eval_seed: int = 1234
    eval_before: bool = True
    threads: int | None = None
    """torch intra-op threads in both workers (None: torch's default, one per core)."""
    dtype: str = "float32"
    """Parameter dtype of every model on both sides ("float32" or "bfloat16"). teamrl's LoRA adapters and
    their optimiser state stay float32 whatever this is; full fine-tuning (CoMLRL's only mode) trains every
    weight in this dtype."""
    teamrl_training: str = "full"
    """teamrl's training mode: "full" (the matched work) or "lora" (teamrl's default, which CoMLRL lacks:
    one adapter per agent on one shared frozen base; then the libraries no longer do identical work)."""
    teamrl_lr: float | None = None
    """teamrl's learning rate when it differs from CoMLRL's (LoRA adapters need a larger one); None: ``lr``."""
    teamrl_preset: str | None = None
    """Train teamrl with this preset's config (its own settings, e.g. ``demo_tldr_cpu``) instead of the matched
    one; only the model (the same local directory), seed and steps are set (``comlrl_learning_curve.py``)."""
    minutes: float = 0.0
    """Learning-curve mode (when > 0): train for this many minutes of training (wall clock, evaluations
    excluded) instead of ``steps``, evaluating at the start, every ``eval_every_minutes`` and at the end."""
    eval_every_minutes: float = 0.0

    def to_json(self) -> str:
        """The spec as JSON, as a worker reads it from its command line."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))


def nodes_per_item(spec: RunSpec) -> int:
    """Expansion points per item in the aligned tree: 1 at turn 1, then G per node of the previous turn."""
    return sum(spec.num_generations ** t for t in range(spec.turns))


def joint_actions_per_step(spec: RunSpec) -> int:
    """Joint actions one step scores: G per expansion point (aligned), over every turn of every item."""
    return spec.items * nodes_per_item(spec) * spec.num_generations


def teamrl_config(spec: RunSpec, model_dir: str, run_dir: str) -> dict[str, Any]:
    """teamrl's config data (for ``teamrl.config.config_from_dict``) for ``spec``.

    Chosen to be CoMLRL's MAGRPO: full fine-tuning, the paper's mean baseline without std
    normalisation, log-probs summed over tokens and averaged over sequences, one optimiser pass,
    no KL, no gradient clipping (CoMLRL clips nothing), AdamW with torch's default weight decay.
    With ``spec.teamrl_training == "lora"``, teamrl trains its default instead: a rank-16 adapter per
    agent on one shared frozen base, at ``spec.teamrl_lr``.
    """
    lora = spec.teamrl_training == "lora"
    return {
        "env": {"name": "tldr", "kwargs": {"source": "aclsum", "max_text_chars": spec.max_text_chars}},
        "team": {
            "model": model_dir,
            "training": spec.teamrl_training,
            **({"lora": {"r": 16, "alpha": 32}} if lora else {}),
            "sampling": {"max_new_tokens": spec.max_new_tokens, "temperature": spec.temperature,
                         "top_p": spec.top_p, "top_k": spec.top_k},
            "agents": [{"name": name} for name in AGENT_NAMES],
            "use_chat_template": True,
            "dtype": spec.dtype,
        },
        "algorithm": {
            "num_generations": spec.num_generations,
            "joint_mode": "aligned",
            "num_turns": spec.turns,
            "discount": 1.0,
            "advantage": "mean",
            "logprob_aggregation": "token_sum",
            "num_iterations": 1,
            "kl_coef": 0.0,
            "early_termination_threshold": None,
        },
        "optim": {"lr": spec.teamrl_lr or spec.lr, "weight_decay": TORCH_ADAMW_WEIGHT_DECAY, "max_grad_norm": None,
                  "lr_scheduler": "constant", "warmup_steps": 0},
        "steps": spec.steps,
        "items_per_step": spec.items,
        "seed": spec.seed,
        "run_dir": run_dir,
        "logging": {"progress_bar": False, "sample_every": 0},
        "checkpoint": {"save_every": 0},
    }


def comlrl_config(spec: RunSpec) -> dict[str, Any]:
    """Keyword arguments of CoMLRL's ``MAGRPOConfig`` for ``spec`` (see :func:`teamrl_config`).

    CoMLRL trains on one item per dataloader step and updates an agent once its rollout buffer holds
    ``rollout_buffer_size`` tree nodes, one optimiser step per turn present in the buffer. A buffer of
    every node of ``items`` items makes an update cover the same items as one teamrl step.
    """
    buffer = spec.items * nodes_per_item(spec)
    return {
        "num_train_epochs": 1,  # the harness feeds exactly steps x items items, in teamrl's order
        "agent_learning_rate": spec.lr,
        "num_agents": len(AGENT_NAMES),
        "num_generations": spec.num_generations,
        "max_new_tokens": spec.max_new_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": spec.top_k,
        "num_turns": spec.turns,
        "discount": 1.0,
        "joint_mode": "aligned",
        "early_termination_threshold": None,  # CoMLRL's default (-0.2) would stop almost every branch
        "external_prompt_passthrough": True,  # the transition returns the full next prompt
        "eval_interval": 0,  # the shared evaluation replaces CoMLRL's own
        "eval_num_samples": 0,
        "rollout_buffer_size": buffer,
        "train_batch_size": buffer,
        "advantage_mode": "mean",
        "advantage_normalization": False,
        "reference_kl_enabled": False,
    }


def comlrl_model_config(spec: RunSpec) -> dict[str, Any]:
    """CoMLRL's ``model_config`` (how it loads each agent's model) for ``spec``: the same dtype as teamrl's."""
    return {"dtype": spec.dtype}


# --------------------------------------------------------------------------------------------------
# Summaries

#: Per-run metrics the table reports: key, column title, number format.
COLUMNS = (
    ("step_seconds", "s/step", "{:.1f}"),
    ("generation_seconds_per_step", "gen s/step", "{:.1f}"),
    ("update_seconds_per_step", "update s/step", "{:.1f}"),
    ("joint_actions_per_second", "joint actions/s", "{:.3f}"),
    ("tokens_per_second", "gen tokens/s", "{:.1f}"),
    ("peak_rss_gb", "peak RSS GB", "{:.2f}"),
    ("train_peak_rss_gb", "training peak RSS GB", "{:.2f}"),
    ("reward_before", "reward before", "{:.3f}"),
    ("reward_after", "reward after", "{:.3f}"),
)


def median(values: Sequence[float | None]) -> float | None:
    """Median of the values that are present (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def per_turn_median(runs: Sequence[dict[str, Any]], key: str) -> list[float] | None:
    """Element-wise median of a per-turn list metric (e.g. eval reward per turn) over runs."""
    lists = [run[key] for run in runs if run.get(key) is not None]
    if not lists:
        return None
    return [statistics.median(values) for values in zip(*lists)]


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Medians per (turns, entrant) over repeats, and teamrl/CoMLRL ratios of those medians.

    Returns ``{"<T>-turn": {"teamrl": {...}, "comlrl": {...}, "ratio": {...}}}``, plus
    ``"teamrl-lora"`` and ``"ratio_lora"`` when teamrl also ran with LoRA. Eval rewards are per-turn
    lists (``reward_before`` / ``reward_after``); their ratio is per turn too.
    """
    summary: dict[str, dict[str, Any]] = {}
    for turns in sorted({run["turns"] for run in runs}):
        block: dict[str, Any] = {}
        for entrant in ENTRANTS:
            mine = [run for run in runs if run["turns"] == turns and run["library"] == entrant]
            if not mine:
                continue
            stats: dict[str, Any] = {"repeats": len(mine)}
            for key, _, _ in COLUMNS:
                if key.startswith("reward_"):
                    stats[key] = per_turn_median(mine, key)
                else:
                    stats[key] = median([run.get(key) for run in mine])
            block[entrant] = stats
        for entrant, name in RATIOS.items():
            if entrant not in block or "comlrl" not in block:
                continue
            ours, theirs = block[entrant], block["comlrl"]
            block[name] = {}
            for key, _, _ in COLUMNS:
                if key.startswith("reward_"):
                    pairs = zip(ours[key] or [], theirs[key] or [])
                    block[name][key] = [ratio(a, b) for a, b in pairs] or None
                else:
                    block[name][key] = ratio(ours[key], theirs[key])
        summary[f"{turns}-turn"] = block
    return summary


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, list):
        return " / ".join(_cell(v, fmt) for v in value) or "–"
    return fmt.format(value)


def markdown_table(summary: dict[str, dict[str, Any]]) -> str:
    """The summary as a Markdown table: per configuration a row per entrant, then a ratio row per teamrl entrant.

    Ratios are teamrl / CoMLRL (below 1 is better for times and memory, above 1 for throughputs).
    Multi-turn eval rewards read "turn 1 / turn 2".
    """
    header = ["configuration", "library", "runs"] + [title for _, title, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    names = {"teamrl": "teamrl", "teamrl-lora": "teamrl (LoRA)", "comlrl": "CoMLRL",
             "ratio": "teamrl / CoMLRL", "ratio_lora": "teamrl (LoRA) / CoMLRL"}
    for config, block in summary.items():
        for row in names:
            if row not in block:
                continue
            stats = block[row]
            is_ratio = row.startswith("ratio")
            runs = "" if is_ratio else str(stats.get("repeats", ""))
            cells = [_cell(stats.get(key), "{:.2f}x" if is_ratio else fmt) for key, _, fmt in COLUMNS]
            lines.append("| " + " | ".join([config, names[row], runs] + cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Running the workers


def run_worker(python: str, library: str, spec: RunSpec, work_dir: Path) -> dict[str, Any]:
    """Run one library on ``spec`` in a subprocess; its result plus the subprocess's peak RSS.

    Peak RSS comes from ``wait4`` on that process: the largest resident set of the worker and of any
    process it waited for, so each library is measured alone, whatever ran before it. The worker resets
    the kernel's peak when training starts (to report training's own, ``train_peak_rss_gb``), which
    ``wait4`` then no longer sees: the worker's own reading of the earlier peak is taken into account.
    """
    entrant = "teamrl-lora" if library == "teamrl" and spec.teamrl_training == "lora" else library
    tag = f"{entrant}-{spec.turns}turn-seed{spec.seed}"
    result_path = work_dir / f"{tag}.json"
    log_path = work_dir / f"{tag}.log"
    env = dict(os.environ)
    # This checkout's teamrl is the one measured, whatever else is installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), env.get("PYTHONPATH")]))
    if spec.threads:
        env.update({"OMP_NUM_THREADS": str(spec.threads), "MKL_NUM_THREADS": str(spec.threads)})
    env.update({"WANDB_MODE": "disabled", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    command = [python, str(WORKER), library, spec.to_json(), str(result_path)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{library} worker failed (exit {process.returncode}); log {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["peak_rss_gb"] = max(usage.ru_maxrss * 1024 / 1e9, result.get("setup_peak_rss_gb") or 0.0)  # Linux: KB
    return result


def _library_versions(python: str) -> dict[str, str]:
    """Versions of teamrl, CoMLRL, torch and transformers as ``python`` (the workers' interpreter) sees them."""
    code = ("import importlib.metadata as m, json;"
            "print(json.dumps({p: m.version(p) for p in ('teamrl', 'comlrl', 'torch', 'transformers')}))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="write the JSON results here")
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="configurations to run: 1 (single-turn) and/or 2 (two turns)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per library and configuration (medians)")
    parser.add_argument("--steps", type=int, default=RunSpec.steps, help="training steps (= updates)")
    parser.add_argument("--items", type=int, default=RunSpec.items, help="dataset items per step")
    parser.add_argument("--num-generations", type=int, default=RunSpec.num_generations, help="G")
    parser.add_argument("--max-new-tokens", type=int, default=RunSpec.max_new_tokens)
    parser.add_argument("--lr", type=float, default=RunSpec.lr)
    parser.add_argument("--seed", type=int, default=RunSpec.seed, help="repeat r uses seed + r on both sides")
    parser.add_argument("--eval-items", type=int, default=RunSpec.eval_items, help="held-out items evaluated")
    parser.add_argument("--eval-samples", type=int, default=RunSpec.eval_samples,
                        help="joint samples per held-out item")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: one per core). On a CPU other jobs share, "
                             "1 avoids threads spinning on busy cores, which can slow both libraries several-fold")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="parameter dtype of both libraries' models (bfloat16 pays off on CPUs with "
                             "bf16 units, e.g. AVX512-BF16 or AMX)")
    parser.add_argument("--teamrl-training", choices=["full", "lora"], nargs="+", default=["full"],
                        help="teamrl's entrants: full (CoMLRL's work exactly, default) and/or lora (teamrl's "
                             "default; CoMLRL still fine-tunes fully, so that row is no longer identical work)")
    parser.add_argument("--teamrl-lora-lr", type=float, default=2e-4,
                        help="teamrl's learning rate with LoRA (adapters need a larger one than --lr; "
                             "default: the demo preset's)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for both workers (one that has teamrl and comlrl, e.g. a venv's)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="worker logs and raw results (default: a new temporary directory)")
    args = parser.parse_args(argv)
    for name in ("repeats", "steps", "items", "max_new_tokens", "eval_items", "eval_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_generations < 2:
        parser.error("--num-generations must be >= 2 (a group baseline needs two samples)")
    return args


def spec_from_args(args: argparse.Namespace, turns: int, repeat: int) -> RunSpec:
    """The spec of repeat ``repeat`` (0-based) of the ``turns``-turn configuration."""
    return RunSpec(turns=turns, steps=args.steps, items=args.items, num_generations=args.num_generations,
                   max_new_tokens=args.max_new_tokens, lr=args.lr, seed=args.seed + repeat,
                   eval_items=args.eval_items, eval_samples=args.eval_samples, threads=args.threads,
                   dtype=args.dtype,
                   # Before training both sides hold the same weights, and the evaluation is seeded on
                   # its own: one pre-training evaluation per configuration is enough.
                   eval_before=repeat == 0)


def entrants(args: argparse.Namespace, spec: RunSpec) -> list[tuple[str, str, RunSpec]]:
    """(entrant, worker library, spec) of one repeat: teamrl's modes asked for, then CoMLRL."""
    runs = [("teamrl", "teamrl", spec)] if "full" in args.teamrl_training else []
    if "lora" in args.teamrl_training:
        runs.append(("teamrl-lora", "teamrl",
                     dataclasses.replace(spec, teamrl_training="lora", teamrl_lr=args.teamrl_lora_lr)))
    return [*runs, ("comlrl", "comlrl", spec)]


def write_report(args: argparse.Namespace, versions: dict[str, str], work_dir: Path,
                 runs: list[dict[str, Any]]) -> str:
    """Write the JSON report of the runs done so far to ``args.out``; return the Markdown table.

    Called after every run, so a worker that fails late still leaves the finished runs on disk.
    """
    summary = summarise(runs)
    table = markdown_table(summary)
    report = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), **versions},
        "settings": {**vars(args), "out": str(args.out), "work_dir": str(work_dir)},
        "configs": {f"{turns}-turn": {entrant: {**comlrl_config(spec), "model_config": comlrl_model_config(spec)}
                                      if library == "comlrl"
                                      else teamrl_config(spec, "<bundled model>", "<tmp>")
                                      for entrant, library, spec in entrants(args, spec_from_args(args, turns, 0))}
                    for turns in args.turns},
        "runs": runs,
        "summary": summary,
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return table


def main(argv: Sequence[str] | None = None) -> None:
    """Run every (configuration, repeat, library), print the table, write the JSON."""
    args = parse_args(argv)
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="side_by_side-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    versions = _library_versions(args.python)
    print(f"teamrl {versions['teamrl']} vs CoMLRL {versions['comlrl']} (torch {versions['torch']}, "
          f"transformers {versions['transformers']}), {os.cpu_count()} cores; logs in {work_dir}", flush=True)
    runs: list[dict[str, Any]] = []
    for turns in args.turns:
        for repeat in range(args.repeats):
            spec = spec_from_args(args, turns, repeat)
            # Alternate which library goes first so neither always meets a warmer or busier machine.
            order = entrants(args, spec)
            for entrant, library, entrant_spec in order if repeat % 2 == 0 else order[::-1]:
                result = run_worker(args.python, library, entrant_spec, work_dir)
                result.update(library=entrant, turns=turns, repeat=repeat)
                runs.append(result)
                table = write_report(args, versions, work_dir, runs)
                print(f"  {turns}-turn repeat {repeat + 1}/{args.repeats} {entrant:11s} "
                      f"{result['step_seconds']:6.1f} s/step  peak RSS {result['peak_rss_gb']:.2f} GB  "
                      f"eval reward {result['reward_before']} -> {result['reward_after']}", flush=True)
    for config, block in summarise(runs).items():
        if "ratio" in block and block["teamrl"]["reward_before"] != block["comlrl"]["reward_before"]:
            print(f"note: {config}: the libraries' pre-training eval rewards differ "
                  f"({block['teamrl']['reward_before']} vs {block['comlrl']['reward_before']}); "
                  "they start from the same weights, so the evaluation saw different numerics", flush=True)
    print(f"\n{table}\n\nwrote {args.out}")


if __name__ == "__main__":
    main()
