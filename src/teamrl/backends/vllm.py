"""``rollout.backend: vllm``: the agents in this process, sampled by vLLM engines on the GPU
(:class:`~teamrl.rollout.vllm_sampler.VLLMSampler`) and updated with torch as the local backend does."""

from __future__ import annotations

from collections.abc import Sequence

from teamrl.backends.local import LocalBackend
from teamrl.config import TrainConfig
from teamrl.rollout.generate import Generation
from teamrl.rollout.vllm_sampler import VLLMSampler
from teamrl.team import Team


class VLLMBackend(LocalBackend):
    """The agents in this process, updated with torch as :class:`~teamrl.backends.local.LocalBackend` does and
    sampled by vLLM (:class:`VLLMSampler`, which pushes the weights an update changed before it samples)."""

    def __init__(self, team: Team, config: TrainConfig):
        super().__init__(team, config)
        self.sampler = VLLMSampler(config.rollout)

    def sample(self, observations: Sequence[list[str]], num_samples: int, seed: int) -> list[Generation]:
        return self.sampler.generate_team(self.team, self.team.prompts(observations), num_samples, seed=seed)
