"""MAGRPO: Multi-Agent Group Relative Policy Optimization (Liu et al., arXiv 2508.04652), in one file.

One training step for a batch of items:

1. Rollout (:func:`rollout`). At turn 1 every agent samples G completions of its own observation of
   each item. Joint actions pair them ('aligned': the g-th of every agent, G joint actions; 'cross':
   every combination, G^n). Each joint action gets one joint reward r. For T > 1, every joint action
   (unless early termination stopped it) is a node from which the environment gives each agent its next
   observation, and every agent again samples G completions: an aligned tree with G^T leaves.
2. Returns (:func:`~teamrl.algorithms.advantages.tree_returns`): R = r at a leaf,
   R = r + gamma * mean(R of the children) at an inner node.
3. Advantages, paper Eq. 1 (:func:`~teamrl.algorithms.advantages.group_advantages`): over the
   joint actions that share a parent node, A_g = R_g - mean(R) (or a registered variant). The advantage
   is centralised: every agent's part of joint action g gets the same A_g ('cross': an agent's sample
   gets the mean over the joint actions it is in).
4. Update, paper Eq. 2 (:func:`update_agent`): each agent, with its own optimiser, maximises
   mean_g A_g * log pi_theta_i(a_i^g | o_i) over its completions of every turn, with optional PPO-style
   clipping over several passes and a KL penalty to its reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from teamrl.algorithms.advantages import agent_advantages, group_advantages, joint_action_combos, tree_returns
from teamrl.algorithms.losses import loss_normalizer, policy_loss
from teamrl.config import AlgorithmConfig
from teamrl.envs.base import Environment, Item, Step
from teamrl.rewards.base import RewardResult
from teamrl.rollout.generate import Generation, active_adapter_fused, derive_seed, generate_team, token_logprobs
from teamrl.team import Agent, Team


@dataclass
class Turn:
    """Everything one turn of the rollout tree produced."""

    parents: torch.Tensor
    """(E,) flat index of the previous turn's joint action each expansion point grew from (item index at turn 1)."""
    items: list[Item]
    histories: list[tuple[Step, ...]]
    observations: list[list[str]]
    """observations[e][i]: agent i's observation at expansion point e."""
    generations: list[Generation]
    """generations[i]: agent i's E x G completions, G consecutive rows per expansion point."""
    combos: torch.Tensor
    """(M, n): joint action m takes sample combos[m, i] of agent i."""
    results: list[RewardResult]
    """Joint reward of each of the E x M joint actions."""
    rewards: torch.Tensor
    """(E, M, K): the reward channel(s) learners use (K=1 joint, K=n individual)."""
    generation_seconds: float = 0.0

    def joint_action(self, e: int, m: int) -> tuple[str, ...]:
        """The completions making up joint action m of expansion point e."""
        num_samples = self.generations[0].completion_ids.shape[0] // len(self.parents)
        return tuple(gen.texts[e * num_samples + int(g)] for gen, g in zip(self.generations, self.combos[m]))


@dataclass
class Rollout:
    """A step's rollout tree, turn by turn."""

    turns: list[Turn] = field(default_factory=list)


SampleFn = Callable[[Sequence[list[str]], int, int], list[Generation]]
"""``sample(observations, num_samples, seed)``: for every agent i in seat order, ``num_samples``
completions of each of its own observations ``observations[i]``, prompted in its role; ``seed`` fixes the
tokens. :func:`team_sampler` samples a :class:`~teamrl.team.Team` in this process; a
:class:`~teamrl.distributed.RayTeam` samples in its agent actors."""


