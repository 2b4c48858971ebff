"""MADPO: the DPO loss by hand, a step's update against the multi-agent DPO objective written out, and learning."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from teamrl.algorithms.logprobs import completion_logprobs
from teamrl.algorithms.losses import update_loss
from teamrl.config import AlgorithmConfig, ConfigError, DPOConfig
from teamrl.rewards.base import RewardResult
from teamrl.rollout.tree import sample_tree
from teamrl.train import Trainer

MADPO = {"name": "madpo", "num_generations": 4}


def test_dpo_loss_value_and_gradient_on_two_rows_by_hand():
    # One pair: row 0 preferred, row 1 rejected. Row 0's last token is past its end (masked) and holds -inf.
    logprobs = torch.tensor([[-1.0, -0.5, -math.inf], [-2.0, -0.25, -0.25]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    offsets = torch.tensor([0.3, 0.3])  # the pair's margin terms that are constants of this agent's update
    config = AlgorithmConfig(name="madpo", dpo=DPOConfig(beta=0.5))
    loss, stats = update_loss("dpo").compute(logprobs, logprobs.detach(), offsets, mask, config=config, normalizer=1.0)
    # log pi(w) = -1.5, log pi(l) = -2.5: margin = -1.5 + 2.5 + 0.3 = 1.3;
    # loss = -log sigma(0.5 * 1.3) = log(1 + e^-0.65)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.65)), rel=1e-6)
    assert loss.item() == pytest.approx(0.420055, abs=1e-6)
    loss.backward()
    # d loss / d log pi(w) = -beta * sigma(-0.65) = -0.5 * 0.342990: descending it raises the preferred row's
    # tokens and lowers the rejected row's; the masked token gets exactly nothing (and no nan from its -inf).
    g = 0.5 / (1 + math.exp(0.65))
    assert g == pytest.approx(0.171495, abs=1e-6)
    assert logprobs.grad.tolist() == [pytest.approx([-g, -g, 0.0], rel=1e-6), pytest.approx([g, g, g], rel=1e-6)]
    assert stats == {"clip_fraction": 0.0, "tokens": 5.0}


def _sgd_backend(trainer: Trainer, lr: float) -> None:
    """The trainer's agents on plain SGD (a step is -lr * gradient), no gradient clipping."""
    backend = trainer.agents
    backend.config.optim.max_grad_norm = None
    backend.optimizers = [torch.optim.SGD(agent.parameters, lr=lr) for agent in trainer.team]
    backend.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for o in backend.optimizers]


def _sequence_logprobs(model, gen, temperature: float) -> torch.Tensor:
    logprobs = completion_logprobs(model, gen, temperature)
    return torch.where(gen.completion_mask.bool(), logprobs, torch.zeros_like(logprobs)).sum(dim=1)


def _returns_by_hand(tree, gamma: float = 1.0) -> list[torch.Tensor]:
    """Per turn, the (E, M) returns written out: R = r + gamma mean(R of the joint actions of the point it
    grew into)."""
    returns: list[torch.Tensor] = [torch.empty(0)] * len(tree.turns)
    for t in reversed(range(len(tree.turns))):
        returns[t] = tree.turns[t].rewards[..., 0].clone()
        if t + 1 < len(tree.turns):
            for point, flat in enumerate(tree.turns[t + 1].parents.tolist()):
                returns[t].view(-1)[flat] += gamma * returns[t + 1][point].mean()
    return returns


