"""Training options: gradient accumulation, schedules, data order, cross mode, early termination,
independent learners."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from teamrl.algorithms import magrpo
from teamrl.train import Trainer, batch_indices, make_scheduler, train_agents


@pytest.mark.parametrize("training", ["full", "lora"])
def test_micro_batches_accumulate_to_the_same_gradient_as_one_batch(tiny_config, monkeypatch, training):
    config = tiny_config(steps=1, algorithm={"logprob_aggregation": "sequence_mean"}, team={"training": training, "lora": {"r": 4}})
    trainer = Trainer(config)
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A without a gradient to compare
        for param in trainer.team[0].parameters:
            param.add_(torch.randn_like(param) * 0.05)
    tree = magrpo.rollout(magrpo.team_sampler(trainer.team), trainer.env, trainer.items[:4], config.algorithm)
    advantages, _ = magrpo.advantages(tree, len(trainer.team), config.algorithm)
    agent = trainer.team[0]
    threads_used = []
    in_threads = magrpo._in_threads
    monkeypatch.setattr(magrpo, "_in_threads",
                        lambda fn, items, threads: threads_used.append(threads) or in_threads(fn, items, threads))

    def gradients(micro: int, parallel: int) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(agent.parameters, lr=0.0)  # keep the weights: compare gradients only
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        magrpo.update_agent(agent, [t.generations[0] for t in tree.turns], advantages[0], optimizer, scheduler,
                            config.algorithm, micro_batch_size=micro, parallel_micro_batches=parallel)
        assert torch.get_num_threads() == 2  # the threads' share of torch's threads is given back
        return [p.grad.clone() for p in agent.parameters]

    whole = gradients(0, 1)
    accumulated, in_parallel, again = gradients(3, 1), gradients(3, 2), gradients(3, 2)
    # Full fine-tuning runs one at a time: each thread's gradient would be another copy of the model.
    assert threads_used == ([1, 1, 2, 2] if training == "lora" else [1, 1, 1, 1])
    assert any(g.abs().sum() > 0 for g in whole)
    for full, one_at_a_time, parallel, repeat in zip(whole, accumulated, in_parallel, again):
        torch.testing.assert_close(full, one_at_a_time, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(full, parallel, rtol=1e-4, atol=1e-7)
        assert torch.equal(parallel, repeat)  # summed in micro-batch order, whichever thread ends first
        assert parallel.stride() == repeat.stride() == one_at_a_time.stride()


def test_agents_on_one_base_pool_their_micro_batches_with_each_agents_own_update(tiny_config):
    config = tiny_config(steps=1, items_per_step=1, team={"training": "lora", "lora": {"r": 4}},
                         algorithm={"num_generations": 2, "num_turns": 2}, optim={"micro_batch_size": 2})
    trainers = [Trainer(config), Trainer(config)]
    for trainer in trainers:
        torch.manual_seed(0)
        with torch.no_grad():  # LoRA's B starts at zero: give every weight a gradient to compare
            for agent in trainer.team:
                for param in agent.parameters:
                    param.add_(torch.randn_like(param) * 0.05)
    pooled, alone = trainers
    team = list(pooled.team)
    assert team[0].model is team[1].model and magrpo.update_pools(team, 2) == [[0, 1]]
    tree = magrpo.rollout(magrpo.team_sampler(pooled.team), pooled.env, pooled.items[:1], config.algorithm)
    advantages, _ = magrpo.advantages(tree, 2, config.algorithm)
    generations = [[t.generations[i] for t in tree.turns] for i in range(2)]
    assert [len(g) for g in generations] == [2, 2]  # 1 + 2 micro-batches per agent: an odd count for 2 threads
    threads_used = []
    in_threads = magrpo._in_threads

    def counting(fn, items, threads):
        threads_used.append((len(items), threads))
        return in_threads(fn, items, threads)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(magrpo, "_in_threads", counting)
        together = train_agents(team, generations, advantages, pooled.optimizers, pooled.schedulers, config, [1, 2])
        one_by_one = [magrpo.update_agent(agent, generations[k], advantages[k], alone.optimizers[k],
                                          alone.schedulers[k], config.algorithm, micro_batch_size=2,
                                          max_grad_norm=config.optim.max_grad_norm, parallel_micro_batches=2)
                      for k, agent in enumerate(alone.team)]
    assert threads_used == [(6, 2), (3, 2), (3, 2)]
    for k in range(2):
        assert together[k]["tokens"] == one_by_one[k]["tokens"] > 0
        assert together[k]["loss"] == pytest.approx(one_by_one[k]["loss"], abs=0, rel=0)
        for mine, theirs in zip(pooled.team[k].parameters, alone.team[k].parameters):
            assert torch.equal(mine, theirs)  # each agent's adapter trained on its own micro-batches only
    assert pooled.team[0].parameters[0].grad is not None and not pooled.team[0].parameters[0].requires_grad
    assert pooled.team[1].parameters[0].requires_grad  # as after one-by-one updates: the last agent active


def test_the_fast_update_gives_the_gradients_of_the_plain_loss(tiny_config, monkeypatch):
    """Everything the update does for speed at once (both agents' micro-batches pooled on two threads, the
    shared prompt opening run once, the fused adapters, the chosen-token log-prob function) against paper
    Eq. 2's loss computed plainly: PEFT's forward over each whole prompt + completion and a log-softmax."""
    from teamrl.algorithms.losses import loss_normalizer, policy_loss
    from teamrl.models import stem as stem_module

    monkeypatch.setattr(stem_module, "MIN_STEM_TOKENS", 2)  # the tiny task's prompts share a short opening
    stems = []
    stem_of = magrpo.prompt_stem
    monkeypatch.setattr(magrpo, "prompt_stem", lambda *args: stems.append(stem_of(*args)) or stems[-1])
    config = tiny_config(steps=1, items_per_step=2, team={"training": "lora", "lora": {"r": 4}},
                         algorithm={"num_generations": 2, "num_turns": 2})
    trainer = Trainer(config)
    team = list(trainer.team)
    torch.manual_seed(0)
    with torch.no_grad():  # LoRA's B starts at zero: give every weight a gradient to compare
        for agent in team:
            for param in agent.parameters:
                param.add_(torch.randn_like(param) * 0.05)
    tree = magrpo.rollout(magrpo.team_sampler(trainer.team), trainer.env, trainer.items[:2], config.algorithm)
    advantages, _ = magrpo.advantages(tree, 2, config.algorithm)
    generations = [[t.generations[i] for t in tree.turns] for i in range(2)]
    optimizers = [torch.optim.SGD(agent.parameters, lr=0.0) for agent in team]  # compare gradients only
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0) for optimizer in optimizers]
    assert magrpo.update_pools(team, config.optim.parallel_micro_batches) == [[0, 1]]
    train_agents(team, generations, advantages, optimizers, schedulers, config, [1, 2])
    assert len(stems) == 2 and all(stem is not None for stem in stems)
    fast = [[p.grad.clone() for p in agent.parameters] for agent in team]

    model = team[0].model
    model.train()
    for k, agent in enumerate(team):
        agent.activate()
        for param in agent.parameters:
            param.grad = None
        normalizer = loss_normalizer([g.completion_mask for g in generations[k]], config.algorithm.logprob_aggregation)
        for gen, adv in zip(generations[k], advantages[k]):
            ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
            mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
            scored = logits[:, gen.prompt_ids.shape[1] - 1:-1] / agent.sampling.temperature
            logprobs = torch.log_softmax(scored, -1).gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1)
            logprobs = logprobs * gen.completion_mask
            loss, _ = policy_loss(logprobs, logprobs.detach(), adv, gen.completion_mask,
                                  aggregation=config.algorithm.logprob_aggregation, normalizer=normalizer,
                                  epsilon_low=config.algorithm.epsilon_low, epsilon_high=config.algorithm.epsilon_high,
                                  ref_logprobs=None, kl_coef=0.0)
            loss.backward()
        assert any(p.grad.abs().sum() > 0 for p in agent.parameters)
        for mine, plain in zip(fast[k], (p.grad for p in agent.parameters)):
            torch.testing.assert_close(mine, plain, rtol=1e-4, atol=1e-6)
    model.eval()


def test_only_lora_agents_on_one_base_with_threads_pool(tiny_config):
    lora = Trainer(tiny_config(steps=1, team={"training": "lora", "lora": {"r": 4}}))
    assert magrpo.update_pools(list(lora.team), 2) == [[0, 1]]
    assert magrpo.update_pools(list(lora.team), 1) == [[0], [1]]  # one at a time: a pool gains nothing
    full = Trainer(tiny_config(steps=1))
    assert magrpo.update_pools(list(full.team), 2) == [[0], [1]]  # a model each
    with pytest.raises(ValueError, match="plain LoRA adapters of one shared model"):
        magrpo.update_agents(list(full.team), [[], []], [[], []], full.optimizers, full.schedulers,
                             full.config.algorithm)


def test_micro_batches_run_one_at_a_time_where_threads_would_change_the_result_or_hold_copies():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    adapter = [model[2].weight]  # 16 of 289 weights train, as with LoRA
    assert magrpo._parallel_micro_batches(model, adapter, 2, num_batches=5) == 1  # dropout: one generator
    model[1].p = 0.0
    assert magrpo._parallel_micro_batches(model, adapter, 2, num_batches=5) == 2
    assert magrpo._parallel_micro_batches(model, adapter, 4, num_batches=3) == 3
    assert magrpo._parallel_micro_batches(model, adapter, 2, num_batches=1) == 1
    assert magrpo._parallel_micro_batches(model, list(model.parameters()), 2, num_batches=5) == 1  # full


def test_threaded_micro_batches_come_back_in_order_and_raise_where_they_failed():
    results = list(magrpo._in_threads(lambda x: (x, torch.get_num_threads()), range(6), threads=2))
    assert results == [(x, 1) for x in range(6)]  # each thread has one of the two torch threads
    assert torch.get_num_threads() == 2

    def fail_on_three(x: int) -> int:
        if x == 3:
            raise ValueError("micro-batch 3")
        return x

    seen = []
    with pytest.raises(ValueError, match="micro-batch 3"):
        seen.extend(magrpo._in_threads(fail_on_three, range(6), threads=2))
    assert seen == [0, 1, 2]
    assert torch.get_num_threads() == 2


def test_warmup_then_decay_schedules():
    param = torch.nn.Parameter(torch.zeros(1))
    for kind, expected in [
        ("constant", [1 / 3, 2 / 3, 1.0, 1.0, 1.0]),
        ("linear", [1 / 3, 2 / 3, 1.0, 2 / 3, 1 / 3]),
        ("cosine", [1 / 3, 2 / 3, 1.0, 0.75, 0.25]),
    ]:
        optimizer = torch.optim.SGD([param], lr=1.0)
        scheduler = make_scheduler(optimizer, kind, warmup=2, total=5)
        seen = []
        for _ in range(5):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        assert seen == pytest.approx(expected), kind


def test_batches_cover_every_item_once_per_epoch_and_depend_only_on_the_step():
    epoch = [i for step in range(5) for i in batch_indices(10, 2, step, seed=3)]
    assert sorted(epoch) == list(range(10))
    assert batch_indices(10, 2, 7, seed=3) == batch_indices(10, 2, 7, seed=3)
    assert epoch != [i for step in range(5) for i in batch_indices(10, 2, step, seed=4)]


def test_cross_mode_scores_every_combination(tiny_config):
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, algorithm={"num_generations": 3, "joint_mode": "cross"}))
    metrics = trainer.train_step()
    assert metrics["turn1/joint_actions"] == 2 * 3 ** 2
    assert metrics["first/tokens"] == 2 * 3 * 4  # each agent still trains on its own G completions per item


def test_early_termination_stops_expanding_solved_joint_actions(tiny_config):
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, algorithm={
        "num_generations": 2, "num_turns": 2, "early_termination_threshold": 0.0}))
    metrics = trainer.train_step()
    # Every reward is >= 0, so every turn-1 joint action is "solved" and nothing reaches turn 2.
    assert "reward/turn2/mean" not in metrics
    trainer = Trainer(tiny_config(steps=1, items_per_step=2, algorithm={"num_generations": 2, "num_turns": 2}))
    assert trainer.train_step()["turn2/joint_actions"] == 2 * 2 * 2


@pytest.mark.slow
def test_joint_reward_beats_individual_rewards(tiny_config):
    """The paper's central claim on the built-in game: per-agent rewards that each agent can max out
    alone (write digits that could reach the target) never teach the agents to complement each other."""
    exact = {}
    for learners in ("joint", "individual"):
        trainer = Trainer(tiny_config(steps=50, algorithm={"learners": learners}))
        for _ in range(trainer.config.steps):
            trainer.train_step()
        # Fraction of digit pairs that sum exactly to the target: only complementing the partner does it.
        exact[learners] = trainer.evaluate(num_samples=4)["count/hits"] / trainer.env.length
    assert exact["joint"] > 0.9, exact
    assert exact["individual"] < 0.5, exact


def test_optional_loggers_fail_early_with_the_package_to_install(tiny_config, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ValueError, match=r"logging.tensorboard: needs the 'tensorboard' package"):
        Trainer(tiny_config(logging={"tensorboard": True}))


def test_memory_metrics_follow_what_the_process_holds():
    # In a fresh process: in this one, memory that earlier tests freed can still be resident in the heap
    # and serve the allocation without the RSS growing at all (seen once in CI).
    code = (
        "import json, torch\n"
        "from teamrl.train import memory_metrics\n"
        "before = memory_metrics()\n"
        "held = torch.ones(64 * 2**20, dtype=torch.float32)  # 268 MB, touched\n"
        "print(json.dumps([before, memory_metrics()]))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    before, during = json.loads(result.stdout.strip().splitlines()[-1])
    assert during["memory/rss_gb"] - before["memory/rss_gb"] > 0.25
    # the kernel updates the high-water mark lazily: it may trail the current RSS by a few pages
    assert during["memory/peak_rss_gb"] > before["memory/rss_gb"] + 0.2


def test_evaluation_in_item_batches_scores_every_item_and_is_reproducible(tiny_config):
    trainer = Trainer(tiny_config())
    whole, whole_samples = trainer.evaluate_with_samples(num_samples=2, max_items=5, items_per_batch=5)
    chunked, chunked_samples = trainer.evaluate_with_samples(num_samples=2, max_items=5, items_per_batch=2)
    # every item scored num_samples times, in item order, whatever the batching
    assert [s["item"] for s in chunked_samples] == [s["item"] for s in whole_samples]
    assert len(chunked_samples) == 10
    assert trainer.evaluate_with_samples(num_samples=2, max_items=5, items_per_batch=2)[0] == chunked
    with pytest.raises(ValueError, match="items_per_batch"):
        trainer.evaluate(items_per_batch=0)
