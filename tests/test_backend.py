"""The agent backend: the one way the Trainer reaches a team's agents."""

from __future__ import annotations

import pytest
import torch

from teamrl.algorithms.base import AgentBackend
from teamrl.backends import LocalBackend, make_backend
from teamrl.team import Team
from teamrl.train import Trainer


class RecordingBackend:
    """An AgentBackend that records what the Trainer asks of it and hands it to a LocalBackend."""

    def __init__(self, inner: LocalBackend):
        self.inner, self.calls = inner, []
        self.names, self.team = inner.names, inner.team

    def __getattr__(self, name: str):
        method = getattr(self.inner, name)

        def recorded(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return recorded


def test_the_trainer_reaches_the_agents_only_through_the_backend(tiny_config, tmp_path):
    config = tiny_config(steps=2, algorithm={"num_generations": 2, "num_turns": 2}, checkpoint={"save_every": 1})
    trainer = Trainer(config)
    backend: AgentBackend = RecordingBackend(trainer.agents)
    trainer.agents = backend
    trainer.train()
    trainer.evaluate(max_items=2)
    trainer.save_team(tmp_path / "team")
    # Per step: a sample per turn, one update, a checkpoint's states; then the evaluation's sample per turn, and
    # the save after its weights are checked finite.
    assert backend.calls == ["sample", "sample", "update", "states"] * 2 + ["sample", "sample", "states", "save"]
    trainer.close()

    resumed = Trainer(config, resume=True)
    resumed.agents = RecordingBackend(resumed.agents)
    resumed._resume()
    assert resumed.agents.calls == ["load_states"] and resumed.step == 2


def test_local_logprobs_score_what_was_sampled(tiny_config):
    trainer = Trainer(tiny_config(steps=1, team={"training": "lora", "lora": {"r": 4}}))
    observations = [[trainer.env.observe(item)[i] for item in trainer.items[:3]] for i in range(2)]
    generations = trainer.agents.sample(observations, 2, seed=1)
    scores = trainer.agents.logprobs(generations)
    for gen, score in zip(generations, scores):
        on = gen.completion_mask.bool()
        assert on.any() and not score.requires_grad
        torch.testing.assert_close(score[on], gen.sampling_logprobs[on], atol=1e-4, rtol=0)


def test_make_backend_builds_the_team_here_unless_ray_is_asked(tiny_config):
    config = tiny_config(steps=1)
    trainer = Trainer(config)
    backend = make_backend(config, trainer.env)
    assert type(backend) is LocalBackend and isinstance(backend.team, Team)
    assert backend.names == ["first", "second"] and len(backend.optimizers) == 2
    ray_config = tiny_config(steps=1, distributed={"backend": "ray"})
    with pytest.raises(ValueError, match="pass no team object"):
        make_backend(ray_config, trainer.env, team=trainer.team)
