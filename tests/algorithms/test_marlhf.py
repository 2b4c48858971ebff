"""MARLHF: the reward model's phases and training, its state across a checkpoint, and learning."""

from __future__ import annotations

import pytest
import torch

from teamrl.algorithms.marlhf import REWARD_MODEL, labels, paired
from teamrl.algorithms.preferences import bradley_terry_loss
from teamrl.config import ConfigError, RewardModelConfig
from teamrl.train import Trainer

MARLHF = {"name": "marlhf", "num_generations": 4, "preference": {"pairs": "all"},
          "reward_model": {"steps": 1, "lr": 1e-3}}


def test_labelled_steps_are_the_first_ones_then_every_refresh():
    refreshing = RewardModelConfig(steps=2, refresh_every=3)
    assert [step for step in range(10) if labels(step, refreshing)] == [0, 1, 4, 7]
    assert [step for step in range(10) if labels(step, RewardModelConfig(steps=2, refresh_every=0))] == [0, 1]
    assert all(labels(step, RewardModelConfig(steps=1, refresh_every=1)) for step in range(5))


def test_agents_wait_while_the_reward_model_learns_then_train_on_its_reward(tiny_config):
    trainer = Trainer(tiny_config(steps=2, items_per_step=2, algorithm=MARLHF))
    weights = lambda: [p.detach().clone() for agent in trainer.team for p in agent.parameters]  # noqa: E731
    reward_model = lambda: [p.detach().clone() for p in trainer.algorithm.reward_model.parameters()]  # noqa: E731
    agents_before, model_before = weights(), reward_model()
    first = trainer.train_step()
    assert first["reward_model/trained"] == 1.0 and first["reward_model/pairs"] > 0
    assert first["loss"] == 0.0 and all(torch.equal(a, b) for a, b in zip(weights(), agents_before))
    assert not all(torch.equal(a, b) for a, b in zip(reward_model(), model_before))
    model_before = reward_model()
    second = trainer.train_step()  # refresh_every 0: the reward model stays as it is from now on
    assert second["reward_model/trained"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(reward_model(), model_before))
    assert not all(torch.equal(a, b) for a, b in zip(weights(), agents_before))
    assert {"reward/mean", "return/mean", "reward_model/accuracy", "reward_model/score_mean"} <= set(second)



def test_paired_keeps_the_texts_some_pair_reads_and_reindexes_the_pairs():
    texts, sub = ["a", "b", "c", "d", "e"], (["a", "b", "d"], [2, 0], [1, 2])
    kept, preferred, rejected = paired(texts, torch.tensor([3, 0]), torch.tensor([1, 3]))
    assert (kept, preferred.tolist(), rejected.tolist()) == sub


def test_a_collecting_step_reads_only_the_texts_of_its_pairs(tiny_config):
    # The reward model's texts are every agent's observation and completion: scoring all G^n joint actions
    # of a step that only learns from its pairs cost TL;DR runs most of their step time.
    algorithm = {**MARLHF, "preference": {"pairs": "best_worst"}, "reward_model": {"steps": 2}}
    trainer = Trainer(tiny_config(steps=2, items_per_step=2, algorithm=algorithm))
    model, read = trainer.algorithm.reward_model, []
    forward = model.forward
    model.forward = lambda texts: (read.append(list(texts)), forward(texts))[1]
    metrics = trainer.train_step()
    pairs = int(metrics["reward_model/pairs"])
    assert pairs > 0 and read and metrics["reward_model/trained"] == 1.0
    assert max(len(texts) for texts in read) <= 2 * pairs < 2 * 4 * 4  # 2 items x G^2 joint actions

def test_the_reward_models_micro_batched_update_follows_the_whole_bradley_terry_gradient(tiny_config):
    trainer = Trainer(tiny_config(steps=1, optim={"micro_batch_size": 3, "max_grad_norm": None}, algorithm=MARLHF))
    algorithm = trainer.algorithm
    texts = [f"target 9 first\n{a}\ntarget 9 second\n{b}" for a, b in [("1 2", "8 7"), ("3", "3"), ("9 9", ""),
                                                                         ("4 5 6", "5 4 3"), ("0", "9")]]
    preferred, rejected = torch.tensor([0, 3, 4, 0]), torch.tensor([1, 2, 1, 2])
    parameters = list(algorithm.reward_model.parameters())
    scores = algorithm.reward_model(texts)
    expected = torch.autograd.grad(bradley_terry_loss(scores[preferred], scores[rejected]), parameters)
    algorithm.optimizer.step = lambda: None  # keep the gradient of the update, not its step
    algorithm.train_reward_model(texts, preferred, rejected)
    for param, grad in zip(parameters, expected):
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-7)


