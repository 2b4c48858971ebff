"""One agent larger than a GPU: ``distributed.backend: fsdp``, every model of the team sharded across the processes
of a ``torchrun`` job with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

    torchrun --nproc-per-node 4 -m teamrl train CONFIG distributed.backend=fsdp

Each process (rank; one GPU each on CUDA, NCCL; CPU processes with gloo) builds the team as one process would,
then shards it: every decoder layer of each model (with the LoRA adapters inside it, every agent's) is its own
``fully_shard`` unit, and the rest of the model (embeddings, final norm, output layer) the root one. A rank then
holds 1/world of each weight, gradient and AdamW state, and gathers one layer's weights at a time for a forward or
backward pass. Weights are float32 master weights; ``team.dtype`` bfloat16 or float16 is the compute dtype
(``MixedPrecisionPolicy(param_dtype=team.dtype, reduce_dtype=float32)``), so updates are not rounded away
(:mod:`teamrl.models.precision` explains why).

A step, on every rank, with the same config and seed:

- **rollout**: every rank samples the whole batch, identically (the same weights, prompts and seeded draws;
  transformers' ``synced_gpus`` keeps a rank that finished early stepping with the others, as FSDP needs), and
  rank 0's generations are broadcast, so every rank learns from the same tree. Rewards and advantages are
  computed on every rank alike. (Sampling is not split between ranks: a rank's share of rows would draw other
  random numbers than one process does.) With ``rollout.backend: vllm``, rank 0 samples with vLLM instead: every
  rank gathers the weights its engine needs (the base once, then the adapters, or a full model's weights, after
  each change) and rank 0's sampler starts its engine from them and pushes them, as in one process.
- **update**: each rank runs its share of each agent's micro-batches (micro-batch i on rank i mod world), with
  the loss normalised over the whole batch as one process normalises it, and FSDP sums the ranks' gradients
  (gradient divide factor 1): the sum is the one-process gradient. Every collective is rank-uniform: every rank
  runs the same number of forward and backward passes (a rank with fewer micro-batches runs one of its own again
  at weight 0), none is skipped for a zero advantage (one process skips those; they contribute nothing), and the
  prompt-sharing shortcuts of the fast update, whose passes depend on the rows, are not taken.
- **checkpoints and the saved team**: each weight and optimiser state is gathered in full (a collective on every
  rank) and rank 0 writes it, in the format one process writes, so a run resumes with any number of ranks and the
  saved team loads in one process (``Team.from_pretrained``).

Limits, checked when the config loads: the algorithms that train the agents and nothing else (MAGRPO and its
variants, ``centralized``, ``madpo``; the critics and reward model of ``iac``, ``maac``, ``marlhf`` are models of
their own), and no KL reference of a fully fine-tuned agent (a second model to shard).
docs/distributed.md says when to use this, when Ray actors, and how the two combine.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from teamrl.algorithms.logprobs import completion_logprobs
from teamrl.algorithms.losses import loss_normalizer, update_loss
from teamrl.algorithms.update import NonFiniteUpdate, UpdateStats, micro_batches
from teamrl.backends.local import LocalBackend
from teamrl.backends.ranks import barrier, is_main_process
from teamrl.checkpoint import AgentState, parameter_names, restore_agent_state
from teamrl.config import TrainConfig
from teamrl.models.precision import set_compute_dtype
from teamrl.rollout.generate import Generation, generate_team, seeded
from teamrl.team import Agent, Team

if TYPE_CHECKING:
    from teamrl.envs.base import Environment


def init_distributed(device: str) -> str:
    """Join the torchrun job this process belongs to (a group of one when it was not launched by torchrun), and
    return the device this rank computes on: ``cuda:LOCAL_RANK`` for a CUDA ``device`` (one GPU per rank), else
    ``device``."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend)
        else:  # not under torchrun: a group of one, rendezvous through a file of its own
            store = tempfile.NamedTemporaryFile(prefix="teamrl-fsdp-", delete=False).name
            dist.init_process_group(backend=backend, init_method=f"file://{store}", rank=0, world_size=1)
    return device


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model (its ``_no_split_modules`` classes, which accelerate's FSDP wraps
    too), in order; PEFT's wrapping looked through."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(inner, "_no_split_modules", None) or ())
    layers = [module for module in inner.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"distributed.backend: fsdp shards a model one decoder layer at a time, and "
                         f"{type(inner).__name__} names no decoder layer class (_no_split_modules); use 'local'")
    return layers


def shard_model(model: nn.Module, compute_dtype: torch.dtype, device: str) -> nn.Module:
    """Shard ``model`` (float32 weights) across the ranks in place: each decoder layer a ``fully_shard`` unit, the
    transformers model the root, computing in ``compute_dtype``, gradients summed over the ranks in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
                                  reduce_dtype=torch.float32)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    units = [*decoder_layers(model), root]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
        # The ranks' gradients are parts of one sum (see the module docstring): summed, not averaged, with a plain
        # SUM (gloo has no pre-multiplied sum).
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    root._is_fsdp_managed_module = True  # transformers' generate() then keeps the ranks' decoding steps in step
    set_compute_dtype(model, compute_dtype)  # what vLLM's engine samples in (rollout.vllm_dtype auto)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` gathered in full (a collective: every rank calls it for the same tensors, in the same order), on
    the CPU."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def full_state_dict(module: nn.Module, keep: Any = None) -> dict[str, torch.Tensor]:
    """``module``'s state dict in full on the CPU (``keep(name)``: only those entries); a collective."""
    return {name: _full(value) for name, value in module.state_dict().items() if keep is None or keep(name)}


