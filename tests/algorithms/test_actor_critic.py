"""IAC and MAAC (algorithms/actor_critic.py, critic.py): GAE over the tree and the clipped value loss against
numbers computed by hand, the advantages the agents get from their critics, where the critics live, and
that a run with them resumes exactly."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from teamrl.algorithms.actor_critic import explained_variance, gae_advantages, whiten
from teamrl.algorithms.advantages import tree_returns
from teamrl.algorithms.critic import value_loss
from teamrl.config import ConfigError
from teamrl.train import Trainer


def _column(*rows):
    """(E, M, 1) rewards from E rows of M numbers."""
    return torch.tensor(rows, dtype=torch.float32).unsqueeze(-1)


# A 2-turn aligned tree, G = 2: the root (V = 0.5) has joint actions rewarded 1 and 0; each grew into an
# expansion point (V = 0.8 and 0.2) whose two joint actions were rewarded (1, 0) and (0.5, 0.5).
REWARDS = [_column([1.0, 0.0]), _column([1.0, 0.0], [0.5, 0.5])]
PARENTS = [torch.tensor([0]), torch.tensor([0, 1])]
VALUES = [torch.tensor([[0.5]]), torch.tensor([[0.8], [0.2]])]


def test_gae_over_a_two_turn_tree_by_hand():
    gamma, lam = 0.9, 0.5
    second = [0.2, -0.8, 0.3, 0.3]
    # Turn 2 is the last: delta = r - V(s'), and A = delta.  Turn 1: delta = r + gamma V(s') - V(s):
    # 1 + 0.9 * 0.8 - 0.5 = 1.22 and 0 + 0.9 * 0.2 - 0.5 = -0.32; A = delta + gamma lam mean(children's A):
    # 1.22 + 0.45 * (0.2 - 0.8) / 2 = 1.085 and -0.32 + 0.45 * 0.3 = -0.185.
    first = [1.085, -0.185]
    advantages = gae_advantages(REWARDS, PARENTS, VALUES, gamma, lam)
    torch.testing.assert_close(advantages[1].flatten(), torch.tensor(second))
    torch.testing.assert_close(advantages[0].flatten(), torch.tensor(first))
    # lambda = 0: one-step TD, the deltas themselves.
    torch.testing.assert_close(gae_advantages(REWARDS, PARENTS, VALUES, gamma, 0.0)[0].flatten(),
                               torch.tensor([1.22, -0.32]))
    # lambda = 1: Monte-Carlo. R = 1 + 0.9 * 0.5 = 1.45 and 0 + 0.9 * 0.5 = 0.45, minus V = 0.5.
    torch.testing.assert_close(gae_advantages(REWARDS, PARENTS, VALUES, gamma, 1.0)[0].flatten(),
                               torch.tensor([0.95, -0.05]))


@pytest.mark.parametrize("turn_reward", ["state", "increment"])
def test_lambda_one_is_the_tree_returns_minus_the_value_on_any_tree(turn_reward):
    generator = torch.Generator().manual_seed(0)
    # 3 turns of a horizon of 4, 2 items, G = 3, 2 reward channels; joint action 1 of turn 1 and joint
    # action 2 of turn 2 stopped early (no children), every other one grew an expansion point.
    terminated = [torch.zeros(2, 3, dtype=torch.bool), torch.zeros(5, 3, dtype=torch.bool),
                  torch.zeros(14, 3, dtype=torch.bool)]
    terminated[0][0, 1] = terminated[1][0, 2] = True
    parents = [torch.arange(2), torch.tensor([0, 2, 3, 4, 5]), torch.tensor([i for i in range(15) if i != 2])]
    rewards = [torch.rand(len(p), 3, 2, generator=generator) for p in parents]
    values = [torch.rand(len(p), 2, generator=generator) for p in parents]
    returns = tree_returns(rewards, parents, 0.8, terminated, num_turns=4, turn_reward=turn_reward)
    advantages = gae_advantages(rewards, parents, values, 0.8, 1.0, terminated, num_turns=4, turn_reward=turn_reward)
    for a, r, v in zip(advantages, returns, values):
        torch.testing.assert_close(a, r - v.unsqueeze(1))


def test_a_stopped_joint_action_keeps_its_reward_to_the_horizon():
    # Turn-1 joint action 1 (reward 0.6) was stopped at turn 1 of 2: it is worth 0.6 * (1 + 0.9) = 1.14 and
    # has no children; joint action 0 grew into the one expansion point of turn 2 (V = 0.8).
    rewards = [_column([1.0, 0.6]), _column([1.0, 0.0])]
    terminated = [torch.tensor([[False, True]]), torch.zeros(1, 2, dtype=torch.bool)]
    advantages = gae_advantages(rewards, [torch.tensor([0]), torch.tensor([0])],
                                [torch.tensor([[0.5]]), torch.tensor([[0.8]])], 0.9, 0.5, terminated, num_turns=2)
    # 1 + 0.9 * 0.8 - 0.5 + 0.45 * mean(0.2, -0.8) = 1.085;  1.14 - 0.5 = 0.64.
    torch.testing.assert_close(advantages[0].flatten(), torch.tensor([1.085, 0.64]))
    # An increment (progress) is earned once: the stop is worth 0.6, 0.6 - 0.5 = 0.1.
    advantages = gae_advantages(rewards, [torch.tensor([0]), torch.tensor([0])],
                                [torch.tensor([[0.5]]), torch.tensor([[0.8]])], 0.9, 0.5, terminated, num_turns=2,
                                turn_reward="increment")
    torch.testing.assert_close(advantages[0].flatten(), torch.tensor([1.085, 0.1]))


def test_value_loss_clipped_and_unclipped_by_hand():
    values = torch.tensor([[1.0], [0.0]], requires_grad=True)
    old = torch.tensor([[0.5], [0.0]])
    targets = torch.tensor([[[2.0], [0.0]], [[1.0], [-1.0]]])  # two joint actions from each state
    # Unclipped: (1-2)^2 + (1-0)^2 + (0-1)^2 + (0+1)^2 = 4 over 4 entries.
    loss, stats = value_loss(values, old, targets, None, normalizer=4)
    assert float(loss) == pytest.approx(1.0) and stats["clip_fraction"] == 0.0
    (grad,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(grad, torch.tensor([[0.0], [0.0]]))  # state 1 sits between its two targets
    # Clipped at 0.2: state 1's V may move to 0.5 + 0.2 = 0.7 at most; toward target 2 the clipped error
    # (0.7 - 2)^2 = 1.69 is larger than 1 and constant in V: that target no longer pulls V up.
    loss, stats = value_loss(values, old, targets, 0.2, normalizer=4)
    assert float(loss) == pytest.approx((1.69 + 1 + 1 + 1) / 4) and stats["clip_fraction"] == pytest.approx(0.25)
    (grad,) = torch.autograd.grad(loss, values)
    torch.testing.assert_close(grad, torch.tensor([[2 * (1.0 - 0.0) / 4], [0.0]]))


def test_whiten_by_hand():
    a, b = whiten([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    scale = (2 / 3) ** 0.5
    torch.testing.assert_close(torch.cat([a, b]), torch.tensor([-1 / scale, 0.0, 1 / scale]))


def test_explained_variance_by_hand_over_several_states():
    # Two states, two joint actions from each: targets [0, 2] and [4, 6], mean 3, Var = (9 + 1 + 1 + 9) / 4 = 5.
    targets = torch.tensor([[[0.0], [2.0]], [[4.0], [6.0]]])
    # V = each state's mean target (1 and 5): residuals -1, 1, -1, 1, Var 1 -> 1 - 1/5
    assert explained_variance(torch.tensor([[1.0], [5.0]]), targets) == pytest.approx(0.8)
    # the same values on the wrong states: residuals -5, -3, 3, 5, Var 17 -> 1 - 17/5, worse than a constant
    assert explained_variance(torch.tensor([[5.0], [1.0]]), targets) == pytest.approx(-2.4)
    # a constant explains nothing, wherever it sits
    assert explained_variance(torch.tensor([[3.0], [3.0]]), targets) == pytest.approx(0.0)
    assert explained_variance(torch.tensor([[-7.0], [-7.0]]), targets) == pytest.approx(0.0)
    # V equal to every target of its state (the same for both joint actions; 1, 4, -2 across states) -> 1
    exact = torch.tensor([[1.0], [4.0], [-2.0]])
    assert explained_variance(exact, exact.unsqueeze(1).expand(3, 2, 1)) == pytest.approx(1.0)
    # targets that do not vary: 0, not a division by zero
    assert explained_variance(torch.tensor([[2.0], [0.0]]), torch.full((2, 2, 1), 2.0)) == 0.0


def _record_updates(trainer):
    """Replace the agents' update by one that records the advantages it is given and trains nothing."""
    calls = []

    def update(generations, advantages, seeds):
        calls.append(advantages)
        return [{"loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0}] * len(advantages)

    trainer.agents.update = update
    return calls


# Two items of different targets, so that even the expansion points of turn 1 are different states.
TWO_STATES_ENV = {"name": "digit_sum", "kwargs": {"targets": [4, 9], "length": 4}}


def _randomise_value_heads(trainer) -> list:
    """Random value heads, so that V(s) = w . h(s) + b differs from state to state (an untrained head is 0
    everywhere, and a value read for the wrong expansion point or turn would not show). Returns frozen copies of
    the critics as they are now, before the step updates them."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for critic in trainer.algorithm.critics:
            head = critic.model.head
            head.weight.copy_(0.1 * torch.randn(head.weight.shape, generator=generator))
            head.bias.copy_(0.1 * torch.randn(head.bias.shape, generator=generator))
    return [dataclasses.replace(critic, model=copy.deepcopy(critic.model)) for critic in trainer.algorithm.critics]


def _values_of_every_state(trainer, frozen, tree) -> list[list[torch.Tensor]]:
    """values[c][t]: (E_t,) critic c's V of each expansion point of turn t, one state per forward pass."""
    return [[torch.cat([critic.values([trainer.algorithm.views(obs)[c]])[:, 0] for obs in turn.observations])
             for turn in tree.turns] for c, critic in enumerate(frozen)]


def _reference_gae(tree, values: list[torch.Tensor], gamma: float, lam: float) -> list[torch.Tensor]:
    """GAE(lambda) written out over the tree, joint action by joint action: delta = r + gamma V(the point it
    grew into; 0 where none) - V(its point), A = delta + gamma lambda mean(A of that point's joint actions)."""
    advantages: list[torch.Tensor] = [torch.empty(0)] * len(tree.turns)
    for t in reversed(range(len(tree.turns))):
        rewards = tree.turns[t].rewards[..., 0]
        points, size = rewards.shape
        grew = {int(flat): e for e, flat in enumerate(tree.turns[t + 1].parents)} if t + 1 < len(tree.turns) else {}
        turn_advantages = torch.zeros(points, size)
        for e in range(points):
            for m in range(size):
                child = grew.get(e * size + m)
                later = (gamma * values[t + 1][child] + gamma * lam * advantages[t + 1][child].mean()
                         if child is not None else 0.0)
                turn_advantages[e, m] = rewards[e, m] - values[t][e] + later
        advantages[t] = turn_advantages
    return advantages


@pytest.mark.parametrize("name", ["iac", "maac"])
@pytest.mark.parametrize("turns", [1, 2])
def test_the_agents_learn_from_their_critics_advantage(tiny_config, name, turns):
    gamma, lam = 0.9, 0.5
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, env=TWO_STATES_ENV, algorithm={
        "name": name, "num_generations": 4, "num_turns": turns, "discount": gamma,
        "critic": {"gae_lambda": lam, "value_clip": None, "normalize_advantages": False}}))
    assert [c.name for c in trainer.algorithm.critics] == (["critic.first", "critic.second"] if name == "iac"
                                                            else ["critic"])
    frozen = _randomise_value_heads(trainer)
    calls = _record_updates(trainer)
    metrics = trainer.train_step()
    tree = trainer._last_tree
    values = _values_of_every_state(trainer, frozen, tree)
    every_value = torch.cat([v for critic_values in values for v in critic_values])
    assert every_value.unique().numel() == every_value.numel(), "every state must have a value of its own"
    # Every agent's part of a joint action gets its critic's advantage (aligned: sample g is joint action g):
    # IAC's agent i its own critic's, MAAC's agents the one critic's.
    references = [_reference_gae(tree, critic_values, gamma, lam) for critic_values in values]
    for i in range(2):
        reference = references[i if name == "iac" else 0]
        for t in range(turns):
            torch.testing.assert_close(calls[0][i][t], reference[t].reshape(-1), atol=1e-5, rtol=1e-5)
    # The critic's first pass: the plain squared error of V_old(s) to the lambda-returns y = A + V_old(s).
    for critic, critic_values, reference in zip(trainer.algorithm.critics, values, references):
        targets = torch.cat([(a + v.unsqueeze(1)).reshape(-1) for a, v in zip(reference, critic_values)])
        residuals = torch.cat([a.reshape(-1) for a in reference])
        assert metrics[f"{critic.name}/loss"] == pytest.approx(float((residuals ** 2).mean()), rel=1e-4)
        assert metrics[f"{critic.name}/value_mean"] == pytest.approx(float(torch.cat(critic_values).mean()), abs=1e-5)
        assert metrics[f"{critic.name}/explained_variance"] == pytest.approx(
            1 - float(residuals.var(unbiased=False) / targets.var(unbiased=False)), abs=1e-4)


