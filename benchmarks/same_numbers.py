"""Do two versions of teamrl compute the same numbers? A check for refactors that must change nothing.

Each ``--src`` (a checkout's ``src`` folder) runs, in its own process, a few tiny trainings that cover the
update's paths (full fine-tuning; LoRA with two turns; LoRA with a KL term and two passes; cross joint
actions with micro-batches; individual learners): 3 steps each, then a held-out evaluation. The table
says, per case, whether the parameters after training (bytes), the step metrics (timings and memory
left out) and the evaluation are identical to the first ``--src``'s::

    git worktree add /tmp/teamrl-before <commit>
    python benchmarks/same_numbers.py --src /tmp/teamrl-before/src --src src
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"

CASES = {
    "full": {},
    "lora_2turn": {"team": {"training": "lora", "lora": {"r": 4}},
                   "algorithm": {"num_generations": 4, "num_turns": 2}},
    "lora_kl_iter": {"team": {"training": "lora", "lora": {"r": 4}},
                     "algorithm": {"num_generations": 4, "kl_coef": 0.1, "num_iterations": 2}},
    "full_cross_micro": {"algorithm": {"num_generations": 3, "joint_mode": "cross"}, "optim": {"micro_batch_size": 2}},
    "individual": {"algorithm": {"num_generations": 4, "learners": "individual"}},
}
UNTIMED = ("time/", "memory/", "tokens/per_second")


def digests(steps: int) -> dict[str, dict[str, str]]:
    """Per case: sha256 of the trained parameters, of the step metrics, and of the evaluation's metrics."""
    import torch

    sys.path.insert(0, str(TESTS))
    from conftest import tiny_config_dict  # the test suite's tiny digit_sum run

    from teamrl.config import config_from_dict
    from teamrl.train import Trainer

    torch.set_num_threads(2)
    out = {}
    for name, overrides in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            config = config_from_dict(tiny_config_dict(Path(tmp), steps=steps, **overrides))
            with Trainer(config) as trainer:
                metrics = [trainer.train_step() for _ in range(steps)]
                evaluation = trainer.evaluate(num_samples=2)
                params = hashlib.sha256()
                for agent in trainer.team:
                    for p in agent.parameters:
                        params.update(p.detach().float().numpy().tobytes())
        untimed = [{k: v for k, v in m.items() if not k.startswith(UNTIMED)} for m in metrics]
        out[name] = {"parameters": params.hexdigest(),
                     "metrics": hashlib.sha256(json.dumps(untimed, sort_keys=True).encode()).hexdigest(),
                     "evaluation": hashlib.sha256(json.dumps(evaluation, sort_keys=True).encode()).hexdigest()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", action="append", default=[], help="a source tree; give two or more")
    parser.add_argument("--steps", type=int, default=3, help="training steps per case")
    parser.add_argument("--worker", metavar="OUT_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker).write_text(json.dumps(digests(args.steps)))
        return
    if len(args.src) < 2:
        parser.error("--src: give two source trees or more (the first is the reference)")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, src in enumerate(args.src):
            out = Path(tmp) / f"{index}.json"
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--worker", str(out)], env=env,
                           check=True, cwd=tmp)
            results.append(json.loads(out.read_text()))
    print("| case | " + " | ".join(f"{src}: parameters, metrics, evaluation" for src in args.src[1:]) + " |")
    print("|---" * len(args.src) + "|")
    for case in CASES:
        cells = [", ".join("same" if other[case][key] == results[0][case][key] else "DIFFERENT"
                           for key in ("parameters", "metrics", "evaluation")) for other in results[1:]]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