def _full_nested(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _full(value)
    if isinstance(value, dict):
        return {key: _full_nested(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_full_nested(item) for item in value]
    return value


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` as a shard laid out as ``param``'s (every rank holds ``full``: no data moves)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full.to(param.device)
    return distribute_tensor(full.to(param.dtype).to(param.device_mesh.device_type), param.device_mesh,
                             param.placements, src_data_rank=None)


class FSDPBackend(LocalBackend):
    """The team in this process, sharded with the other ranks' (see the module docstring): sampled alike on every
    rank, updated on each rank's share of the micro-batches. Build it on every rank with :meth:`from_config`."""

    def __init__(self, team: Team, config: TrainConfig):
        dtype = getattr(torch, config.team.dtype)
        for model in dict.fromkeys(agent.model for agent in team):
            shard_model(model, dtype, str(next(model.parameters()).device))
        for agent in team:  # fully_shard replaced every parameter by its shard
            if agent.adapter is not None:
                marker = f".{agent.adapter}."
                agent.parameters = [p for n, p in agent.model.named_parameters() if marker in n and "lora_" in n]
            else:
                agent.parameters = [p for p in agent.model.parameters() if p.requires_grad]
        super().__init__(team, config)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sampler = None
        """Rank 0's vLLM sampler (``rollout.backend: vllm``), fed weights gathered on every rank."""
        self._gathered: dict[int, tuple] = {}
        if config.rollout.backend == "vllm":
            from teamrl.backends.vllm import say_engine_dtype
            from teamrl.rollout.vllm_sampler import VLLMSampler

            if self.rank == 0:
                self.sampler = VLLMSampler(config.rollout)
                say_engine_dtype(config)

    @classmethod
    def from_config(cls, config: TrainConfig, env: Environment) -> FSDPBackend:
        """Join the torchrun job and build this rank's part of the team ``config`` describes: every rank loads the
        models whole (float32, on its device; oneDNN's packed CPU layers off), then shards them."""
        device = init_distributed(config.team.device)
        team_config = dataclasses.replace(config.team, dtype="float32", device=device, onednn_linear=False)
        team = Team.from_config(team_config, env, seed=config.seed, need_reference=config.algorithm.uses_reference)
        return cls(team, config)

    # ----------------------------------------------------------------------------------------- sampling
    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        prompts = self.team.prompts(observations)
        if self.config.rollout.backend == "vllm":
            states = self._states_for_vllm()
            generations = None if self.sampler is None else self.sampler.generate_team(
                self.team, prompts, num_samples, seed=seed, state_of=lambda model: states[id(model)])
        else:
            generations = generate_team(self.team, prompts, num_samples, seed=seed, compile=self.config.rollout.compile)
        shared = [generations]
        dist.broadcast_object_list(shared, src=0, device=self._device())
        return shared[0]

    def _states_for_vllm(self) -> dict[int, dict[str, torch.Tensor]]:
        """Each model's whole weights that rank 0's vLLM sampler will read, gathered on every rank (a collective):
        everything the first time (its engine starts from the base, or from the full model), then, after the
        weights change (the sampler pushes then too), a LoRA model's adapters or a full model's every weight.
        Nothing for a model whose weights did not change."""
        from teamrl.rollout.vllm_sampler import weights_version

        states = {}
        for model in dict.fromkeys(agent.model for agent in self.team):
            agents = [agent for agent in self.team if agent.model is model]
            version = tuple(weights_version(agent) for agent in agents)
            if self._gathered.get(id(model)) == version:
                states[id(model)] = {}
                continue
            started = id(model) in self._gathered
            keep = (lambda name: "lora_" in name) if started and agents[0].adapter is not None else None
            states[id(model)] = full_state_dict(model, keep)
            self._gathered[id(model)] = version
        return states

    def _device(self) -> torch.device:
        return next(self.team[0].model.parameters()).device

    # ----------------------------------------------------------------------------------------- update
    def update(self, generations: Sequence[list[Generation]], advantages: Sequence[list[torch.Tensor]],
               seeds: Sequence[int], loss: str = "policy_gradient") -> list[dict[str, float]]:
        out = []
        for k, agent in enumerate(self.team):
            with seeded(seeds[k], self._device()):
                stats = self._update_agent(agent, generations[k], advantages[k], self.optimizers[k],
                                           self.schedulers[k], loss)
            out.append({**stats, "lr": self.schedulers[k].get_last_lr()[0]})
        return out

    def _update_agent(self, agent: Agent, generations: list[Generation], advantages: list[torch.Tensor],
                      optimizer: torch.optim.Optimizer, scheduler: Any, loss: str) -> dict[str, float]:
        """Paper Eq. 2 for one agent as :func:`teamrl.algorithms.magrpo.update_agent` computes it, on this rank's
        share of its micro-batches (see the module docstring)."""
        config, optim = self.config.algorithm, self.config.optim
        objective = update_loss(loss)
        batches = [(gen.rows(start, stop).trimmed(), adv[start:stop].to(gen.completion_ids.device))
                   for gen, adv in zip(generations, advantages)
                   for start, stop in micro_batches(len(adv), optim.micro_batch_size, objective.rows_per_example)]
        normalizer = loss_normalizer([gen.completion_mask for gen in generations], config.logprob_aggregation,
                                     objective.rows_per_example)
        mine = batches[self.rank::self.world]
        weights = [1.0] * len(mine)
        rounds = -(-len(batches) // self.world)
        while len(mine) < rounds:  # rank-uniform passes: one of this rank's micro-batches again, at weight 0
            mine.append(mine[0] if mine else batches[0])
            weights.append(0.0)
        temperature = agent.sampling.temperature
        agent.activate()
        reference: list[torch.Tensor | None] = [None] * len(mine)
        if config.kl_coef > 0:
            with torch.no_grad(), agent.reference() as frozen:
                reference = [completion_logprobs(frozen, gen, temperature) for gen, _ in mine]
        old: list[torch.Tensor | None] = [None] * len(mine)
        tally = UpdateStats(config.num_iterations)
        root = agent.model.get_base_model() if agent.adapter is not None else agent.model
        agent.model.train()
        for _ in range(config.num_iterations):
            optimizer.zero_grad(set_to_none=True)
            sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, KL x tokens, tokens
            for b, ((gen, adv), weight) in enumerate(zip(mine, weights)):
                root.set_requires_gradient_sync(b == len(mine) - 1)  # reduce the ranks' gradients once, at the end
                logprobs = completion_logprobs(agent.model, gen, temperature)
                if old[b] is None:
                    old[b] = logprobs.detach()
                batch_loss, stats = objective.compute(logprobs, old[b], adv, gen.completion_mask, config=config,
                                                      normalizer=normalizer, ref_logprobs=reference[b])
                (batch_loss * weight).backward()
                sums += weight * torch.tensor([float(batch_loss.detach()), stats["clip_fraction"] * stats["tokens"],
                                               stats.get("kl", 0.0) * stats["tokens"], stats["tokens"]],
                                              dtype=torch.float64)
            dist.all_reduce(sums)
            tokens = max(float(sums[3]), 1.0)
            tally.add(float(sums[0]), {"clip_fraction": float(sums[1]) / tokens, "kl": float(sums[2]) / tokens,
                                       "tokens": float(sums[3])})
            tally.end_step(_clip_sharded(agent.parameters, optim.max_grad_norm, f"agent {agent.name!r}"))
            optimizer.step()
            scheduler.step()
        agent.model.eval()
        return tally.result()

    # ----------------------------------------------------------------------------------------- state
    def states(self) -> list[AgentState]:
        """Every agent's state in full, as one process holds it (a collective; every rank gets it)."""
        out = []
        for agent, optimizer, scheduler in zip(self.team, self.optimizers, self.schedulers):
            names = parameter_names(agent)
            out.append(AgentState(parameters={names[id(p)]: _full(p) for p in agent.parameters},
                                  optim={"optimizer": _full_nested(optimizer.state_dict()),
                                         "scheduler": scheduler.state_dict()}))
        return out

    def load_states(self, states: Sequence[AgentState], source: str | Path) -> None:
        for agent, optimizer, scheduler, state in zip(self.team, self.optimizers, self.schedulers, states):
            restore_agent_state(agent, optimizer, scheduler, state, source, place=_shard_like)

    def save(self, directory: str | Path, metadata: dict | None = None) -> Path:
        """The team as one process saves it, written by rank 0 from weights gathered on every rank."""
        gathered = {}
        for agent in self.team:
            if id(agent.model) in gathered:
                continue
            keep = (lambda name: "lora_" in name) if agent.adapter is not None else None
            gathered[id(agent.model)] = full_state_dict(agent.model, keep)
        if is_main_process():
            self.team.save_pretrained(directory, metadata=metadata, state_dict_of=lambda model: gathered[id(model)])
        barrier()
        return Path(directory)


def _clip_sharded(parameters: Sequence[torch.Tensor], max_grad_norm: float | None, owner: str) -> float:
    """:func:`teamrl.algorithms.magrpo.clip_gradients` for sharded gradients: their total norm over every rank's
    shards (a collective), the gradients scaled to at most ``max_grad_norm``.

    Raises:
        NonFiniteUpdate: the norm is not finite.
    """
    import math

    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    norm = torch.nn.utils.get_total_norm(grads)
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not math.isfinite(norm):
        raise NonFiniteUpdate(f"{owner}: the gradients of its update are not finite (norm {norm}), so its optimiser "
                              f"step was not taken; a learning rate too high (optim.lr) is the usual cause")
    if max_grad_norm is not None and norm > max_grad_norm:
        scale = max_grad_norm / (norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return norm