def team_sampler(team: Team) -> SampleFn:
    """The :data:`SampleFn` of a team in this process: one batched generate call per agent (per base model,
    when LoRA agents share one)."""

    def sample(observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        prompts = [[agent.prompt(o) for o in obs] for agent, obs in zip(team, observations)]
        return generate_team(team, prompts, num_samples, seed=seed)

    return sample


def rollout(sample: SampleFn, env: Environment, items: Sequence[Item], config: AlgorithmConfig, *,
            seed: int = 0) -> Rollout:
    """Sample the MAGRPO tree for ``items``: per turn, every agent's G completions of each of its
    observations at once (``sample``, seeded from ``seed`` and the turn)."""
    num_samples, individual = config.num_generations, config.learners == "individual"
    combos = joint_action_combos(env.num_agents, num_samples, config.joint_mode)
    frontier = [(item, ()) for item in items]
    parents = torch.arange(len(items))
    tree = Rollout()
    for turn in range(config.num_turns):
        observations = [env.observe(item) if not history else env.next_observations(item, history)
                        for item, history in frontier]
        start = time.perf_counter()
        generations = sample([[obs[i] for obs in observations] for i in range(env.num_agents)], num_samples,
                             derive_seed(seed, turn))
        seconds = time.perf_counter() - start
        record = Turn(parents, [f[0] for f in frontier], [f[1] for f in frontier], observations, generations,
                      combos, [], torch.empty(0), seconds)
        requests = [(item, record.joint_action(e, m), history)
                    for e, (item, history) in enumerate(frontier) for m in range(len(combos))]
        record.results = env.joint_rewards(requests)
        channels = ([env.individual_rewards(*request) for request in requests] if individual
                    else [[result.total] for result in record.results])
        record.rewards = torch.tensor(channels, dtype=torch.float32).view(len(frontier), len(combos), -1)
        tree.turns.append(record)

        next_frontier, next_parents = [], []
        if turn + 1 < config.num_turns:
            threshold = config.early_termination_threshold
            for flat, ((item, actions, history), result) in enumerate(zip(requests, record.results)):
                if threshold is not None and result.total >= threshold:
                    continue
                step = Step(tuple(observations[flat // len(combos)]), tuple(actions), result)
                next_frontier.append((item, (*history, step)))
                next_parents.append(flat)
        if not next_frontier:
            break
        frontier, parents = next_frontier, torch.tensor(next_parents)
    return tree


def advantages(tree: Rollout, num_agents: int, config: AlgorithmConfig) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    """Per agent and turn, the (E*G,) advantage of each of its completions; and the returns of each turn."""
    returns = tree_returns([t.rewards for t in tree.turns], [t.parents for t in tree.turns], config.discount)
    per_agent: list[list[torch.Tensor]] = [[] for _ in range(num_agents)]
    for turn, turn_returns in zip(tree.turns, returns):
        joint = group_advantages(turn_returns, config.advantage)  # Eq. 1, one group per expansion point
        for i in range(num_agents):
            channel = joint[:, :, min(i, joint.shape[2] - 1)]  # the shared reward, or agent i's own
            per_agent[i].append(agent_advantages(channel, turn.combos, i, config.num_generations).reshape(-1))
    return per_agent, returns


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
) -> dict[str, float]:
    """Paper Eq. 2 for one agent: ``num_iterations`` optimiser steps on its completions of every turn.

    ``parallel_micro_batches`` > 1 runs that many micro-batches at once on CPU threads (see
    :func:`_parallel_micro_batches`); the gradients add up in micro-batch order whichever thread ends first,
    so a run repeats exactly."""
    agent.activate()
    temperature = agent.sampling.temperature
    batches = [
        (gen.rows(start, stop).trimmed(), adv[start:stop].to(gen.completion_ids.device))
        for gen, adv in zip(generations, advantages)
        for start, stop in _micro_batches(adv.shape[0], micro_batch_size)
    ]
    use_kl = config.kl_coef > 0
    # A zero advantage contributes exactly zero gradient: without a KL term, skip its forward pass.
    todo = [b for b, (_, adv) in enumerate(batches) if use_kl or adv.any()]
    ref_logprobs: dict[int, torch.Tensor] = {}
    if use_kl:  # before the threads start: the reference switches the whole (shared) model
        with torch.no_grad(), agent.reference() as reference:
            for b in todo:
                ref_logprobs[b] = token_logprobs(reference, *_inputs(batches[b][0]), temperature=temperature)
        agent.activate()
    normalizer = loss_normalizer([gen.completion_mask for gen in generations], config.logprob_aggregation)
    params = [p for p in agent.parameters if p.requires_grad]
    threads = _parallel_micro_batches(agent.model, params, parallel_micro_batches, len(todo))
    old_logprobs: dict[int, torch.Tensor] = {}

    def micro_batch_loss(b: int) -> tuple[float, dict[str, float], tuple[torch.Tensor | None, ...] | None]:
        """Micro-batch b's loss and stats; its gradient added to ``.grad`` (one thread) or returned."""
        gen, adv_rows = batches[b]
        inputs = _inputs(gen)
        logprobs = token_logprobs(agent.model, *inputs, temperature=temperature)
        # No update has happened yet in the first pass, so the current policy is the sampling one.
        old = old_logprobs.setdefault(b, logprobs.detach())
        loss, stats = policy_loss(
            logprobs, old, adv_rows, inputs[3],
            aggregation=config.logprob_aggregation, normalizer=normalizer,
            epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
            ref_logprobs=ref_logprobs.get(b), kl_coef=config.kl_coef,
        )
        if threads == 1:
            loss.backward()
            return float(loss.detach()), stats, None
        return float(loss.detach()), stats, torch.autograd.grad(loss, params, allow_unused=True)

    totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "tokens": 0.0}
    agent.model.train()
    # Fused once for every thread: entering and leaving it per call would unfuse the layers under the others.
    with active_adapter_fused(agent.model):
        for iteration in range(config.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            loss_sum, clipped, kl_sum, tokens = 0.0, 0.0, 0.0, 0.0
            for loss_value, stats, gradient in _in_threads(micro_batch_loss, todo, threads):
                for param, grad in zip(params, gradient or ()):
                    if grad is None:
                        continue
                    if param.grad is None:  # in the parameter's layout, as backward() would leave it
                        param.grad = grad if grad.stride() == param.stride() else torch.empty_like(param).copy_(grad)
                    else:
                        param.grad.add_(grad)
                loss_sum += loss_value
                clipped += stats["clip_fraction"] * stats["tokens"]
                kl_sum += stats.get("kl", 0.0) * stats["tokens"]
                tokens += stats["tokens"]
            has_grad = any(p.grad is not None for p in agent.parameters)
            norm = float(torch.nn.utils.clip_grad_norm_(agent.parameters, max_grad_norm or float("inf"))) if has_grad else 0.0
            optimizer.step()
            scheduler.step()
            totals["loss"] += loss_sum / config.num_iterations
            totals["grad_norm"] += norm / config.num_iterations
            totals["clip_fraction"] += clipped / max(tokens, 1) / config.num_iterations
            totals["kl"] += kl_sum / max(tokens, 1) / config.num_iterations
            totals["tokens"] = tokens
    agent.model.eval()
    return totals


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
    small LoRA matmuls) scale poorly across cores: an update of SmolLM2-135M's LoRA agents on 2 CPU
    cores took ~15% less time (docs/performance.md). The cost is a second micro-batch's activations.
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
    malloc arena, whose freed blocks stay in the process, and a third arena added ~0.5 GB to the peak
    memory of an update on 2 CPU cores (SmolLM2-135M LoRA agents, 4-row micro-batches)."""
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


def _micro_batches(size: int, micro_batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) of consecutive row ranges; each runs as its own forward pass without the padding
    columns none of its rows needs (``Generation.rows(...).trimmed()``)."""
    step = micro_batch_size or size
    return [(start, min(start + step, size)) for start in range(0, size, step)]


def rollout_metrics(tree: Rollout, returns: list[torch.Tensor], agent_advantages_: list[list[torch.Tensor]]) -> dict[str, float]:
    """Per-turn joint reward and return statistics, and advantage statistics, for logging."""
    metrics: dict[str, float] = {}
    for t, (turn, turn_returns) in enumerate(zip(tree.turns, returns), start=1):
        joint = torch.tensor([r.total for r in turn.results])
        metrics[f"reward/turn{t}/mean"] = float(joint.mean())
        metrics[f"reward/turn{t}/std"] = float(joint.std()) if joint.numel() > 1 else 0.0
        metrics[f"return/turn{t}/mean"] = float(turn_returns.mean())
        metrics[f"turn{t}/joint_actions"] = float(joint.numel())
    every = torch.cat([a for per_turn in agent_advantages_ for a in per_turn])
    metrics["advantage/mean"] = float(every.mean())
    metrics["advantage/std"] = float(every.std()) if every.numel() > 1 else 0.0
    metrics["advantage/abs_mean"] = float(every.abs().mean())
    metrics["reward/mean"] = metrics["reward/turn1/mean"]
    metrics["return/mean"] = metrics["return/turn1/mean"]
    return metrics