def test_the_reward_model_survives_checkpoint_and_resume(tiny_config):
    reward_model = {"steps": 2, "refresh_every": 1, "lr": 1e-3}
    config = tiny_config(steps=3, items_per_step=2, algorithm={**MARLHF, "reward_model": reward_model})
    with Trainer(config) as trainer:
        trainer.train_step()
        trainer.train_step()
        checkpoint = trainer.save()
        saved = {k: v.clone() for k, v in trainer.algorithm.reward_model.state_dict().items()}
        third = trainer.train_step()
        after = trainer.algorithm.reward_model.state_dict()
    assert (checkpoint / f"{REWARD_MODEL}.safetensors").is_file()
    with Trainer(config, resume=True) as resumed:
        assert resumed.step == 2 and resumed.algorithm.step == 2
        for name, value in resumed.algorithm.reward_model.state_dict().items():
            assert torch.equal(value, saved[name]), name
        assert resumed.algorithm.optimizer.state_dict()["state"]  # AdamW's moments came back too
        again = resumed.train_step()
    # Step 3 trains the reward model (AdamW's moments included) and the agents on its scores: the same numbers.
    assert again["reward_model/accuracy"] == third["reward_model/accuracy"]
    assert again["reward_model/score_mean"] == pytest.approx(third["reward_model/score_mean"], rel=1e-6)
    assert again["loss"] == pytest.approx(third["loss"], rel=1e-5, abs=1e-7)
    assert all(torch.equal(resumed.algorithm.reward_model.state_dict()[k], v) for k, v in after.items())


def test_config_refuses_what_marlhf_cannot_do_naming_the_field(tiny_config):
    with pytest.raises(ConfigError, match="algorithm.reward_model.steps"):
        tiny_config(algorithm={**MARLHF, "reward_model": {"steps": 0}})
    with pytest.raises(ConfigError, match="algorithm.learners"):
        tiny_config(algorithm={**MARLHF, "learners": "individual"})
    with pytest.raises(ConfigError, match="algorithm.reward_model.model"):
        tiny_config(algorithm={**MARLHF, "reward_model": {"model": "/no/such/model"}})


def test_an_agent_named_like_the_reward_model_is_refused(tiny_config):
    with pytest.raises(ValueError, match="reward_model"):
        Trainer(tiny_config(steps=1, algorithm=MARLHF, team={"agents": [{"name": "reward_model"}, {"name": "b"}]}))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_marlhf_team_learns_digit_sum_from_learned_rewards(tiny_config, train_and_evaluate, seed):
    # 10 steps of preferences from the untrained team, then up to 60 of MAGRPO on the learned reward, whose
    # preferences are refreshed every second step, until the training reward has converged (0.92, 0.07
    # above the held-out threshold).
    algorithm = {"name": "marlhf", "preference": {"pairs": "all"},
                 "reward_model": {"steps": 10, "refresh_every": 2, "lr": 1e-3}}
    before, after, history = train_and_evaluate(tiny_config(seed=seed, steps=70, algorithm=algorithm), stop_at=0.92)
    assert before < 0.3
    # Measured: 0.19 -> 0.97, 0.12 -> 0.96, 0.14 -> 0.95 after 44, 46, 49 steps (seeds 0, 1, 2; all 70 steps:
    # 1.00 each); MAGRPO's test asks for the same 0.85.
    assert after > 0.85, f"seed {seed}: held-out joint reward only went {before:.2f} -> {after:.2f}"
    # The reward model ranks the untrained team's fresh pairs better than chance after its first steps
    # (measured over steps 6-10: 0.73, 0.74, 0.72; over steps 1-5: 0.60, 0.57, 0.54).
    assert sum(h["reward_model/accuracy"] for h in history[5:10]) / 5 > 0.6
