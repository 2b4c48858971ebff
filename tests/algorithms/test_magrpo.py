"""MAGRPO's plain update (magrpo.update_agent, paper Eq. 2) against the objective written out by hand,
and the small pieces it is made of."""

from __future__ import annotations

import functools

import pytest
import torch

from teamrl.algorithms import magrpo
from teamrl.algorithms.logprobs import completion_logprobs
from teamrl.algorithms.update import UpdateStats, micro_batches, update_agent
from teamrl.rollout.generate import sample_team
from teamrl.rollout.tree import sample_tree
from teamrl.train import Trainer


def _one_rollout(trainer: Trainer):
    """Agent 0's completions of every turn and their advantages, for the trainer's first two items."""
    config = trainer.config.algorithm
    tree = sample_tree(functools.partial(sample_team, trainer.team), trainer.env, trainer.items[:2], config, seed=3)
    advantages, _ = magrpo.advantages(tree, len(trainer.team), config)
    return [turn.generations[0] for turn in tree.turns], advantages[0]


def _sgd(agent, lr: float):
    optimizer = torch.optim.SGD(agent.parameters, lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _eq2_objective(agent, generations, advantages) -> torch.Tensor:
    """Eq. 2 with token_sum aggregation: mean over completions g of A_g * log pi(a^g | o), where log pi of a
    completion sums over its tokens up to and including its end."""
    total, count = 0.0, 0
    for gen, adv in zip(generations, advantages):
        logprobs = completion_logprobs(agent.model, gen, agent.sampling.temperature)
        total = total + (adv[:, None] * logprobs * gen.completion_mask).sum()
        count += gen.completion_mask.shape[0]
    return total / count


def test_one_on_policy_step_is_gradient_ascent_on_eq2(tiny_config):
    trainer = Trainer(tiny_config(steps=1, algorithm={"num_generations": 4}))
    agent = trainer.team[0]
    generations, advantages = _one_rollout(trainer)
    assert any(adv.abs().sum() > 0 for adv in advantages)
    agent.model.train()
    objective = _eq2_objective(agent, generations, advantages)
    expected = torch.autograd.grad(objective, agent.parameters)
    agent.model.eval()
    before = [p.detach().clone() for p in agent.parameters]

    lr = 0.01
    optimizer, scheduler = _sgd(agent, lr)
    stats = update_agent(agent, generations, advantages, optimizer, scheduler, trainer.config.algorithm,
                                micro_batch_size=3)
    for after, start, grad in zip(agent.parameters, before, expected):
        torch.testing.assert_close(after - start, lr * grad, rtol=1e-4, atol=1e-7)
    # On policy the ratio is exactly 1: the surrogate's value is -A per token (its gradient is Eq. 2's), and
    # nothing is clipped.
    surrogate = -sum(float((adv * gen.completion_mask.sum(dim=1)).sum()) for gen, adv in zip(generations, advantages))
    assert stats["loss"] == pytest.approx(surrogate / sum(len(adv) for adv in advantages), rel=1e-5, abs=1e-7)
    assert stats["clip_fraction"] == 0.0 and stats["kl"] == 0.0
    assert stats["tokens"] == sum(float(gen.completion_mask[adv != 0].sum())
                                  for gen, adv in zip(generations, advantages))
    assert stats["grad_norm"] == pytest.approx(float(torch.cat([g.flatten() for g in expected]).norm()), rel=1e-4)


def test_zero_advantages_leave_the_weights_and_train_no_tokens(tiny_config):
    trainer = Trainer(tiny_config(steps=1, algorithm={"num_generations": 4}))
    agent = trainer.team[0]
    generations, advantages = _one_rollout(trainer)
    before = [p.detach().clone() for p in agent.parameters]
    optimizer, scheduler = _sgd(agent, 0.1)
    stats = update_agent(agent, generations, [torch.zeros_like(a) for a in advantages], optimizer, scheduler,
                                trainer.config.algorithm)
    assert all(torch.equal(p, b) for p, b in zip(agent.parameters, before))
    assert stats == {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0, "tokens": 0.0}


def test_the_gradient_is_clipped_to_max_grad_norm_and_the_norm_before_is_reported(tiny_config):
    trainer = Trainer(tiny_config(steps=1, algorithm={"num_generations": 4}))
    agent = trainer.team[0]
    generations, advantages = _one_rollout(trainer)
    before = [p.detach().clone() for p in agent.parameters]
    lr, max_norm = 1.0, 1e-3
    optimizer, scheduler = _sgd(agent, lr)
    stats = update_agent(agent, generations, advantages, optimizer, scheduler, trainer.config.algorithm,
                                max_grad_norm=max_norm)
    assert stats["grad_norm"] > max_norm
    moved = torch.cat([(p - b).flatten() for p, b in zip(agent.parameters, before)]).norm()
    assert float(moved) == pytest.approx(lr * max_norm, rel=1e-3)


def test_later_passes_are_off_policy_and_clipped(tiny_config):
    config = tiny_config(steps=1, algorithm={"num_generations": 4, "num_iterations": 3, "epsilon_low": 0.01,
                                             "epsilon_high": 0.01})
    trainer = Trainer(config)
    agent = trainer.team[0]
    generations, advantages = _one_rollout(trainer)
    optimizer, scheduler = _sgd(agent, 5.0)  # big steps: the second pass's ratios leave [0.99, 1.01]
    stats = update_agent(agent, generations, advantages, optimizer, scheduler, config.algorithm)
    assert 0.0 < stats["clip_fraction"] < 1.0
    assert scheduler.last_epoch == 3  # one optimiser step per pass


def test_the_kl_term_needs_and_uses_the_reference(tiny_config):
    config = tiny_config(steps=1, algorithm={"num_generations": 4, "kl_coef": 0.5, "num_iterations": 2})
    trainer = Trainer(config)
    agent = trainer.team[0]
    generations, advantages = _one_rollout(trainer)
    optimizer, scheduler = _sgd(agent, 1.0)
    stats = update_agent(agent, generations, advantages, optimizer, scheduler, config.algorithm)
    # The first pass starts at the reference (KL 0); the second, after a step away from it, does not.
    assert stats["kl"] > 0


def test_micro_batches_cover_every_row_once_in_order():
    assert micro_batches(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert micro_batches(10, 0) == [(0, 10)]
    assert micro_batches(3, 5) == [(0, 3)]


def test_update_stats_average_over_optimiser_steps_and_weight_by_tokens():
    stats = UpdateStats(num_iterations=2)
    stats.add(1.0, {"clip_fraction": 0.5, "tokens": 2.0, "kl": 0.1})
    stats.add(3.0, {"clip_fraction": 0.0, "tokens": 6.0})  # no KL term: counts as 0
    stats.end_step(grad_norm=4.0)
    stats.add(2.0, {"clip_fraction": 1.0, "tokens": 4.0, "kl": 0.3})
    stats.end_step(grad_norm=2.0)
    result = stats.result()
    assert result["loss"] == pytest.approx((4.0 + 2.0) / 2)
    assert result["clip_fraction"] == pytest.approx((1.0 / 8 + 4.0 / 4) / 2)
    assert result["kl"] == pytest.approx((0.2 / 8 + 1.2 / 4) / 2)
    assert result["grad_norm"] == pytest.approx(3.0)
    assert result["tokens"] == 4.0  # trained in the last step
