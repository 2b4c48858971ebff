"""The training loop: wires config -> environment -> team -> MAGRPO steps, with logging and checkpoints.

The algorithm itself lives in :mod:`teamrl.algorithms.magrpo`; this module only decides which items a
step sees, keeps optimisers and schedules, writes metrics and samples, and saves/resumes checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from teamrl.algorithms import magrpo
from teamrl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from teamrl.config import TrainConfig, config_to_dict
from teamrl.envs.base import Environment, Item, make_env
from teamrl.rollout.generate import generate_team
from teamrl.team import Team

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"


def batch_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Item indices of ``step`` (0-based): consecutive slices of per-epoch shuffles, a pure function of its args.

    Being a function of the step alone is what lets a resumed run see exactly the items the
    uninterrupted run would have.
    """
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_items)
        order = list(range(num_items))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        indices.append(order[offset])
    return indices


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int):
    """Linear warm-up over ``warmup`` optimiser steps, then constant, linear or cosine decay to 0 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Trainer:
    """Trains a team with MAGRPO as ``config`` says.

    ``team`` and ``env`` may be given directly (Python API); otherwise they are built from the config.
    """

    def __init__(self, config: TrainConfig, *, team: Team | None = None, env: Environment | None = None):
        self.config = config
        if config.logging.tensorboard:
            _require("tensorboard", "logging.tensorboard")
        if config.logging.wandb_project:
            _require("wandb", "logging.wandb_project")
        _seed_everything(config.seed)
        self.env = env if env is not None else make_env(config.env.name, **config.env.kwargs)
        if config.algorithm.num_turns > (self.env.max_turns or config.algorithm.num_turns):
            raise ValueError(f"algorithm.num_turns: {type(self.env).__name__} supports at most "
                             f"{self.env.max_turns} turns (got {config.algorithm.num_turns})")
        self.team = team if team is not None else Team.from_config(
            config.team, self.env, seed=config.seed, need_reference=config.algorithm.kl_coef > 0)
        self.items: Sequence[Item] = self.env.items("train")
        if not self.items:
            raise ValueError(f"env: {type(self.env).__name__} has no training items")
        optim = config.optim
        total = config.steps * config.algorithm.num_iterations
        self.optimizers = []
        self.schedulers = []
        for agent, agent_cfg in zip(self.team, config.team.agents):
            optimizer = torch.optim.AdamW(agent.parameters, lr=agent_cfg.lr or optim.lr,
                                          betas=tuple(optim.betas), weight_decay=optim.weight_decay)
            self.optimizers.append(optimizer)
            self.schedulers.append(make_scheduler(optimizer, optim.lr_scheduler, optim.warmup_steps, total))
        self.run_dir = Path(config.run_dir)
        self.step = 0
        self._writers: list[Any] = []

    # ----------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One MAGRPO step on the next batch of items; returns its metrics."""
        config = self.config
        start = time.perf_counter()
        items = [self.items[i] for i in batch_indices(len(self.items), config.items_per_step, self.step, config.seed)]
        tree = magrpo.rollout(self.team, self.env, items, config.algorithm)
        per_agent, returns = magrpo.advantages(tree, len(self.team), config.algorithm)
        metrics = magrpo.rollout_metrics(tree, returns, per_agent)
        generation_seconds = sum(t.generation_seconds for t in tree.turns)
        update_start = time.perf_counter()
        for i, agent in enumerate(self.team):
            stats = magrpo.update_agent(
                agent, [t.generations[i] for t in tree.turns], per_agent[i],
                self.optimizers[i], self.schedulers[i], config.algorithm,
                micro_batch_size=config.optim.micro_batch_size, max_grad_norm=config.optim.max_grad_norm,
            )
            for key, value in stats.items():
                metrics[f"{agent.name}/{key}"] = value
            metrics[f"{agent.name}/lr"] = self.schedulers[i].get_last_lr()[0]
        generated = sum(gen.num_tokens for t in tree.turns for gen in t.generations)
        self.step += 1
        metrics.update({
            "step": self.step,
            "loss": sum(metrics[f"{a.name}/loss"] for a in self.team),
            "kl": sum(metrics[f"{a.name}/kl"] for a in self.team) / len(self.team),
            "clip_fraction": sum(metrics[f"{a.name}/clip_fraction"] for a in self.team) / len(self.team),
            "grad_norm": max(metrics[f"{a.name}/grad_norm"] for a in self.team),
            "tokens/generated": float(generated),
            "tokens/per_second": generated / max(generation_seconds, 1e-9),
            "time/generation": generation_seconds,
            "time/update": time.perf_counter() - update_start,
            "time/step": time.perf_counter() - start,
        })
        self._last_tree = tree
        return metrics

    def train(self, resume: bool = False) -> list[dict[str, float]]:
        """Run until ``config.steps`` updates are done; with ``resume``, continue from the last checkpoint."""
        config = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            self._resume()
        else:
            for name in (METRICS_FILE, SAMPLES_FILE):
                (self.run_dir / name).unlink(missing_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
        self._open_writers()
        history = []
        progress = _progress(config, initial=self.step)
        try:
            while self.step < config.steps:
                metrics = self.train_step()
                history.append(metrics)
                self._log(metrics)
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", loss=f"{metrics['loss']:.3g}")
                every = config.checkpoint.save_every
                if self.step == config.steps or (every and self.step % every == 0):
                    self.save()
        finally:
            if progress is not None:
                progress.close()
            for writer in self._writers:
                writer.close()
        return history

    def save_team(self, directory: str | Path | None = None) -> Path:
        """Save the trained team (default ``run_dir/team``) with the environment it was trained on."""
        env = {"name": self.config.env.name, "kwargs": self.config.env.kwargs}
        return self.team.save_pretrained(directory or self.run_dir / "team",
                                         metadata={"env": env, "seed": self.config.seed, "step": self.step})

    def save(self) -> Path:
        """Checkpoint the current step."""
        return save_checkpoint(self.run_dir, self.step, self.team, self.optimizers, self.schedulers,
                               keep_last=self.config.checkpoint.keep_last)

    def evaluate(self, split: str = "eval", num_samples: int = 1, max_items: int | None = None,
                 seed: int | None = None) -> dict[str, float]:
        """Mean joint reward (and mean reward parts) of the team on ``split``, turn 1.

        Sampling uses its own seeded RNG stream (``seed``, default the run's seed), so evaluating
        twice gives the same numbers for the same weights and training's random stream is untouched.
        """
        return self.evaluate_with_samples(split, num_samples, max_items, seed)[0]

    def evaluate_with_samples(self, split: str = "eval", num_samples: int = 1, max_items: int | None = None,
                              seed: int | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """:meth:`evaluate`, plus every joint action with what each agent saw and its reward."""
        items = list(self.env.items(split))[:max_items]
        if not items:
            raise ValueError(f"{type(self.env).__name__} has no {split!r} items to evaluate on")
        observations = [self.env.observe(item) for item in items]
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.config.seed if seed is None else seed)
            generations = generate_team(
                self.team, [[agent.prompt(obs[i]) for obs in observations] for i, agent in enumerate(self.team)],
                num_samples)
        rows = range(len(items) * num_samples)
        joint_actions = [tuple(gen.texts[row] for gen in generations) for row in rows]
        results = self.env.joint_rewards([(items[row // num_samples], actions, ())
                                          for row, actions in zip(rows, joint_actions)])
        rewards = torch.tensor([r.total for r in results])
        metrics = {"reward/mean": float(rewards.mean()),
                   "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0}
        for part in sorted({name for r in results for name in r.parts}):
            # A gated reward's unreached parts are absent: they count as zero in the mean.
            metrics[f"reward/{part}"] = sum(r.parts.get(part, 0.0) for r in results) / len(results)
        samples = [{"item": items[row // num_samples].get("id"), "observations": observations[row // num_samples],
                    "actions": list(actions), "reward": result.total, "reward_parts": result.parts}
                   for row, actions, result in zip(rows, joint_actions, results)]
        return metrics, samples

    # ----------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        for partial in (self.run_dir / "checkpoints").glob(".tmp-*"):  # left by a run killed mid-save
            shutil.rmtree(partial, ignore_errors=True)
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is None:
            return
        state = load_checkpoint(checkpoint, self.team, self.optimizers, self.schedulers)
        self.step = int(state["step"])
        # Steps logged after the checkpoint by the killed run will be redone: drop them.
        for name in (METRICS_FILE, SAMPLES_FILE):
            _truncate_jsonl(self.run_dir / name, self.step)

    def _open_writers(self) -> None:
        self._writers = []
        if self.config.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writers.append(_TensorBoard(SummaryWriter(str(self.run_dir / "tensorboard"))))
        if self.config.logging.wandb_project:
            import wandb

            run = wandb.init(project=self.config.logging.wandb_project, dir=str(self.run_dir),
                             config=config_to_dict(self.config), resume="allow")
            self._writers.append(_WandB(run))

    def _log(self, metrics: dict[str, float]) -> None:
        with open(self.run_dir / METRICS_FILE, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for writer in self._writers:
            writer.log(metrics, self.step)
        every = self.config.logging.sample_every
        if every and (self.step % every == 0 or self.step == 1):
            with open(self.run_dir / SAMPLES_FILE, "a") as f:
                f.write(json.dumps({"step": self.step, "samples": _samples(self._last_tree)}) + "\n")


def _samples(tree: magrpo.Rollout, per_turn: int = 2) -> list[dict[str, Any]]:
    """A few joint actions per turn with what each agent saw and the reward, for samples.jsonl."""
    out = []
    for t, turn in enumerate(tree.turns, start=1):
        for m in range(min(per_turn, len(turn.combos))):
            out.append({
                "turn": t,
                "item": turn.items[0].get("id"),
                "observations": list(turn.observations[0]),
                "actions": list(turn.joint_action(0, m)),
                "reward": turn.results[m].total,
                "reward_parts": turn.results[m].parts,
            })
    return out


def _truncate_jsonl(path: Path, last_step: int) -> None:
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _progress(config: TrainConfig, initial: int):
    if not config.logging.progress_bar:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, initial=initial, desc="MAGRPO", unit="step", dynamic_ncols=True)


def _require(package: str, field: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is None:
        raise ValueError(f"{field}: needs the {package!r} package; pip install 'teamrl[{package}]' or turn it off")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class _TensorBoard:
    def __init__(self, writer):
        self.writer = writer

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run):
        self.run = run

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()
