"""Learning from a program's episodes: every call of an agent trained with its episode's group-relative advantage (any
registered estimator), an agent an episode never called learning nothing from it, and what cannot learn from program
episodes refused when the config loads."""

from __future__ import annotations

import pytest
import torch

from teamrl.algorithms.advantages import episode_advantages
from teamrl.algorithms.magrpo import MAGRPO
from teamrl.config import ConfigError
from teamrl.registry import ADVANTAGES
from teamrl.rollout.continuous import TokenCompletion
from teamrl.rollout.episodes import ProgramRollout, as_generation


def _rollout(rewards: list[list[float]], calls: dict[int, list[int]], num_agents: int = 2) -> ProgramRollout:
    """Episodes with ``rewards`` (E x G); agent i called once in each flat episode of ``calls[i]``."""
    generations, rows = [], []
    for agent in range(num_agents):
        episodes = calls.get(agent, [])
        generations.append(as_generation([TokenCompletion(agent, [3, 4, 5], [6 + n % 3, 7, 1], [-1.0, -2.0, -0.5],
                                                          "x", "stop") for n in episodes]))
        rows.append(torch.tensor(episodes, dtype=torch.long))
    return ProgramRollout([{"id": f"i{e}"} for e in range(len(rewards))], [], torch.tensor(rewards), generations, rows)


class _Recorder:
    names = ["planner", "writer"]

    def update(self, generations, advantages, seeds, loss="policy_gradient"):
        self.generations, self.advantages = generations, advantages
        return [{"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0} for _ in generations]


@pytest.mark.parametrize("estimator", list(ADVANTAGES))
def test_each_call_is_trained_with_its_episodes_advantage_over_the_g_episodes_of_its_item(tiny_config, estimator):
    config = tiny_config(algorithm={"num_generations": 3, "advantage": estimator})
    rewards = [[1.0, 0.0, 2.0], [0.5, 0.5, 3.0]]
    # The planner is called in every episode, the writer twice in episode 5 and never in episodes 0 and 3.
    rollout = _rollout(rewards, {0: [0, 1, 2, 3, 4, 5], 1: [1, 2, 4, 5, 5]})
    recorder = _Recorder()
    metrics = MAGRPO(config, None, recorder).learn_episodes(rollout, recorder, [0, 1])
    expected = ADVANTAGES.lookup(estimator)(torch.tensor(rewards)).reshape(-1)
    assert torch.equal(recorder.advantages[0][0], expected)
    assert torch.equal(recorder.advantages[1][0], expected[[1, 2, 4, 5, 5]])
    assert [gen[0].completion_ids.shape[0] for gen in recorder.generations] == [6, 5]
    assert metrics["reward/mean"] == pytest.approx(7 / 6) and metrics["writer/calls_per_episode"] == 5 / 6


def test_the_group_baseline_of_an_item_is_its_own_episodes(tiny_config):
    advantages = episode_advantages(torch.tensor([[1.0, 3.0], [10.0, 10.0]]), "mean")
    assert advantages.tolist() == [[-1.0, 1.0], [0.0, 0.0]]  # item 2's equal returns teach nothing


def test_an_agent_no_episode_called_keeps_its_weights_and_the_called_one_learns(tiny_config):
    from teamrl.backends import make_backend
    from teamrl.envs.base import make_env

    config = tiny_config(team={"training": "lora"}, algorithm={"num_generations": 2}, optim={"lr": 0.05})
    env = make_env(config.env.name, **config.env.kwargs)
    backend = make_backend(config, env)
    before = [[p.detach().clone() for p in agent.parameters] for agent in backend.team]
    rollout = _rollout([[1.0, 0.0]], {0: [0, 1]})  # only the first agent was called
    MAGRPO(config, env, backend).learn_episodes(rollout, backend, [0, 1])
    changed = [any(not torch.equal(b, p) for b, p in zip(old, agent.parameters))
               for old, agent in zip(before, backend.team)]
    assert changed == [True, False]


PROGRAM = {"name": "program", "kwargs": {"program": "os.path:join", "data": "items.jsonl"}}


@pytest.mark.parametrize(("override", "field", "why"), [
    ({"algorithm": {"name": "iac"}}, "algorithm.name", "cannot learn from a program's episodes"),
    ({"algorithm": {"name": "madpo"}}, "algorithm.name", "cannot learn from a program's episodes"),
    ({"algorithm": {"name": "centralized"}, "team": {"agents": [{"name": "a"}]}}, "algorithm.name",
     "cannot learn from a program's episodes"),
    ({"algorithm": {"joint_mode": "cross"}}, "algorithm.joint_mode", "cannot be paired with another episode's"),
    ({"algorithm": {"num_turns": 2}}, "algorithm.num_turns", "the turn tree would need the program replayed"),
    ({"algorithm": {"learners": "individual"}}, "algorithm.learners", "one joint reward per episode"),
    ({"algorithm": {"early_termination_threshold": 1.0}}, "algorithm.early_termination_threshold", "no turns"),
])
def test_what_cannot_learn_from_program_episodes_is_refused_at_load_in_one_line(tiny_config_data, override, field,
                                                                                  why):
    from teamrl.config import config_from_dict

    data = tiny_config_data(env=PROGRAM)
    for section, values in override.items():
        data[section] = {**data[section], **values}
    with pytest.raises(ConfigError) as refused:
        config_from_dict(data)
    message = str(refused.value)
    assert message.startswith(f"{field}: ") and why in message and "\n" not in message
