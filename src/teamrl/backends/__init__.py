"""Where a run's agents live: each backend implements :class:`~teamrl.algorithms.base.AgentBackend` (sample,
score, update, hand over and take back their state) and the Trainer reaches the agents only through it.

- :class:`~teamrl.backends.local.LocalBackend`: the agents in this process, sampled with transformers, updated
  with torch;
- :class:`~teamrl.backends.vllm.VLLMBackend`: the same, sampled by vLLM on the GPU (``rollout.backend: vllm``);
- :class:`~teamrl.backends.ray.RayTeam`: each agent in its own Ray actor, on its own CPUs, GPUs or node
  (``distributed.backend: ray``);
- :class:`~teamrl.backends.fsdp.FSDPBackend`: every model sharded across a ``torchrun`` job's processes with FSDP2,
  for an agent larger than one GPU (``distributed.backend: fsdp``).

:func:`make_backend` picks one from the config. The modules of the optional ones (vLLM, Ray) are imported only
when picked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from teamrl.backends.local import LocalBackend
from teamrl.config import TrainConfig
from teamrl.team import Team

if TYPE_CHECKING:
    from teamrl.algorithms.base import AgentBackend
    from teamrl.envs.base import Environment

__all__ = ["LocalBackend", "make_backend"]


def make_backend(config: TrainConfig, env: Environment, team: Team | None = None) -> AgentBackend:
    """The backend ``config`` asks for: the agents in Ray actors (``distributed.backend: ray``), or in this
    process sampled by vLLM (``rollout.backend: vllm``) or transformers. ``team``: agents already built
    (Python API), for a backend in this process."""
    if config.distributed.backend == "ray":
        if team is not None:
            raise ValueError("distributed.backend: 'ray' builds every agent in its own actor from the config; "
                             "pass no team object, or use 'local'")
        from teamrl.backends.ray import RayTeam

        return RayTeam(config, env)
    if config.distributed.backend == "fsdp":
        if team is not None:
            raise ValueError("distributed.backend: 'fsdp' builds and shards the team on every rank from the config; "
                             "pass no team object, or use 'local'")
        from teamrl.backends.fsdp import FSDPBackend

        return FSDPBackend.from_config(config, env)
    if team is None:
        team = Team.from_config(config.team, env, seed=config.seed, need_reference=config.algorithm.uses_reference)
    if config.rollout.backend == "vllm":
        from teamrl.backends.vllm import VLLMBackend

        return VLLMBackend(team, config)
    return LocalBackend(team, config)