@pytest.mark.parametrize("name", ["iac", "maac"])
def test_by_default_each_agents_advantages_are_the_whitened_return_minus_value(tiny_config, name):
    # Whitened per agent over the step: an untrained critic (V = 0 everywhere) must not hand every sample
    # a positive advantage, which would make the first updates MAREINFORCE's.
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, env=TWO_STATES_ENV,
                                  algorithm={"name": name, "num_generations": 4}))
    frozen = _randomise_value_heads(trainer)
    calls = _record_updates(trainer)
    trainer.train_step()
    tree = trainer._last_tree
    values = _values_of_every_state(trainer, frozen, tree)
    for i, advantages in enumerate(calls[0]):
        (point_values,) = values[i if name == "iac" else 0]
        raw = (tree.turns[0].rewards[..., 0] - point_values.unsqueeze(1)).reshape(-1)  # one turn, lambda = 1: R - V(s)
        assert raw.std() > 0, "the advantages of the step must vary for whitening to show"
        expected = (raw - raw.mean()) / (raw.std(unbiased=False) + 1e-8)
        torch.testing.assert_close(advantages[0], expected, atol=1e-5, rtol=1e-5)


def test_a_lora_teams_critics_are_adapters_on_its_shared_base_and_leave_the_agents_alone(tiny_config):
    trainer = Trainer(tiny_config(steps=1, team={"training": "lora", "lora": {"r": 4}},
                                  algorithm={"name": "iac", "num_generations": 2, "num_iterations": 2}))
    team, critics = trainer.team, trainer.algorithm.critics
    base = team[0].model
    assert all(critic.model.backbone is base for critic in critics)
    assert {"critic_first", "critic_second"} <= set(base.peft_config)
    observations = [[trainer.env.observe(item)[i] for item in trainer.items[:2]] for i in range(2)]
    generations = trainer.agents.sample(observations, 2, seed=1)
    logprobs = trainer.agents.logprobs(generations)
    agents_before = [p.detach().clone() for agent in team for p in agent.parameters]
    critic_before = [p.detach().clone() for p in critics[0].parameters]
    active = base.active_adapter
    stats = critics[0].fit(["target 9 first"], torch.zeros(1, 1), torch.ones(1, 1, 1), num_iterations=2,
                           value_clip=None)
    assert stats["grad_norm"] > 0 and base.active_adapter == active
    assert all(torch.equal(a, p) for a, p in zip(agents_before, [p for agent in team for p in agent.parameters]))
    assert not all(torch.equal(a, p) for a, p in zip(critic_before, critics[0].parameters))
    assert all(torch.equal(a, b) for a, b in zip(logprobs, trainer.agents.logprobs(generations)))
    # The second critic has not moved: each critic has its own adapter and head.
    assert float(critics[1].values(["target 9 first"])) == 0.0 and float(critics[0].values(["target 9 first"])) > 0


