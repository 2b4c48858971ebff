"""Training options: schedules, data order, cross mode, early termination, independent learners."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from teamrl.algorithms.update import make_scheduler
from teamrl.train import Trainer, batch_indices


def test_warmup_then_decay_schedules():
    param = torch.nn.Parameter(torch.zeros(1))
    for kind, expected in [
        ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0]),
        ("linear", [1 / 3, 2 / 3, 1.0, 2 / 3, 1 / 3]),
        ("cosine", [1 / 3, 2 / 3, 1.0, 0.75, 0.25]),
    ]:
        optimizer = torch.optim.SGD([param], lr=1.0)
        scheduler = make_scheduler(optimizer, kind, warmup=2, total=5)
        seen = []
        for _ in range(5):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert seen == pytest.approx(expected), kind


def test_a_decaying_schedule_ends_at_its_final_fraction_of_the_rate():
    # 1 - s/72 over 24 steps: a 72-step linear decay to 0, cut where the run ends, is the same schedule
    param = torch.nn.Parameter(torch.zeros(1))
    for kind, final in [("linear", 2 / 3), ("cosine", 0.25)]:
        optimizer = torch.optim.SGD([param], lr=1.0)
        scheduler = make_scheduler(optimizer, kind, warmup=0, total=24, final=final)
        seen = []
        for _ in range(25):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert seen[0] == 1.0 and seen[24] == pytest.approx(final), kind
        assert all(a > b for a, b in zip(seen, seen[1:])), kind
        if kind == "linear":
            assert seen == pytest.approx([1 - s / 72 for s in range(25)])
        else:
            assert seen[12] == pytest.approx(final + (1 - final) / 2)


@pytest.mark.parametrize("fields, message", [
    ({"final_lr_fraction": 1.5}, "optim.final_lr_fraction: must be in [0, 1]"),
    ({"final_lr_fraction": 0.5, "lr_scheduler": "constant"}, "optim.final_lr_fraction: only a decaying schedule"),
])
def test_a_final_fraction_outside_0_1_or_on_a_constant_schedule_is_refused(fields, message):
    from teamrl.config import ConfigError, OptimConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        OptimConfig(**fields).validate("optim")


def test_batches_cover_every_item_once_per_epoch_and_depend_only_on_the_step():
    epoch = [i for step in range(5) for i in batch_indices(10, 2, step, seed=3)]
    assert sorted(epoch) == list(range(10))
    assert batch_indices(10, 2, 7, seed=3) == batch_indices(10, 2, 7, seed=3)
    assert epoch != [i for step in range(5) for i in batch_indices(10, 2, step, seed=4)]


def test_cross_mode_scores_every_combination(tiny_config):
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, algorithm={"num_generations": 3, "joint_mode": "cross"}))
    metrics = trainer.train_step()
    assert metrics["turn1/joint_actions"] == 2 * 3 ** 2
    assert metrics["first/tokens"] == 2 * 3 * 4  # each agent still trains on its own G completions per item


def test_early_termination_stops_expanding_solved_joint_actions(tiny_config):
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, algorithm={
        "num_generations": 2, "num_turns": 2, "early_termination_threshold": 0.0}))
    metrics = trainer.train_step()
    # Every reward is >= 0, so every turn-1 joint action is "solved" and nothing reaches turn 2.
    assert "reward/turn2/mean" not in metrics
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, algorithm={"num_generations": 2, "num_turns": 2}))
    assert trainer.train_step()["turn2/joint_actions"] == 2 * 2 * 2


@pytest.mark.slow
def test_joint_reward_beats_individual_rewards(tiny_config):
    """The paper's central claim on the built-in game: per-agent rewards that each agent can max out
    alone (write digits that could reach the target) never teach the agents to complement each other."""
    exact = {}
    for learners in ("joint", "individual"):
        trainer = Trainer(tiny_config(steps=50, algorithm={"learners": learners}))
        for _ in range(trainer.config.steps):
            trainer.train_step()
        # Fraction of digit pairs that sum exactly to the target: only complementing the partner does it.
        exact[learners] = trainer.evaluate(num_samples=4)["count/hits"] / trainer.env.length
    assert exact["joint"] > 0.9, exact
    assert exact["individual"] < 0.5, exact


def test_optional_loggers_fail_early_with_the_package_to_install(tiny_config, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"logging.tensorboard: needs the 'tensorboard' package"):
        Trainer(tiny_config(logging={"tensorboard": True}))


def test_memory_metrics_follow_what_the_process_holds():
    # In a fresh process: in this one, memory that earlier tests freed can still be resident in the heap
    # and serve the allocation without the RSS growing at all (seen once in CI).
    code = (
        "import json, torch\n"
        "from teamrl.train import memory_metrics\n"
        "before = memory_metrics()\n"
        "held = torch.ones(96 * 2**20, dtype=torch.float32)  # 0.375 GiB (0.403 GB), touched\n"
        "print(json.dumps([before, memory_metrics()]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    before, during = json.loads(result.stdout.strip().splitlines()[-1])
    assert 0.37 < during["memory/rss_gib"] - before["memory/rss_gib"] < 0.395  # GiB, not GB (0.403)
    # the kernel updates the high-water mark lazily: it may trail the current RSS by a few pages
    assert during["memory/peak_rss_gib"] > before["memory/rss_gib"] + 0.35


def test_gpu_memory_metrics_are_gib_and_include_what_the_allocator_reserved(monkeypatch):
    """On a GPU: the peaks of torch's tensors and of its caching allocator's reserve, in GiB as nvidia-smi counts
    (the device's CUDA calls stood in for: there is no GPU here)."""
    from teamrl.train import memory_metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 5 * 2**30)
    metrics = memory_metrics()
    assert metrics["memory/cuda_peak_allocated_gib"] == 3.0 and metrics["memory/cuda_peak_reserved_gib"] == 5.0


def test_evaluation_in_item_batches_scores_every_item_and_is_reproducible(tiny_config):
    trainer = Trainer(tiny_config())
    whole, whole_samples = trainer.evaluate_with_samples(num_samples=2, max_items=5, items_per_batch=5)
    chunked, chunked_samples = trainer.evaluate_with_samples(num_samples=2, max_items=5, items_per_batch=2)
    # every item scored num_samples times, in item order, whatever the batching
    assert [s["item"] for s in chunked_samples] == [s["item"] for s in whole_samples]
    assert len(chunked_samples) == 10
    assert trainer.evaluate_with_samples(num_samples=2, max_items=5, items_per_batch=2)[0] == chunked
    with pytest.raises(ValueError, match="items_per_batch"):
        trainer.evaluate(items_per_batch=0)
