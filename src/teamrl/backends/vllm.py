"""``rollout.backend: vllm``: the agents in this process, sampled by vLLM engines on the GPU
(:class:`~teamrl.rollout.vllm_sampler.VLLMSampler`) and updated with torch as the local backend does."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from teamrl.backends.local import LocalBackend
from teamrl.config import TrainConfig
from teamrl.rollout.continuous import TokenEngine
from teamrl.rollout.generate import Generation
from teamrl.rollout.vllm_continuous import VLLMTokenEngine
from teamrl.rollout.vllm_sampler import VLLMSampler
from teamrl.team import Team

log = logging.getLogger(__name__)


def say_engine_dtype(config: TrainConfig) -> None:
    """Warn, once per run, where ``rollout.vllm_dtype: auto`` samples in another dtype than the team trains in."""
    engine_dtype = config.rollout.engine_dtype(config.team.dtype)
    if config.rollout.vllm_dtype == "auto" and engine_dtype != config.team.dtype:
        log.warning("rollout.vllm_dtype: vLLM samples in %s while the team trains in %s (vLLM in float32 takes "
                    "twice the memory and runs without its fast attention kernels); set "
                    "rollout.vllm_dtype=float32 to sample in float32", engine_dtype, config.team.dtype)


class VLLMBackend(LocalBackend):
    """The agents in this process, updated with torch as :class:`~teamrl.backends.local.LocalBackend` does and
    sampled by vLLM (:class:`VLLMSampler`, which pushes the weights an update changed before it samples)."""

    def __init__(self, team: Team, config: TrainConfig):
        super().__init__(team, config)
        self.sampler = VLLMSampler(config.rollout)
        say_engine_dtype(config)

    def token_engine(self, max_rows: int = 64) -> TokenEngine:
        """A program task's calls sampled by the same vLLM engines as rollouts
        (:class:`~teamrl.rollout.vllm_continuous.VLLMTokenEngine`)."""
        return VLLMTokenEngine(self.team, self.sampler, max_rows=max_rows)

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        return self.sampler.generate_team(self.team, self.team.prompts(observations), num_samples, seed=seed)
