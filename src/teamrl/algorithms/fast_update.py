"""The MAGRPO update, fast: the same gradients as :func:`teamrl.algorithms.update.update_agent`, in less time.

:func:`~teamrl.algorithms.update.update_agent` is paper Eq. 2 as it reads. This module computes the
same sums (``optim.fast_update``, on by default; tests/test_training_options.py compares the two):

- each distinct prompt runs once for its G rows, and an agent's shared prompt opening once per optimiser
  step (:func:`~teamrl.algorithms.logprobs.token_logprobs`, :class:`~teamrl.models.stem.PromptStem`);
- the active LoRA adapter runs fused into its base layer (:func:`~teamrl.models.lora.active_adapter_fused`);
- on CPU, micro-batches run two at a time on threads that split the cores, and agents that are LoRA
  adapters of one base pool their micro-batches, each thread through its own agent's adapter
  (:func:`update_pools`); each agent's gradients add up in micro-batch order, so a run repeats exactly.

What each saves is measured in docs/reports/step-time.md.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.algorithms.losses import contributes, loss_normalizer, update_loss
from teamrl.algorithms.update import UpdateStats, clip_gradients, micro_batches
from teamrl.config import AlgorithmConfig
from teamrl.models.lora import active_adapter_fused, adapter_in_this_thread, plain_lora_layers
from teamrl.models.stem import PromptStem, prompt_stem
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
    parallel_micro_batches: int = 1,
    loss: str = "policy_gradient",
) -> dict[str, float]:
    """:func:`teamrl.algorithms.update.update_agent`, fast: :func:`update_agents` with this agent alone."""
    return update_agents([agent], [generations], [advantages], [optimizer], [scheduler], config,
                         micro_batch_size=micro_batch_size, max_grad_norm=max_grad_norm,
                         parallel_micro_batches=parallel_micro_batches, loss=loss)[0]


def update_agents(
    agents: Sequence[Agent],
    generations: Sequence[list[Generation]],
    advantages: Sequence[list[torch.Tensor]],
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[torch.optim.lr_scheduler.LRScheduler],
    config: AlgorithmConfig,
    *,
    micro_batch_size: int = 0,
    max_grad_norm: float | None = None,
    parallel_micro_batches: int = 1,
    loss: str = "policy_gradient",
) -> list[dict[str, float]]:
    """:func:`teamrl.algorithms.update.update_agent` for each agent (agent k: ``generations[k]``,
    ``advantages[k]``, its own optimiser, the registered ``loss``), with every agent's micro-batches in one pool.

    ``parallel_micro_batches`` > 1 runs that many micro-batches at once on CPU threads (see
    :func:`_parallel_micro_batches`); each agent's gradients add up in its micro-batch order whichever
    thread ends first, so a run repeats exactly, and each agent gets the gradients and statistics of its
    own update. Several agents pool when they are LoRA adapters on one base (:func:`update_pools`): each
    thread runs its micro-batch's agent's adapter, and the threads stay busy across agents (with two turns
    at G=4, each agent's 5 micro-batches left one running alone on one of two threads)."""
    model = agents[0].model
    if len(agents) > 1 and not _poolable(agents):
        raise ValueError("update_agents: several agents pool only as plain LoRA adapters of one shared model; "
                         "update the others one at a time (update_pools says which pool)")
    objective = update_loss(loss)
    batches, todo, ref_logprobs, normalizers = [], [], {}, []
    for k, (agent, agent_generations, turn_advantages) in enumerate(zip(agents, generations, advantages)):
        agent.activate()
        agent_batches = [
            (gen.rows(start, stop).trimmed(), adv[start:stop].to(gen.completion_ids.device))
            for gen, adv in zip(agent_generations, turn_advantages)
            for start, stop in micro_batches(adv.shape[0], micro_batch_size, objective.rows_per_example)
        ]
        # A zero advantage contributes exactly zero gradient: without a KL term, skip its forward pass.
        todo += [(k, b) for b, (_, adv) in enumerate(agent_batches) if contributes(objective, adv, config.kl_coef)]
        batches.append(agent_batches)
        normalizers.append(loss_normalizer([gen.completion_mask for gen in agent_generations],
                                           config.logprob_aggregation, objective.rows_per_example))
        if config.kl_coef > 0:  # before the threads start: the reference switches the whole (shared) model
            with torch.no_grad(), agent.reference() as reference:
                for job in todo:
                    if job[0] == k:
                        ref_logprobs[job] = token_logprobs(reference, *_inputs(agent_batches[job[1]][0]),
                                                           temperature=agent.sampling.temperature)
    agents[0].activate()
    if len(agents) > 1:  # the model's active adapter is the first agent's; every agent's trains
        for agent in agents:
            for param in agent.parameters:
                param.requires_grad_(True)
    params = [[p for p in agent.parameters if p.requires_grad] for agent in agents]
    largest = max(params, key=lambda ps: sum(p.numel() for p in ps))  # what one thread's gradient holds
    threads = _parallel_micro_batches(model, largest, parallel_micro_batches, len(todo))
    old_logprobs: dict[tuple[int, int], torch.Tensor] = {}
    stems: list[PromptStem | None] = [None] * len(agents)

    def gradient_targets(k: int) -> list[torch.Tensor]:
        """Agent k's trained weights, then its shared prompt opening's keys and values (when it has one)."""
        return params[k] + (stems[k].leaves() if stems[k] else [])

    def micro_batch_loss(job: tuple[int, int],
                         ) -> tuple[float, dict[str, float], tuple[torch.Tensor | None, ...] | None]:
        """Micro-batch ``job`` = (agent, index)'s loss and stats; its gradient added to ``.grad`` (one thread)
        or returned."""
        k, b = job
        agent, (gen, adv_rows) = agents[k], batches[k][b]
        inputs = _inputs(gen)
        with _running(agent):
            logprobs = token_logprobs(model, *inputs, temperature=agent.sampling.temperature, stem=stems[k])
        # No update has happened yet in the first pass, so the current policy is the sampling one.
        old = old_logprobs.setdefault(job, logprobs.detach())
        batch_loss, stats = objective.compute(logprobs, old, adv_rows, inputs[3], config=config,
                                              normalizer=normalizers[k], ref_logprobs=ref_logprobs.get(job))
        if threads == 1:
            batch_loss.backward()
            return float(batch_loss.detach()), stats, None
        return (float(batch_loss.detach()), stats,
                torch.autograd.grad(batch_loss, gradient_targets(k), allow_unused=True))

    tallies = [UpdateStats(config.num_iterations) for _ in agents]
    model.train()
    # Fused once for every thread: entering and leaving it per call would unfuse the layers under the others.
    with active_adapter_fused(model) as fused:
        if len(agents) > 1 and not fused:  # unfused layers would run the active adapter for every agent
            raise RuntimeError("update_agents: the shared model's LoRA layers could not take an adapter per thread")
        for _ in range(config.num_iterations):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            # Every agent's shared prompt opening, run once (with the weights of this pass) for its micro-batches.
            for k, agent in enumerate(agents):
                with _running(agent):
                    stems[k] = prompt_stem(model, [batches[k][b][0] for owner, b in todo if owner == k])
            for (k, _), (loss_value, stats, gradient) in zip(todo, _in_threads(micro_batch_loss, todo, threads)):
                for param, grad in zip(gradient_targets(k), gradient or ()):
                    if grad is None:
                        continue
                    if param.grad is None:  # in the parameter's layout, as backward() would leave it
                        param.grad = grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)
                    else:
                        param.grad.add_(grad)
                tallies[k].add(loss_value, stats)
            for agent, stem, optimizer, scheduler, tally in zip(agents, stems, optimizers, schedulers, tallies):
                if stem is not None:
                    stem.backward([leaf.grad for leaf in stem.leaves()])
                tally.end_step(clip_gradients(agent.parameters, max_grad_norm, f"agent {agent.name!r}"))
                optimizer.step()
                scheduler.step()
    model.eval()
    agents[-1].activate()  # as after updating the agents one by one: the last one active, only its adapter trainable
    return [tally.result() for tally in tallies]