def test_a_full_teams_critic_fine_tunes_a_model_of_its_own(tiny_config):
    trainer = Trainer(tiny_config(steps=1, algorithm={"name": "maac", "num_generations": 2,
                                                       "critic": {"model": "tiny"}}))
    (critic,) = trainer.algorithm.critics
    assert critic.adapter is None and all(critic.model.backbone is not agent.model for agent in trainer.team)
    decoder = {id(p) for p in critic.model.backbone.base_model.parameters()}
    assert {id(p) for p in critic.parameters} == decoder | {id(p) for p in critic.model.head.parameters()}
    trainer.train_step()


def test_iac_critics_of_a_heterogeneous_team_sit_on_each_agents_own_base(tiny_config, tmp_path):
    from teamrl.envs.digit_sum import DigitSumGame
    from teamrl.models.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(DigitSumGame().vocabulary(), seed=3, hidden_size=32)
    model.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    trainer = Trainer(tiny_config(steps=1, team={"training": "lora", "lora": {"r": 4}, "agents": [
        {"name": "first"}, {"name": "second", "model": str(tmp_path / "other")}]},
        algorithm={"name": "iac", "num_generations": 2}))
    critics = trainer.algorithm.critics
    assert [c.model.backbone is agent.model for c, agent in zip(critics, trainer.team)] == [True, True]
    assert [c.model.head.in_features for c in critics] == [64, 32]
    metrics = trainer.train_step()
    assert metrics["critic.second/grad_norm"] > 0


