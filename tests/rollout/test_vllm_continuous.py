"""A program task's calls sampled by vLLM engines (teamrl.rollout.vllm_continuous), against the strict stand-in of
conftest.py: calls from many episodes decode together and get exactly the tokens vLLM drew; stop strings end a
completion at the token that completed them; an update's weights reach the engine before the next call; a cancelled
call stops in the engine; and a program trains end to end through the gateway on the vLLM backend."""

from __future__ import annotations

import math
import time
from concurrent.futures import CancelledError

import pytest
import torch

from teamrl.config import SamplingConfig
from teamrl.rollout.continuous import TokenRequest
from teamrl.rollout.vllm_continuous import VLLMTokenEngine


@pytest.fixture
def engine(vllm_trainer, fake_vllm):
    """A started VLLMTokenEngine over a tiny LoRA team (two adapters on one base: one engine), and its trainer."""
    trainer = vllm_trainer(steps=2, team={"training": "lora", "lora": {"r": 4}},
                           rollout={"gpu_memory_utilization": 0.3})
    token_engine = trainer.agents.token_engine()
    assert isinstance(token_engine, VLLMTokenEngine)
    token_engine.start()
    yield token_engine, trainer
    token_engine.stop(timeout=30)
    trainer.close()


def _request(trainer, agent: int, seed: int, *, max_new_tokens: int = 6, stop=(), ignore_eos=False) -> TokenRequest:
    team = trainer.team
    ids = team[agent].tokenizer(team[agent].prompt("target 9"), add_special_tokens=False)["input_ids"]
    return TokenRequest(agent, tuple(ids), SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0), tuple(stop),
                        seed, ignore_eos)


def test_calls_from_many_episodes_decode_together_with_the_tokens_vllm_drew(engine, fake_vllm):
    token_engine, trainer = engine
    requests = [_request(trainer, agent, seed) for seed in range(4) for agent in (0, 1)]
    completions = [future.result(timeout=30) for future in [token_engine.submit(r) for r in requests]]

    (llm,) = fake_vllm
    assert llm.llm_engine.largest_batch > 1  # one engine step drew for several calls at once
    assert not llm.calls  # no generate call: every call went through the engine's own scheduling
    added = {request_id: (prompt, params, adapter) for request_id, prompt, params, adapter in llm.llm_engine.added}
    assert len(added) == len(requests)
    for request, completion, (prompt, params, adapter) in zip(requests, completions, added.values()):
        agent = trainer.team[request.agent]
        assert prompt == list(request.prompt_ids) == completion.prompt_ids
        assert adapter.lora_name.startswith(agent.name)  # each call on its own agent's adapter
        assert (params.n, params.seed, params.max_tokens, params.logprobs) == (1, request.seed, 6, 0)
        assert params.stop_token_ids == agent.eos_token_ids and not params.detokenize
        # what vLLM draws for this prompt, seed and adapter, as one generate call would have drawn it
        (whole,) = llm.generate([{"prompt_token_ids": prompt}], [params], use_tqdm=False, lora_request=[adapter])
        assert completion.completion_ids == whole.outputs[0].token_ids
        drawn = whole.outputs[0]
        assert completion.logprobs == [step[token].logprob for step, token in zip(drawn.logprobs, drawn.token_ids)]
        ended = completion.completion_ids[-1] in agent.eos_token_ids
        assert completion.finish_reason == ("stop" if ended else "length")
        assert completion.text == agent.tokenizer.decode(completion.completion_ids, skip_special_tokens=True).strip()


def test_a_stop_string_ends_the_completion_at_the_token_that_completed_it(engine, fake_vllm):
    token_engine, trainer = engine
    whole = token_engine.submit(_request(trainer, 0, 7, ignore_eos=True)).result(timeout=30)
    tokenizer = trainer.team[0].tokenizer
    stop = tokenizer.decode(whole.completion_ids[:2])
    assert len(whole.completion_ids) == 6 and whole.finish_reason == "length"

    cut = token_engine.submit(_request(trainer, 0, 7, stop=[stop], ignore_eos=True)).result(timeout=30)
    assert cut.completion_ids == whole.completion_ids[:len(cut.completion_ids)]
    assert stop in tokenizer.decode(cut.completion_ids) and stop not in tokenizer.decode(cut.completion_ids[:-1])
    assert cut.finish_reason == "stop" and stop not in cut.text
    (llm,) = fake_vllm
    assert llm.llm_engine.aborted == [llm.llm_engine.added[-1][0]]  # vLLM stops drawing for it at once
    assert llm.llm_engine.added[-1][2].ignore_eos and llm.llm_engine.added[-1][2].stop_token_ids == []