def _running(agent: Agent) -> contextlib.AbstractContextManager:
    """This thread's passes through the shared model run ``agent``'s adapter (a no-op for an agent with a
    model of its own)."""
    return adapter_in_this_thread(agent.adapter) if agent.adapter else contextlib.nullcontext()


def update_pools(agents: Sequence[Agent], parallel_micro_batches: int) -> list[list[int]]:
    """Which agents' updates run as one pool (:func:`update_agents`), as lists of indices: the agents on one
    shared model with plain LoRA adapters, where micro-batches run in parallel (CPU threads, no dropout);
    every other agent alone. Without threads a pool gains nothing, and an agent alone keeps the random
    stream its own seed gives it."""
    pools: dict[int, list[int]] = {}
    for k, agent in enumerate(agents):
        pools.setdefault(id(agent.model), []).append(k)
    result = []
    for pool in pools.values():
        members = [agents[k] for k in pool]
        if len(pool) > 1 and _poolable(members) and _parallel_micro_batches(
                members[0].model, members[0].parameters, parallel_micro_batches, num_batches=len(pool)) > 1:
            result.append(pool)
        else:
            result.extend([k] for k in pool)
    return sorted(result)


def _poolable(agents: Sequence[Agent]) -> bool:
    """Whether ``agents`` are plain LoRA adapters of one model, which can run side by side, an adapter per thread."""
    model = agents[0].model
    return (all(agent.model is model and agent.adapter is not None for agent in agents)
            and plain_lora_layers(model, [agent.adapter for agent in agents]) is not None)


