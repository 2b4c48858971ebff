"""Rollout throughput on a GPU: the vLLM backend vs the transformers backend, same team, prompts and seeds.

A two-agent team on one base (LoRA adapters by default; ``--training full`` for two full models)
samples G completions of each held-out ``tldr`` prompt, as one MAGRPO rollout does, through each
backend in turn: :func:`teamrl.rollout.generate.generate_team` with no sampler (transformers'
batched ``generate``, mixed-adapter batches), then with a
:class:`~teamrl.rollout.vllm_sampler.VLLMSampler`. One untimed rollout first (vLLM: engine start,
CUDA graphs, adapter load), then ``--repeats`` timed ones; the table gives median seconds per rollout,
generated tokens and tokens/s, and the speed-up of vLLM. Without a CUDA GPU or without vllm it says so
and exits 0.

    pip install -e ".[vllm]"
    python benchmarks/rollout_backends.py [--model bundled] [--items 16] [--num-generations 8] \\
        [--max-new-tokens 128] [--out F.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from teamrl.config import config_from_dict
from teamrl.envs.base import make_env
from teamrl.evaluation.metrics import tokens_per_second
from teamrl.evaluation.report import markdown_table
from teamrl.rollout.generate import Generation, generate_team
from teamrl.team import Team


def unavailable() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("vllm") is None:
        return 'vllm not installed (pip install "teamrl[vllm]")'
    return None


def timed_rollouts(sample: Callable[..., list[Generation]], team: Team, prompts: Sequence[list[str]],
                   num_samples: int, repeats: int, seed: int) -> dict[str, Any]:
    """One warm-up rollout, then ``repeats`` timed ones with ``sample`` (``generate_team`` or a sampler's); runs
    and medians."""
    sample(team, prompts, num_samples, seed=seed)
    runs = []
    for repeat in range(1, repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        generations = sample(team, prompts, num_samples, seed=seed + repeat)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = sum(gen.num_tokens for gen in generations)
        runs.append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens_per_second(tokens, seconds)})
    return {"runs": runs, **{key: statistics.median(run[key] for run in runs) for key in runs[0]}}


def main() -> None:
    """Parse arguments, build the team, time both backends, print (and write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bundled", help="base model (a model spec)")
    parser.add_argument("--training", choices=["lora", "full"], default="lora")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--items", type=int, default=16, help="held-out tldr items per rollout")
    parser.add_argument("--num-generations", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}; this benchmark compares GPU rollout backends")
        return

    from teamrl.rollout.vllm_sampler import VLLMSampler

    config = config_from_dict({
        "env": {"name": "tldr"},
        "team": {"model": args.model, "training": args.training, "device": "cuda", "dtype": args.dtype,
                 "sampling": {"max_new_tokens": args.max_new_tokens},
                 "agents": [{"name": "summarizer"}, {"name": "elaborator"}]},
        "rollout": {"backend": "vllm", "gpu_memory_utilization": args.gpu_memory_utilization},
    })
    env = make_env("tldr", source="aclsum")
    team = Team.from_config(config.team, env, seed=args.seed)
    observations = [env.observe(item) for item in list(env.items("eval"))[:args.items]]
    prompts = [[agent.prompt(obs[i]) for obs in observations] for i, agent in enumerate(team)]
    results = {"transformers": timed_rollouts(generate_team, team, prompts, args.num_generations, args.repeats,
                                              args.seed)}
    results["vllm"] = timed_rollouts(VLLMSampler(config.rollout).generate_team, team, prompts,
                                     args.num_generations, args.repeats, args.seed)
    speedup = results["vllm"]["tokens_per_s"] / results["transformers"]["tokens_per_s"]

    date = datetime.date.today().isoformat()
    header = (f"{date}, {torch.cuda.get_device_name()}, {args.model} {args.dtype} ({args.training}, 2 agents), "
              f"{len(observations)} prompts x G={args.num_generations} per agent, max_new_tokens "
              f"{args.max_new_tokens}, medians of {args.repeats}")
    rows = [[backend, f"{r['seconds']:.2f}", f"{r['tokens']:.0f}", f"{r['tokens_per_s']:.0f}"]
            for backend, r in results.items()]
    print(f"{header}\n\n{markdown_table(['backend', 's per rollout', 'tokens', 'tokens/s'], rows)}\n\n"
          f"vLLM speed-up (tokens/s): {speedup:.2f}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": date, "header": header, "backends": results,
                                        "speedup": speedup}, indent=2))


if __name__ == "__main__":
    main()
