"""An agent's update, paper Eq. 2 as it reads (:func:`update_agent`), and what every update path shares: micro-batches,
gradient clipping (where a non-finite update stops), statistics, and each agent's optimiser and schedule.

:mod:`teamrl.algorithms.fast_update` computes the same update faster (shared prompt passes, threads, LoRA agents
pooled on one base); ``optim.fast_update`` picks it (the default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from teamrl.algorithms.logprobs import completion_logprobs
from teamrl.algorithms.losses import contributes, loss_normalizer, update_loss
from teamrl.config import AlgorithmConfig, TrainConfig
from teamrl.rollout.generate import Generation
from teamrl.team import Agent


def update_agent(
    agent: Agent,
    generations: list[Generation],
    advantages: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: AlgorithmConfig,
    *,
    micro_batch_size: int = 0,
    max_grad_norm: float | None = None,
    loss: str = "policy_gradient",
) -> dict[str, float]:
    """Paper Eq. 2 for one agent: ``num_iterations`` steps of its own optimiser on its completions of every
    turn (``generations[t]``, with their advantages ``advantages[t]``), ``micro_batch_size`` rows per
    forward pass. :mod:`teamrl.algorithms.fast_update` computes the same, faster (``optim.fast_update``).
    ``loss`` names another loss of :data:`~teamrl.algorithms.losses.LOSSES` to minimise instead, whose
    per-row values ``advantages`` then holds (e.g. 'dpo')."""
    objective = update_loss(loss)
    batches = [(gen.rows(start, stop).trimmed(), adv[start:stop].to(gen.completion_ids.device))
               for gen, adv in zip(generations, advantages)
               for start, stop in micro_batches(len(adv), micro_batch_size, objective.rows_per_example)]
    # A zero advantage gives exactly zero gradient: without a KL term, its forward pass is skipped.
    batches = [(gen, adv) for gen, adv in batches if contributes(objective, adv, config.kl_coef)]
    normalizer = loss_normalizer([gen.completion_mask for gen in generations], config.logprob_aggregation,
                                 objective.rows_per_example)
    temperature = agent.sampling.temperature
    reference: list[torch.Tensor | None] = [None] * len(batches)
    if config.kl_coef > 0:
        with torch.no_grad(), agent.reference() as frozen:
            reference = [completion_logprobs(frozen, gen, temperature) for gen, _ in batches]
    old: list[torch.Tensor | None] = [None] * len(batches)
    stats = UpdateStats(config.num_iterations)
    agent.activate()
    agent.model.train()
    for _ in range(config.num_iterations):  # PPO-style passes over one rollout; 1: plain policy gradient
        optimizer.zero_grad(set_to_none=True)
        for b, (gen, adv) in enumerate(batches):
            logprobs = completion_logprobs(agent.model, gen, temperature)  # log pi_theta_i(a_i^g | o_i)
            if old[b] is None:
                old[b] = logprobs.detach()  # before the first step, the policy is the one that sampled
            # Eq. 2: -mean_g A_g * ratio, clipped, + KL to the reference (or the loss named by ``loss``)
            batch_loss, batch_stats = objective.compute(logprobs, old[b], adv, gen.completion_mask, config=config,
                                                        normalizer=normalizer, ref_logprobs=reference[b])
            batch_loss.backward()
            stats.add(float(batch_loss.detach()), batch_stats)
        stats.end_step(clip_gradients(agent.parameters, max_grad_norm, f"agent {agent.name!r}"))
        optimizer.step()
        scheduler.step()
    agent.model.eval()
    return stats.result()


def micro_batches(size: int, micro_batch_size: int, rows_per_example: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of consecutive row ranges; each runs as its own forward pass without the padding
    columns none of its rows needs (``Generation.rows(...).trimmed()``). A range holds whole examples of
    ``rows_per_example`` rows (``micro_batch_size`` rounded up to a multiple of it)."""
    step = -(-micro_batch_size // rows_per_example) * rows_per_example or size
    return [(start, min(start + step, size)) for start in range(0, size, step)]


class NonFiniteUpdate(ValueError):
    """An update's gradients hold a NaN or an infinity: its optimiser step was not taken."""


def clip_gradients(parameters: Sequence[torch.nn.Parameter], max_grad_norm: float | None, owner: str) -> float:
    """Scale the gradients to a total norm of at most ``max_grad_norm`` (None: leave them); their norm
    before, 0 where no parameter has one (every micro-batch skipped). Every optimiser step of an agent or
    critic comes right after this call, so it is where a non-finite update is stopped.

    Raises:
        NonFiniteUpdate: the norm is not finite (NaN or inf); ``owner`` names whose update it is.
    """
    if not any(p.grad is not None for p in parameters):
        return 0.0
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm or float("inf")))
    if not math.isfinite(norm):
        raise NonFiniteUpdate(f"{owner}: the gradients of its update are not finite (norm {norm}), so its optimiser "
                              f"step was not taken; a learning rate too high (optim.lr) is the usual cause")
    return norm


class UpdateStats:
    """An agent's update statistics: per optimiser step, the micro-batches' summed loss, their clip
    fraction and KL weighted by trained tokens, and the gradient norm; each averaged over the steps."""

    def __init__(self, num_iterations: int):
        self.num_iterations = num_iterations
        self.totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "tokens": 0.0}
        self._step = self._new_step()

    @staticmethod
    def _new_step() -> dict[str, float]:
        return {"loss": 0.0, "clipped": 0.0, "kl": 0.0, "tokens": 0.0}

    def add(self, loss: float, stats: dict[str, float]) -> None:
        """A micro-batch's loss and :func:`~teamrl.algorithms.losses.policy_loss` statistics."""
        self._step["loss"] += loss
        self._step["clipped"] += stats["clip_fraction"] * stats["tokens"]
        self._step["kl"] += stats.get("kl", 0.0) * stats["tokens"]
        self._step["tokens"] += stats["tokens"]

    def end_step(self, grad_norm: float) -> None:
        """The optimiser step over the micro-batches added since the last one."""
        step, iterations = self._step, self.num_iterations
        tokens = max(step["tokens"], 1)
        self.totals["loss"] += step["loss"] / iterations
        self.totals["grad_norm"] += grad_norm / iterations
        self.totals["clip_fraction"] += step["clipped"] / tokens / iterations
        self.totals["kl"] += step["kl"] / tokens / iterations
        self.totals["tokens"] = step["tokens"]
        self._step = self._new_step()

    def result(self) -> dict[str, float]:
        """``loss``, ``clip_fraction``, ``kl``, ``grad_norm`` and ``tokens`` (trained in the last step)."""
        return dict(self.totals)


def make_scheduler(optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int, final: float = 0.0):
    """Linear warm-up over ``warmup`` optimiser steps, then constant, or linear or cosine decay to ``final`` (a
    fraction of the learning rate) at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        decay = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return final + (1.0 - final) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(parameters: list[torch.nn.Parameter], config: TrainConfig, lr: float | None = None):
    """An agent's AdamW (at ``lr``, default ``optim.lr``) and its schedule over the run's optimiser steps."""
    optim = config.optim
    optimizer = torch.optim.AdamW(parameters, lr=lr or optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)
    total = config.steps * config.algorithm.num_iterations
    return optimizer, make_scheduler(optimizer, optim.lr_scheduler, optim.warmup_steps, total,
                                     optim.final_lr_fraction)