@pytest.mark.parametrize("name,training", [("iac", "lora"), ("maac", "full")])
def test_critics_resume_from_a_checkpoint_exactly(tiny_config, tmp_path, name, training):
    def config(run):
        return tiny_config(steps=4, items_per_step=2, run_dir=str(tmp_path / run), team={"training": training},
                           algorithm={"name": name, "num_generations": 4, "num_turns": 2, "num_iterations": 2},
                           checkpoint={"save_every": 2})

    with Trainer(config("clean")) as clean:
        expected = [clean.train_step() for _ in range(4)]
        expected_states = clean.algorithm.states()
    with Trainer(config("killed")) as first_half:
        for _ in range(2):
            first_half.train_step()
        first_half.save()
    with Trainer(config("killed"), resume=True) as resumed:
        assert resumed.step == 2
        got = [resumed.train_step() for _ in range(2)]
        states = resumed.algorithm.states()
    critic_keys = [k for k in expected[0] if k.startswith("critic")]
    assert critic_keys
    for want, have in zip(expected[2:], got):
        for key in ["loss", "reward/mean", *critic_keys]:
            assert have[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert states.keys() == expected_states.keys()
    for critic, state in states.items():
        for key, tensor in state.parameters.items():
            torch.testing.assert_close(tensor, expected_states[critic].parameters[key])


def test_critic_settings_are_validated_by_name(tiny_config):
    with pytest.raises(ConfigError, match=r"algorithm\.critic\.lr"):
        tiny_config(algorithm={"name": "iac", "critic": {"lr": 0}})
    with pytest.raises(ConfigError, match=r"algorithm\.critic\.gae_lambda"):
        tiny_config(algorithm={"name": "maac", "critic": {"gae_lambda": 1.5}})
    with pytest.raises(ConfigError, match=r"algorithm\.critic\.value_clip"):
        tiny_config(algorithm={"name": "maac", "critic": {"value_clip": -1}})
    with pytest.raises(ConfigError, match=r"algorithm\.name: unknown algorithm .ppo.; registered: magrpo, "
                                          r".*\biac\b.*\bmaac\b"):
        tiny_config(algorithm={"name": "ppo"})