def test_weights_an_update_changed_reach_the_engine_before_the_next_call(engine, fake_vllm):
    token_engine, trainer = engine
    token_engine.submit(_request(trainer, 0, 1)).result(timeout=30)
    token_engine.submit(_request(trainer, 1, 1)).result(timeout=30)
    (llm,) = fake_vllm
    before = {adapter.lora_name for *_, adapter in llm.llm_engine.added}
    assert token_engine.wait_idle(timeout=30)
    with torch.no_grad():  # what an update does: every trained tensor written in place
        for parameter in trainer.team[0].parameters:
            parameter.add_(0.5)
    token_engine.submit(_request(trainer, 0, 1)).result(timeout=30)
    token_engine.submit(_request(trainer, 1, 1)).result(timeout=30)
    after = [adapter.lora_name for *_, adapter in llm.llm_engine.added[2:]]
    assert before == {"first-v1", "second-v2"} and after == ["first-v3", "second-v2"]  # only the changed one
    assert llm.events.count("reset_prefix_cache") == 2  # the first push, then the update's


def test_a_cancelled_call_stops_in_the_engine(engine, fake_vllm):
    token_engine, trainer = engine
    future = token_engine.submit(_request(trainer, 0, 3, max_new_tokens=2000, ignore_eos=True))
    deadline = time.monotonic() + 30
    while not (fake_vllm and fake_vllm[0].llm_engine.running) and time.monotonic() < deadline:  # in the engine
        time.sleep(0.001)
    (llm,) = fake_vllm
    token_engine.cancel(future)
    assert token_engine.wait_idle(timeout=30)
    with pytest.raises(CancelledError):
        future.result(timeout=1)
    assert llm.llm_engine.aborted == [llm.llm_engine.added[0][0]] and not llm.llm_engine.running


def test_a_program_trains_through_the_gateway_on_vllm_engines(vllm_trainer, fake_vllm, program_project, monkeypatch):
    pytest.importorskip("openai")
    config, module = program_project
    monkeypatch.syspath_prepend(str(config.parent))
    trainer = vllm_trainer(
        env={"name": "program", "kwargs": {"program": f"{module}:run", "data": str(config.parent / "items.jsonl"),
                                           "eval_split": 4, "words": ["good", "bad", "plan", "write"]}},
        team={"model": "tiny", "training": "lora", "lora": {"r": 4}, "sampling": {"max_new_tokens": 5},
              "agents": [{"name": "planner"}, {"name": "writer"}]},
        algorithm={"num_generations": 4}, optim={"lr": 0.02}, steps=2, items_per_step=1,
        rollout={"gpu_memory_utilization": 0.3})
    with trainer:
        assert isinstance(trainer.gateway.app.state.batcher.engine, VLLMTokenEngine)
        first = trainer.train_step()
        second = trainer.train_step()
    (llm,) = fake_vllm
    assert not llm.calls  # every call of every episode went through the engine's scheduling
    for metrics in (first, second):
        assert math.isfinite(metrics["loss"]) and metrics["episodes"] == 4
        assert metrics["planner/calls_per_episode"] == 1 and metrics["writer/calls_per_episode"] == 1
    names = [adapter.lora_name for *_, adapter in llm.llm_engine.added]
    assert len(names) == 2 * 4 * 2  # 2 calls x 4 episodes x 2 steps
    assert set(names[:8]) == {"planner-v1", "writer-v2"}  # step 1 on the starting adapters
    assert set(names[8:]) == {"planner-v3", "writer-v4"}  # step 2 on the ones step 1's update wrote
