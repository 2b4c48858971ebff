"""The fast update (teamrl.algorithms.fast_update): micro-batches and threads, agents pooled on one base,
and the same update as the plain one in magrpo.py."""

from __future__ import annotations

import functools

import pytest
import torch

from teamrl.algorithms import fast_update, magrpo
from teamrl.backends.local import train_agents
from teamrl.rollout.generate import sample_team
from teamrl.rollout.tree import sample_tree
from teamrl.train import Trainer


@pytest.mark.parametrize("training", ["full", "lora"])
def test_micro_batches_accumulate_to_the_same_gradient_as_one_batch(tiny_config, monkeypatch, training):
    config = tiny_config(steps=1, algorithm={"logprob_aggregation": "sequence_mean"},
                         team={"training": training, "lora": {"r": 4}})
    trainer = Trainer(config)
    with torch.no_grad():  # LoRA's B starts at zero, which would leave A without a gradient to compare
        for param in trainer.team[0].parameters:
            param.add_(torch.randn_like(param) * 0.05)
    tree = sample_tree(functools.partial(sample_team, trainer.team), trainer.env, trainer.items[:4], config.algorithm)
    advantages, _ = magrpo.advantages(tree, len(trainer.team), config.algorithm)
    agent = trainer.team[0]
    threads_used = []
    in_threads = fast_update._in_threads
    monkeypatch.setattr(fast_update, "_in_threads",
                        lambda fn, items, threads: threads_used.append(threads) or in_threads(fn, items, threads))

    def gradients(micro: int, parallel: int) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(agent.parameters, lr=0.0)  # keep the weights: compare gradients only
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        fast_update.update_agent(agent, [t.generations[0] for t in tree.turns], advantages[0], optimizer, scheduler,
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


def _two_identical_lora_teams(config) -> tuple[Trainer, Trainer]:
    """Two trainers whose LoRA teams hold the same weights, every one non-zero (LoRA's B starts at zero,
    which would leave A without a gradient to compare)."""
    trainers = []
    for _ in range(2):
        trainer = Trainer(config)
        trainer.close()  # one run directory for both: neither trains through it
        trainers.append(trainer)
        torch.manual_seed(0)
        with torch.no_grad():
            for agent in trainer.team:
                for param in agent.parameters:
                    param.add_(torch.randn_like(param) * 0.05)
    return trainers[0], trainers[1]


def test_agents_on_one_base_pool_their_micro_batches_with_each_agents_own_update(tiny_config):
    config = tiny_config(steps=1, items_per_step=1, team={"training": "lora", "lora": {"r": 4}},
                         algorithm={"num_generations": 2, "num_turns": 2}, optim={"micro_batch_size": 2})
    pooled, alone = _two_identical_lora_teams(config)
    team = list(pooled.team)
    assert team[0].model is team[1].model and fast_update.update_pools(team, 2) == [[0, 1]]
    tree = sample_tree(functools.partial(sample_team, pooled.team), pooled.env, pooled.items[:1], config.algorithm)
    advantages, _ = magrpo.advantages(tree, 2, config.algorithm)
    generations = [[t.generations[i] for t in tree.turns] for i in range(2)]
    assert [len(g) for g in generations] == [2, 2]  # 1 + 2 micro-batches per agent: an odd count for 2 threads
    threads_used = []
    in_threads = fast_update._in_threads

    def counting(fn, items, threads):
        threads_used.append((len(items), threads))
        return in_threads(fn, items, threads)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_update, "_in_threads", counting)
        together = train_agents(team, generations, advantages, pooled.agents.optimizers, pooled.agents.schedulers,
                                config, [1, 2])
        one_by_one = [fast_update.update_agent(agent, generations[k], advantages[k], alone.agents.optimizers[k],
                                          alone.agents.schedulers[k], config.algorithm, micro_batch_size=2,
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


@pytest.mark.parametrize("kl_coef,num_iterations", [(0.0, 1), (0.1, 2)])
def test_the_fast_update_computes_the_plain_update(tiny_config, monkeypatch, kl_coef, num_iterations):
    """Everything the fast update does for speed at once (both agents' micro-batches pooled on two threads,
    the shared prompt opening run once, the fused adapters, the chosen-token log-prob function) against
    magrpo.update_agent, paper Eq. 2 as it reads (PEFT's forward over each whole prompt + completion and a
    log-softmax, one micro-batch after the other): the same weights after the step and the same stats."""
    from teamrl.models import stem as stem_module

    monkeypatch.setattr(stem_module, "MIN_STEM_TOKENS", 2)  # the tiny task's prompts share a short opening
    stems = []
    stem_of = fast_update.prompt_stem
    monkeypatch.setattr(fast_update, "prompt_stem", lambda *args: stems.append(stem_of(*args)) or stems[-1])
    config = tiny_config(steps=1, items_per_step=2, team={"training": "lora", "lora": {"r": 4}},
                         algorithm={"num_generations": 2, "num_turns": 2, "kl_coef": kl_coef,
                                    "num_iterations": num_iterations})
    fast, plain = _two_identical_lora_teams(config)
    before = [p.detach().clone() for p in plain.team[0].parameters]
    tree = sample_tree(functools.partial(sample_team, fast.team), fast.env, fast.items[:2], config.algorithm)
    advantages, _ = magrpo.advantages(tree, 2, config.algorithm)
    generations = [[t.generations[i] for t in tree.turns] for i in range(2)]
    assert fast_update.update_pools(list(fast.team), config.optim.parallel_micro_batches) == [[0, 1]]
    # SGD: a step proportional to the gradient (Adam's first steps are about lr * sign(gradient), which
    # turns float rounding on a near-zero gradient into a full-size difference).
    optimizers = {id(t): [torch.optim.SGD(agent.parameters, lr=0.5) for agent in t.team] for t in (fast, plain)}
    schedulers = {key: [torch.optim.lr_scheduler.LambdaLR(o, lambda _: 1.0) for o in opts]
                  for key, opts in optimizers.items()}
    fast_stats = train_agents(list(fast.team), generations, advantages, optimizers[id(fast)],
                              schedulers[id(fast)], config, [1, 2])
    assert len(stems) == 2 * num_iterations and all(stem is not None for stem in stems)
    config.optim.fast_update = False
    plain_stats = train_agents(list(plain.team), generations, advantages, optimizers[id(plain)],
                               schedulers[id(plain)], config, [1, 2])
    for k in range(2):
        assert fast_stats[k]["tokens"] == plain_stats[k]["tokens"] > 0
        for key in ("loss", "clip_fraction", "kl", "grad_norm", "lr"):
            assert fast_stats[k][key] == pytest.approx(plain_stats[k][key], rel=1e-4, abs=1e-6), key
        for mine, theirs in zip(fast.team[k].parameters, plain.team[k].parameters):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    assert all(not torch.equal(after, start) for after, start in zip(plain.team[0].parameters, before))
    assert (plain_stats[0]["kl"] > 0) == bool(kl_coef)


def test_only_lora_agents_on_one_base_with_threads_pool(tiny_config):
    lora = Trainer(tiny_config(steps=1, team={"training": "lora", "lora": {"r": 4}}))
    assert fast_update.update_pools(list(lora.team), 2) == [[0, 1]]
    assert fast_update.update_pools(list(lora.team), 1) == [[0], [1]]  # one at a time: a pool gains nothing
    full = Trainer(tiny_config(steps=1))
    assert fast_update.update_pools(list(full.team), 2) == [[0], [1]]  # a model each
    with pytest.raises(ValueError, match="plain LoRA adapters of one shared model"):
        fast_update.update_agents(list(full.team), [[], []], [[], []], full.agents.optimizers, full.agents.schedulers,
                             full.config.algorithm)


def test_micro_batches_run_one_at_a_time_where_threads_would_change_the_result_or_hold_copies():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
    adapter = [model[2].weight]  # 16 of 289 weights train, as with LoRA
    assert fast_update._parallel_micro_batches(model, adapter, 2, num_batches=5) == 1  # dropout: one generator
    model[1].p = 0.0
    assert fast_update._parallel_micro_batches(model, adapter, 2, num_batches=5) == 2
    assert fast_update._parallel_micro_batches(model, adapter, 4, num_batches=3) == 3
    assert fast_update._parallel_micro_batches(model, adapter, 2, num_batches=1) == 1
    assert fast_update._parallel_micro_batches(model, list(model.parameters()), 2, num_batches=5) == 1  # full


def test_threaded_micro_batches_come_back_in_order_and_raise_where_they_failed():
    results = list(fast_update._in_threads(lambda x: (x, torch.get_num_threads()), range(6), threads=2))
    assert results == [(x, 1) for x in range(6)]  # each thread has one of the two torch threads
    assert torch.get_num_threads() == 2

    def fail_on_three(x: int) -> int:
        if x == 3:
            raise ValueError("micro-batch 3")
        return x

    seen = []
    with pytest.raises(ValueError, match="micro-batch 3"):
        seen.extend(fast_update._in_threads(fail_on_three, range(6), threads=2))
    assert seen == [0, 1, 2]
    assert torch.get_num_threads() == 2
