"""Many agents (#40): capped cross-mode designs, per-agent advantage scaling, 3 and 4 agents end to end."""

from __future__ import annotations

import pytest
import torch

from teamrl.algorithms.advantages import (
    agent_advantages,
    normalize_per_agent,
    sample_advantages,
)
from teamrl.config import ConfigError
from teamrl.envs.base import Environment
from teamrl.rewards.base import RewardResult
from teamrl.rollout.tree import balanced_joint_design, joint_action_combos


@pytest.mark.parametrize("n, g, cap", [(3, 4, 16), (3, 4, 10), (4, 3, 20), (3, 2, 7), (3, 4, 63), (2, 4, 4)])
def test_a_capped_design_is_distinct_balanced_and_covers_every_sample(n, g, cap):
    combos = joint_action_combos(n, g, "cross", cap, seed=5)
    assert combos.shape == (cap, n)
    assert len({tuple(row.tolist()) for row in combos}) == cap
    for agent in range(n):
        counts = torch.bincount(combos[:, agent], minlength=g)
        assert counts.min() >= 1 and counts.max() - counts.min() <= 1  # floor or ceil(cap / G) each


def test_the_same_seed_draws_the_same_design_and_no_cap_is_the_full_cross():
    assert torch.equal(joint_action_combos(3, 4, "cross", 16, seed=1), joint_action_combos(3, 4, "cross", 16, seed=1))
    assert not torch.equal(joint_action_combos(3, 4, "cross", 16, seed=1),
                           joint_action_combos(3, 4, "cross", 16, seed=2))
    full = joint_action_combos(3, 4, "cross")
    assert full.shape == (64, 3)
    assert torch.equal(joint_action_combos(3, 4, "cross", 64, seed=1), full)
    assert torch.equal(joint_action_combos(3, 4, "cross", 100, seed=1), full)
    with pytest.raises(ValueError, match="algorithm.max_joint_actions"):
        balanced_joint_design(3, 4, 3, seed=0)


def test_agent_advantages_divide_by_a_variable_membership_count():
    combos = torch.tensor([[0, 0], [0, 1], [1, 1]])  # agent 0: sample 0 in two joint actions, sample 1 in one
    joint = torch.tensor([[1.0, 3.0, 5.0]])
    assert torch.allclose(agent_advantages(joint, combos, 0, 2), torch.tensor([[2.0, 5.0]]))
    assert torch.allclose(agent_advantages(joint, combos, 1, 2), torch.tensor([[1.0, 4.0]]))
    # rloo over the per-sample values: 2 - 5 and 5 - 2 (G=2: each other sample is the baseline).
    assert torch.allclose(sample_advantages(joint, combos, 0, 2, "rloo"), torch.tensor([[-3.0, 3.0]]))


@pytest.mark.parametrize("mode", ["mean", "rloo", "none"])
def test_sampled_designs_are_unbiased_for_the_full_cross_advantages(mode):
    """Monte Carlo over 3000 designs: the mean advantage of every (agent, sample) is the full-cross one."""
    n, g, cap = 3, 4, 16
    gen = torch.Generator().manual_seed(0)
    table = torch.rand((g,) * n, generator=gen) * torch.arange(1, g + 1).view(g, 1, 1)  # R(g0, g1, g2)
    full = joint_action_combos(n, g, "cross")
    returns = table[tuple(full.T)].unsqueeze(0)
    exact = torch.stack([sample_advantages(returns, full, i, g, mode)[0] for i in range(n)])
    total = torch.zeros_like(exact)
    draws = 3000
    for seed in range(draws):
        combos = joint_action_combos(n, g, "cross", cap, seed=seed)
        sampled = table[tuple(combos.T)].unsqueeze(0)
        total += torch.stack([sample_advantages(sampled, combos, i, g, mode)[0] for i in range(n)])
    assert torch.allclose(total / draws, exact, atol=0.02), (total / draws, exact)


def test_per_agent_normalisation_divides_by_each_agents_own_root_mean_square_over_the_step():
    # agent 0: [1, -1] and [2, -2] over two turns: root mean square of (1, -1, 2, -2) = sqrt(2.5)
    # agent 1: [0.5, -0.5] and [0, 0]: root mean square of (0.5, -0.5, 0, 0) = sqrt(0.125)
    per_agent = [[torch.tensor([1.0, -1.0]), torch.tensor([2.0, -2.0])],
                 [torch.tensor([0.5, -0.5]), torch.tensor([0.0, 0.0])]]
    scaled = normalize_per_agent(per_agent, floor=0.0)
    assert torch.allclose(scaled[0][1], torch.tensor([2.0, -2.0]) / 2.5**0.5)
    assert torch.allclose(scaled[1][0], torch.tensor([0.5, -0.5]) / 0.125**0.5)
    assert torch.allclose(torch.cat(scaled[1]).pow(2).mean(), torch.tensor(1.0))


def test_per_agent_normalisation_keeps_advantages_without_a_baseline_at_their_size():
    # 'none' gives each sample its raw return: constant rewards of 0.5 have no spread at all. Divided by a
    # spread (+1e-4) they became 5,000 each; by their root mean square they are 1.
    constant = [[torch.full((4,), 0.5), torch.full((4,), 0.5)]]
    assert torch.equal(normalize_per_agent(constant)[0][0], torch.ones(4))
    silent = [[torch.zeros(4), torch.full((4,), 1e-9)]]  # a step that gives nothing to learn stays near zero
    assert normalize_per_agent(silent)[0][1].abs().max() < 1e-4