@pytest.mark.parametrize("training,fast_update,coupling,joint_mode,turns", [
    ("full", True, "joint", "aligned", 1), ("full", False, "joint", "aligned", 1),
    ("lora", True, "joint", "aligned", 1), ("lora", False, "joint", "aligned", 1),
    ("full", True, "independent", "aligned", 1), ("full", True, "joint", "cross", 1),
    ("full", False, "joint", "aligned", 2), ("lora", True, "joint", "cross", 2),
])
def test_a_step_is_gradient_descent_on_multi_agent_dpo(tiny_config, training, fast_update, coupling, joint_mode, turns):
    """Against L = mean_pairs -log sigma(beta * sum_i h_i) ('joint') or sum_i mean_pairs -log sigma(beta * h_i)
    ('independent'), h_i = log-ratio to the reference of agent i's preferred part minus its rejected part, the
    pairs being each group's best joint action against its worst, by return, at every turn."""
    num_samples = 4 if turns == 1 else 2  # two turns: a point per joint action, G^2 of them in cross
    team = {"training": training, **({"lora": {"r": 4}} if training == "lora" else {})}
    config = tiny_config(steps=1, items_per_step=2, team=team, optim={"fast_update": fast_update},
                         algorithm={**MADPO, "num_generations": num_samples, "joint_mode": joint_mode,
                                    "num_turns": turns, "dpo": {"beta": 0.5, "coupling": coupling}})
    trainer = Trainer(config)
    with torch.no_grad():  # away from the reference, so that every term of the margin counts
        for agent in trainer.team:
            for p in agent.parameters:
                p.add_(torch.randn_like(p) * (0.3 if training == "lora" else 0.02))
    tree = sample_tree(trainer.agents.sample, trainer.env, trainer.items[:2], config.algorithm, seed=5)
    # parts[m, i]: the sample agent i plays in joint action m; aligned its m-th, cross every pairing in order
    parts = (torch.arange(num_samples).unsqueeze(1).repeat(1, 2) if joint_mode == "aligned"
             else torch.tensor(list(itertools.product(range(num_samples), repeat=2))))
    turn_margins = []
    for turn, returns in zip(tree.turns, _returns_by_hand(tree)):
        groups = torch.arange(len(returns))
        best, worst = returns.argmax(dim=1), returns.argmin(dim=1)
        paired = returns[groups, best] > returns[groups, worst]  # a tied group carries no preference
        groups, best, worst = groups[paired], best[paired], worst[paired]
        margins = []
        for i, (agent, gen) in enumerate(zip(trainer.team, turn.generations)):
            won, lost = groups * num_samples + parts[best, i], groups * num_samples + parts[worst, i]
            agent.activate()
            agent.model.train()
            policy = _sequence_logprobs(agent.model, gen, agent.sampling.temperature)
            with torch.no_grad(), agent.reference() as reference:
                frozen = _sequence_logprobs(reference, gen, agent.sampling.temperature)
            agent.activate()
            agent.model.eval()
            ratio = policy - frozen
            margins.append(ratio[won] - ratio[lost])
        turn_margins.append(torch.stack(margins))
    assert all(m.shape[1] >= 1 for m in turn_margins), "every turn must give pairs"
    h = torch.cat(turn_margins, dim=1)
    for agent in trainer.team:  # activating an adapter stops the others' gradients; their graphs are built
        for p in agent.parameters:
            p.requires_grad_(True)
    team_margin = h.sum(dim=0) if coupling == "joint" else h
    objectives = ([-F.logsigmoid(0.5 * team_margin).mean()] * 2 if coupling == "joint"
                  else [-F.logsigmoid(0.5 * h_i).mean() for h_i in h])
    expected = [torch.autograd.grad(objective, agent.parameters, retain_graph=True)
                for objective, agent in zip(objectives, trainer.team)]
    before = [[p.detach().clone() for p in agent.parameters] for agent in trainer.team]

    lr = 0.01
    _sgd_backend(trainer, lr)
    metrics = trainer.algorithm.learn(tree, trainer.agents, [1, 2])
    assert metrics["preference/pairs"] == h.shape[1]
    assert metrics["dpo/loss"] == pytest.approx(-F.logsigmoid(0.5 * team_margin).mean().item(), rel=1e-4)
    for agent, start, grads, objective in zip(trainer.team, before, expected, objectives):
        for after, p0, grad in zip(agent.parameters, start, grads):
            torch.testing.assert_close(after - p0, -lr * grad, rtol=2e-3, atol=2e-7)
        assert metrics[f"{agent.name}/loss"] == pytest.approx(objective.item(), rel=1e-4)


def test_tied_groups_give_no_pairs_and_no_update(tiny_config, monkeypatch):
    trainer = Trainer(tiny_config(steps=1, algorithm=MADPO))
    monkeypatch.setattr(trainer.env, "joint_rewards", lambda requests: [RewardResult(0.5) for _ in requests])
    before = [p.detach().clone() for agent in trainer.team for p in agent.parameters]
    metrics = trainer.train_step()
    assert metrics["preference/pairs"] == 0 and metrics["loss"] == 0.0
    assert all(torch.equal(p, b) for p, b in zip((p for a in trainer.team for p in a.parameters), before))


@pytest.mark.parametrize("override,field", [
    ({"kl_coef": 0.1}, "algorithm.kl_coef"),
    ({"logprob_aggregation": "token_mean"}, "algorithm.logprob_aggregation"),
    ({"learners": "individual"}, "algorithm.learners"),
    ({"dpo": {"beta": 0.0}}, "algorithm.dpo.beta"),
    ({"preference": {"min_gap": -1.0}}, "algorithm.preference.min_gap"),
])
def test_config_refuses_what_madpo_cannot_do_naming_the_field(tiny_config, override, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config(algorithm={**MADPO, **override})


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_madpo_team_learns_digit_sum(tiny_config, train_and_evaluate, seed):
    # At most 60 steps, stopping once the training reward has converged (0.92, 0.07 above the threshold).
    before, after, _ = train_and_evaluate(tiny_config(seed=seed, steps=60, algorithm={"name": "madpo"}), stop_at=0.92)
    assert before < 0.3
    # Measured: 0.97, 0.97, 0.94 after 41, 45, 51 steps (seeds 0, 1, 2; after all 60 steps: 1.00, 1.00, 0.99);
    # MAGRPO's test asks for the same 0.85.
    assert after > 0.85, f"seed {seed}: held-out joint reward only went {before:.2f} -> {after:.2f}"
