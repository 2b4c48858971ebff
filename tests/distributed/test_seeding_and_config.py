"""What the Ray backend's equivalence rests on, checked without starting Ray: seeded sampling depends on
the call's inputs and seed only, agent i's seed in one process is the one its actor gets, and the
`distributed` config section validates with one-line errors."""

from __future__ import annotations

import pytest
import torch

from teamrl.config import ConfigError, describe_fields
from teamrl.rollout.generate import derive_seed, generate, generate_team
from teamrl.train import Trainer


def test_derive_seed_is_a_pure_function_of_its_parts():
    assert derive_seed(0, 3, 1) == derive_seed(0, 3, 1)
    assert len({derive_seed(0, 3, 1), derive_seed(0, 3, 2), derive_seed(0, 4, 1), derive_seed(1, 3, 1),
                derive_seed(0, 3, "update", 1)}) == 5
    assert 0 <= derive_seed(2**40, -1) < 2**63


def test_seeded_generation_ignores_and_keeps_the_global_rng(tiny_config):
    trainer = Trainer(tiny_config(steps=1))
    agent = trainer.team[0]
    prompts = [agent.prompt("target 9 first")]
    torch.manual_seed(1)
    first = generate(agent, prompts, 8, seed=7)
    after_first = torch.random.get_rng_state()
    torch.manual_seed(2)
    torch.rand(5)  # whatever ran before must not matter
    second = generate(agent, prompts, 8, seed=7)
    assert torch.equal(first.completion_ids, second.completion_ids)
    torch.manual_seed(1)
    assert torch.equal(torch.random.get_rng_state(), after_first)  # the caller's stream was left untouched
    assert not torch.equal(first.completion_ids, generate(agent, prompts, 8, seed=8).completion_ids)


def test_agent_i_samples_under_the_seed_its_ray_actor_gets(tiny_config):
    # team.training=full: each agent is its own generate call, as in its own actor.
    trainer = Trainer(tiny_config(steps=1))
    prompts = [[agent.prompt(f"target 9 {agent.name}")] * 2 for agent in trainer.team]
    together = generate_team(trainer.team, prompts, 4, seed=11)
    for i, agent in enumerate(trainer.team):
        alone = generate(agent, prompts[i], 4, seed=derive_seed(11, i))  # what RayTeam.sample asks actor i for
        assert torch.equal(together[i].completion_ids, alone.completion_ids)
        assert together[i].texts == alone.texts


def test_seeded_generation_refuses_concurrent_threads(tiny_config):
    trainer = Trainer(tiny_config(steps=1))
    with pytest.raises(ValueError, match="seeded sampling runs the agents one after another"):
        generate_team(trainer.team, [["target 9 first"], ["target 9 second"]], 2, concurrent=True, seed=0)


@pytest.mark.parametrize(("distributed", "team", "message"), [
    ({"cpus_per_agent": 0}, {}, "distributed.cpus_per_agent: must be > 0"),
    ({"gpus_per_agent": -1}, {}, "distributed.gpus_per_agent: must be >= 0"),
    ({"backend": "ray", "gpus_per_agent": 1}, {}, "team.device: must be 'cuda' with distributed.backend='ray'"),
    ({"backend": "ray"}, {"device": "cuda:1"}, "team.device: must be 'cpu' with distributed.backend='ray'"),
    ({"placement": "anywhere"}, {}, "distributed.placement: 'anywhere' is not one of"),
    ({"backend": "slurm"}, {}, "distributed.backend: 'slurm' is not one of"),
])
def test_distributed_config_errors_name_the_field(tiny_config, distributed, team, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        tiny_config(distributed=distributed, team=team)
    assert "\n" not in str(err.value)


def test_teamrl_config_lists_the_distributed_fields():
    fields = {name: default for name, default, _ in describe_fields()}
    assert fields["distributed.backend"] == "'local'"
    assert fields["distributed.cpus_per_agent"] == "0.5"
    assert {"distributed.address", "distributed.gpus_per_agent", "distributed.placement"} <= fields.keys()
