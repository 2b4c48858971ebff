"""A tiny evaluation shared by the evaluation tests: two tiny agents on digit_sum, every method, in seconds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from teamrl.config import TrainConfig, config_from_dict
from teamrl.evaluation.methods import EvalSettings, parse_methods
from teamrl.evaluation.runner import EvalResults, run_evaluation
from teamrl.train import Trainer


@dataclass
class TinyEval:
    config: TrainConfig
    run_dir: Path
    """A two-step training run: metrics.jsonl, and the trained team in ``team/``."""
    untrained_dir: Path
    """The same team saved before training."""
    results: EvalResults


def tiny_eval_config(run_dir: Path) -> TrainConfig:
    return config_from_dict({
        "env": {"name": "digit_sum", "kwargs": {"targets": [9], "length": 4, "num_eval": 3}},
        # LoRA: agents sharing a base sample in one batch from one RNG stream, so a seed fixes every sample
        # (agents on separate models sample in concurrent threads, in no fixed order).
        "team": {"model": "tiny", "training": "lora", "sampling": {"max_new_tokens": 4},
                 "agents": [{"name": "first"}, {"name": "second"}]},
        "algorithm": {"num_generations": 4}, "optim": {"lr": 5e-2}, "steps": 2, "items_per_step": 2,
        "run_dir": str(run_dir), "logging": {"progress_bar": False}, "checkpoint": {"save_every": 0},
    })


@pytest.fixture(scope="session")
def tiny_eval(tmp_path_factory) -> TinyEval:
    root = tmp_path_factory.mktemp("tiny-eval")
    config = tiny_eval_config(root / "run")
    trainer = Trainer(config)
    untrained = trainer.save_team(root / "untrained")
    trainer.train()
    trained = trainer.save_team()
    methods = parse_methods(f"single,single:tiny,concat,sequential,discussion,team:{untrained},team:{trained}")
    results = run_evaluation(config, EvalSettings(tuple(methods), max_items=3, num_samples=2, ks=(1, 2)))
    return TinyEval(config, root / "run", untrained, results)
