"""Decentralised team inference vs one model doing the whole job: latency per item and tokens/s.

The team is two agents on the ``tldr`` task (held-out items of the offline ``aclsum`` abstracts): LoRA
adapters on one shared base (the bundled SmolLM2-135M-Instruct by default; ``--team`` loads a saved
team instead). Both methods answer the same items, one item at a time as requests arrive, with the
same base model, sampling settings and seeds:

* decentralised: :func:`teamrl.inference.run_team` — each agent on its own prompt, both in one
  mixed-adapter batch (the ``concat`` baseline of ``teamrl eval``: how a team is deployed);
* single: the first agent's model writes both parts from one prompt, with ``max_new_tokens`` the sum
  of the agents' (the ``single`` baseline).

An item's latency is the wall-clock time of its generation. The table gives medians over ``--repeats``
runs of the per-run mean latency, tokens per item and tokens/s, and the latency ratio single /
decentralised (above 1: the team answers faster).

    python benchmarks/decentralised_inference.py [--items 4] [--repeats 3] [--max-new-tokens 48] [--out F.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from teamrl.config import config_from_dict
from teamrl.envs.base import Environment, Item, make_env
from teamrl.evaluation.baselines import BASELINES
from teamrl.evaluation.metrics import tokens_per_second
from teamrl.evaluation.report import markdown_table
from teamrl.team import Team

METHODS = {"decentralised": "concat", "single": "single"}
"""Benchmark method -> the baseline of :mod:`teamrl.evaluation.baselines` that runs it."""


def build_team(args: argparse.Namespace, env: Environment) -> Team:
    """The saved team at ``--team``, or an untrained LoRA pair on ``--model`` under the task's roles."""
    if args.team:
        return Team.from_pretrained(args.team, env)
    config = config_from_dict({
        "env": {"name": "tldr"},
        "team": {"model": args.model, "training": "lora",
                 "sampling": {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature},
                 "agents": [{"name": "summarizer"}, {"name": "elaborator"}]},
    })
    return Team.from_config(config.team, env, seed=args.seed)


def run_once(env: Environment, team: Team, items: Sequence[Item], method: str, seed: int) -> dict[str, float]:
    """Answer every item alone with ``method``; mean latency and tokens per item, and tokens/s."""
    seconds, tokens = 0.0, 0
    for index, item in enumerate(items):
        torch.manual_seed(seed * 1_000 + index)  # both methods draw from the same seeds
        output = BASELINES[METHODS[method]](env, team, [item], 1)
        seconds, tokens = seconds + output.seconds, tokens + output.tokens
    return {"latency_s": seconds / len(items), "tokens_per_item": tokens / len(items),
            "tokens_per_s": tokens_per_second(tokens, seconds)}


def measure(env: Environment, team: Team, items: Sequence[Item], repeats: int, seed: int) -> dict[str, Any]:
    """Per method: every repeat's numbers and their medians. The methods alternate which goes first, so a
    busy neighbour on a shared machine slows both alike."""
    for method in METHODS:  # warm-up: first-call allocations and kernel selection
        run_once(env, team, items[:1], method, seed)
    runs: dict[str, list[dict[str, float]]] = {method: [] for method in METHODS}
    for repeat in range(repeats):
        order = list(METHODS) if repeat % 2 == 0 else list(reversed(METHODS))
        for method in order:
            runs[method].append(run_once(env, team, items, method, seed + repeat))
    results = {method: {"runs": measured,
                        **{key: statistics.median(run[key] for run in measured) for key in measured[0]}}
               for method, measured in runs.items()}
    return {"methods": results,
            "latency_ratio": results["single"]["latency_s"] / results["decentralised"]["latency_s"]}


def render(measured: dict[str, Any], header: str) -> str:
    """The Markdown table of medians, under ``header``, with the latency ratio below it."""
    rows = [[method, f"{m['latency_s']:.2f}", f"{m['tokens_per_item']:.1f}", f"{m['tokens_per_s']:.1f}"]
            for method, m in measured["methods"].items()]
    table = markdown_table(["method", "latency per item (s)", "tokens per item", "tokens/s"], rows)
    return (f"{header}\n\n{table}\n\nlatency ratio single / decentralised: "
            f"{measured['latency_ratio']:.2f}x (medians)")


def main() -> None:
    """Parse arguments, load the task and the team, measure both methods, print (and write) the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="base model of the untrained team (a model spec)")
    parser.add_argument("--team", default=None, help="a saved team directory to use instead")
    parser.add_argument("--items", type=int, default=4, help="held-out tldr items")
    parser.add_argument("--repeats", type=int, default=3, help="runs over the items; medians are reported")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per agent (the single model gets the sum)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); 1 is steadier on a machine shared with other jobs")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    env = make_env("tldr", source="aclsum")
    items = list(env.items("eval"))[:args.items]
    start = time.perf_counter()
    team = build_team(args, env)
    budget = sum(agent.sampling.max_new_tokens for agent in team)
    measured = measure(env, team, items, args.repeats, args.seed)
    date = datetime.date.today().isoformat()
    header = (f"{date}, {args.team or args.model} ({len(team)} agents, LoRA on one base), tldr/aclsum, "
              f"{len(items)} held-out items x {args.repeats} repeats, max_new_tokens "
              f"{'+'.join(str(a.sampling.max_new_tokens) for a in team)} per agent / {budget} single, "
              f"{platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, "
              f"{time.perf_counter() - start:.0f} s in all")
    print(render(measured, header))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": date, "header": header, "args": {k: str(v) for k, v in
                                                                                 vars(args).items()},
                                        **measured}, indent=2))


if __name__ == "__main__":
    main()