def test_per_agent_normalisation_is_what_the_option_does_end_to_end():
    # A hand-built one-turn tree, 2 agents, G = 2, cross mode (4 joint actions): agent 1's samples barely move the
    # joint reward, so its raw advantages are tiny; with normalize_advantages: agent both agents' are of size 1.
    from teamrl.algorithms.magrpo import advantages
    from teamrl.config import AlgorithmConfig
    from teamrl.rollout.tree import RolloutTree, Turn

    combos = joint_action_combos(2, 2, "cross")  # (0,0), (0,1), (1,0), (1,1)
    rewards = torch.tensor([[[1.0], [1.01], [0.0], [0.01]]])  # agent 0's choice: 1.0 apart; agent 1's: 0.01
    turn = Turn(torch.tensor([0]), [{}], [()], [["", ""]], [], combos, [], rewards,
                torch.zeros(1, 4, dtype=torch.bool))
    raw, _ = advantages(RolloutTree([turn]), 2, AlgorithmConfig(num_generations=2, joint_mode="cross"))
    scaled, _ = advantages(RolloutTree([turn]), 2, AlgorithmConfig(num_generations=2, joint_mode="cross",
                                                                   normalize_advantages="agent"))
    assert torch.allclose(raw[0][0], torch.tensor([0.5, -0.5]))
    assert torch.allclose(raw[1][0], torch.tensor([-0.005, 0.005]))
    assert torch.allclose(scaled[0][0], torch.tensor([1.0, -1.0]))
    assert torch.allclose(scaled[1][0], torch.tensor([-1.0, 1.0]))


def test_the_new_fields_are_validated_by_name(tiny_config):
    with pytest.raises(ConfigError, match=r"algorithm.max_joint_actions: must be empty or an int >= num_generations"):
        tiny_config(algorithm={"num_generations": 4, "joint_mode": "cross", "max_joint_actions": 3})
    with pytest.raises(ConfigError, match="algorithm.normalize_advantages"):
        tiny_config(algorithm={"normalize_advantages": "group"})


class DigitTeam(Environment):
    """n agents each write one digit; the joint reward is 1 - |sum - target| / (9 n)."""

    roles = ()
    max_turns = 2

    def __init__(self, num_agents: int = 3, target: int = 9):
        self.num_agents = num_agents
        self.roles = tuple(f"You are writer {i} . Write one digit ." for i in range(num_agents))
        self.target = target
        self.splits = {split: [{"id": f"{split}-{i}", "target": target} for i in range(4)]
                       for split in ("train", "eval")}

    def observe(self, item):
        return [f"Digits summing to {item['target']} : yours ?" for _ in range(self.num_agents)]

    def next_observations(self, item, history):
        return [f"Last digits {' '.join(history[-1].actions)} : yours ?" for _ in range(self.num_agents)]

    def joint_reward(self, item, actions, history=()):
        digits = [int(a.split()[0]) if a.split() and a.split()[0].isdigit() else 0 for a in actions]
        return RewardResult(total=1 - abs(sum(digits) - item["target"]) / (9 * self.num_agents))

    def vocabulary(self):
        return [*map(str, range(10)), "Digits", "summing", "to", ":", "yours", "?", "Last", "digits", "You",
                "are", "writer", ".", "Write", "one", "digit"]


@pytest.mark.parametrize("num_agents, algorithm", [
    (3, {"joint_mode": "cross", "max_joint_actions": 16, "normalize_advantages": "agent"}),
    (3, {"joint_mode": "aligned", "num_turns": 2}),
    (4, {"joint_mode": "cross", "max_joint_actions": 16, "num_turns": 2}),
    (4, {"joint_mode": "aligned", "normalize_advantages": "agent"}),
])
def test_three_and_four_agents_train_end_to_end(tiny_config, num_agents, algorithm):
    import functools

    from teamrl.algorithms.magrpo import advantages
    from teamrl.rollout.generate import sample_team
    from teamrl.rollout.tree import sample_tree
    from teamrl.train import Trainer

    config = tiny_config(steps=2, items_per_step=2,
                         team={"agents": [{"name": f"a{i}"} for i in range(num_agents)]},
                         algorithm={"num_generations": 4, **algorithm})
    env = DigitTeam(num_agents)
    trainer = Trainer(config, env=env)
    try:
        before = [[p.detach().clone() for p in agent.parameters] for agent in trainer.team]
        tree = sample_tree(functools.partial(sample_team, trainer.team), env, env.items()[:2], config.algorithm, seed=3)
        cross = algorithm["joint_mode"] == "cross"
        for turn in tree.turns:
            assert turn.combos.shape == ((16 if cross else 4), num_agents)
            assert turn.rewards.shape == (len(turn.parents), turn.combos.shape[0], 1)
        per_agent, _ = advantages(tree, num_agents, config.algorithm)
        assert all(torch.isfinite(torch.cat(turns)).all() for turns in per_agent)
        history = trainer.train()
        assert len(history) == 2
        losses = [value for step in history for key, value in step.items() if key.endswith("/loss")]
        assert losses and all(torch.isfinite(torch.tensor(losses)))
        for agent, old in zip(trainer.team, before):
            assert any(not torch.equal(p, q) for p, q in zip(agent.parameters, old)), agent.name
    finally:
        trainer.close()