def _inputs(gen: Generation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask


def _parallel_micro_batches(model: torch.nn.Module, params: Sequence[torch.nn.Parameter], requested: int,
                            num_batches: int) -> int:
    """How many micro-batches run at once: ``requested``, at most one per micro-batch; 1 on a GPU (its
    kernels already queue on one stream), where the forward pass draws random numbers (dropout: threads
    would take them from torch's one generator in whatever order they run, and a seed would no longer fix
    the masks), and where more than a tenth of the model trains (full fine-tuning: each thread's
    gradient would be another copy of the model).

    Why threads on CPU: with its threads split between two micro-batches, each of torch's operations
    runs on fewer cores, and most of an update's operations (element-wise passes, norms, attention, the
    small LoRA matmuls) scale poorly across cores (docs/reports/step-time.md#parallel-micro-batches). The cost
    is a second micro-batch's activations.
    """
    if requested <= 1 or num_batches <= 1:
        return 1
    if next(model.parameters()).device.type != "cpu" or _uses_dropout(model):
        return 1
    if sum(p.numel() for p in params) * 10 > sum(p.numel() for p in model.parameters()):
        return 1
    return min(requested, num_batches)


def _uses_dropout(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training forward pass draws dropout masks: a dropout module, or a dropout
    probability in its transformers config (attention dropout is applied functionally)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0
               for key, value in settings.items())


def _in_threads(fn: Callable, items: Sequence, threads: int) -> Iterator:
    """``map(fn, items)`` on ``threads`` threads (this one and ``threads - 1`` helpers) that split torch's CPU
    threads between them; results come in the order of ``items``.

    This thread takes part, rather than waiting on a pool: each thread that allocates gets its own
    malloc arena, whose freed blocks stay in the process, and a third arena raises the update's peak
    memory (docs/reports/step-time.md, "Eighth round")."""
    if threads <= 1:
        yield from map(fn, items)
        return
    total = torch.get_num_threads()
    queue, lock = iter(range(len(items))), threading.Lock()
    results: list[tuple[bool, Any]] = [(False, None)] * len(items)
    finished = [threading.Event() for _ in items]

    def work() -> None:
        torch.set_num_threads(max(1, total // threads))  # torch's thread count is per OS thread
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            try:
                results[index] = (True, fn(items[index]))
            except BaseException as error:  # re-raised in this thread, at its place in the order
                results[index] = (False, error)
            finished[index].set()

    helpers = [threading.Thread(target=work, name=f"teamrl-update-{k}", daemon=True) for k in range(1, threads)]
    try:
        for helper in helpers:
            helper.start()
        work()
        for index in range(len(items)):
            finished[index].wait()
            ok, value = results[index]
            if not ok:
                raise value
            results[index] = (True, None)  # let the gradients go once summed
            yield value
    finally:
        for helper in helpers:
            helper.join()
        torch.set_num_threads(total)  # the threads' calls also changed the count new threads start with
