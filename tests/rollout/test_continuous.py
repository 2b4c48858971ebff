"""The continuous batcher: exact tokens and log-probs per request, each row through its own adapter, requests joining
mid-decode and leaving when they end, seeds, stop strings, cancellation."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.rollout.continuous import ContinuousBatcher, TokenRequest
from teamrl.rollout.generate import encode_prompts

OBSERVATIONS = ["3 4 5 6", "1 2", "7 8 9 1 2 3 4 5", "6"]


@pytest.fixture
def batcher(lora_team):
    """A started batcher over a tiny two-agent LoRA team whose adapters differ (stopped after the test)."""
    team = lora_team()
    running = ContinuousBatcher(team, max_rows=8)
    running.start()
    yield running
    running.stop(10)


def _request(batcher, agent: int, observation: str, **fields) -> TokenRequest:
    member = batcher.team[agent]
    sampling = dataclasses.replace(member.sampling, **fields.pop("sampling", {}))
    return TokenRequest(agent, tuple(batcher.encode(member, member.prompt(observation))), sampling, **fields)


def test_each_completion_carries_the_log_probs_training_recomputes_under_its_own_adapter(batcher):
    # Rows of two adapters, prompts of four lengths, some arriving while others decode: a row run through the
    # wrong adapter, at the wrong positions or against another row's keys would record other log-probs.
    futures = []
    for i in range(8):
        futures.append(batcher.submit(_request(batcher, i % 2, OBSERVATIONS[i % 4], seed=i)))
        if i == 3:
            time.sleep(0.02)
    completions = [future.result(60) for future in futures]
    for completion in completions:
        agent = batcher.team[completion.agent]
        agent.activate()
        prompt, tokens = torch.tensor([completion.prompt_ids]), torch.tensor([completion.completion_ids])
        with torch.no_grad():
            recomputed = token_logprobs(agent.model, prompt, torch.ones_like(prompt), tokens, torch.ones_like(tokens),
                                        temperature=agent.sampling.temperature)[0]
        torch.testing.assert_close(recomputed, torch.tensor(completion.logprobs), atol=1e-4, rtol=0)
    # The prompt is the one training encodes for the agent's observation, token for token.
    first = batcher.team[0]
    ids, mask = encode_prompts(first, [first.prompt(OBSERVATIONS[0])])
    assert completions[0].prompt_ids == ids[0][mask[0].bool()].tolist()


def test_a_request_arriving_mid_decode_joins_at_once_and_leaves_before_a_longer_one(batcher):
    long = batcher.submit(_request(batcher, 0, "3 4", sampling={"max_new_tokens": 40}, ignore_eos=True, seed=1))
    deadline = time.monotonic() + 30
    while batcher.steps < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    short = batcher.submit(_request(batcher, 1, "5 6", sampling={"max_new_tokens": 3}, ignore_eos=True, seed=2))
    assert len(short.result(30).completion_ids) == 3
    # Window batching would have run the short request after the long one's 40 steps; here it joined.
    assert not long.done()
    assert len(long.result(30).completion_ids) == 40


def test_a_seed_draws_the_same_tokens_alone_or_among_other_requests(batcher):
    request = _request(batcher, 1, OBSERVATIONS[2], seed=7)
    alone = batcher.submit(request).result(30)
    crowd = [batcher.submit(_request(batcher, i % 2, OBSERVATIONS[i % 4], seed=100 + i)) for i in range(5)]
    again = batcher.submit(request)
    assert again.result(30).completion_ids == alone.completion_ids
    for future in crowd:
        future.result(30)


def test_a_stop_string_ends_the_completion_and_is_cut_from_its_text(batcher):
    free = batcher.submit(_request(batcher, 0, "3 4", sampling={"max_new_tokens": 12}, ignore_eos=True, seed=3))
    words = free.result(30).text.split()
    stop = words[2]
    cut = batcher.submit(_request(batcher, 0, "3 4", sampling={"max_new_tokens": 12}, ignore_eos=True, seed=3,
                                  stop=(stop,))).result(30)
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and cut.text.strip() == free.result().text[:free.result().text.find(stop)].strip()
    assert len(cut.completion_ids) < 12


def test_a_cancelled_request_stops_decoding_and_the_rest_go_on(batcher):
    keep = batcher.submit(_request(batcher, 0, "3 4", sampling={"max_new_tokens": 30}, ignore_eos=True, seed=4))
    drop = batcher.submit(_request(batcher, 1, "3 4", sampling={"max_new_tokens": 30}, ignore_eos=True, seed=5))
    batcher.cancel(drop)
    assert len(keep.result(30).completion_ids) == 30
    assert drop.cancelled() or isinstance(drop.exception(30), BaseException)
    assert batcher.wait_idle(10)


def test_a_prompt_opening_as_an_earlier_one_runs_only_its_rest_with_the_same_log_probs(batcher):
    opening = " ".join(["3 4 5 6 7"] * 6)  # 30 words: far more than the shortest opening reused
    first = batcher.submit(_request(batcher, 1, opening + " 1 2", seed=1)).result(30)
    ran = batcher.prefilled_tokens
    # Later (no longer in one step with the first): the opening is not run again, only what follows it.
    later = [batcher.submit(_request(batcher, 1, opening + ending, seed=2)) for ending in (" 1 2", " 8 9 9")]
    second, third = (future.result(30) for future in later)
    assert batcher.prefilled_tokens - ran <= 2 + 3 + 2  # the last token of the repeat, the new ending's three
    agent = batcher.team[1]
    agent.activate()
    for completion in (first, second, third):
        prompt, tokens = torch.tensor([completion.prompt_ids]), torch.tensor([completion.completion_ids])
        with torch.no_grad():
            recomputed = token_logprobs(agent.model, prompt, torch.ones_like(prompt), tokens, torch.ones_like(tokens),
                                        temperature=agent.sampling.temperature)[0]
        torch.testing.assert_close(recomputed, torch.tensor(completion.logprobs), atol=1e-4, rtol=0)


def test_prompts_prefilled_before_the_weights_changed_are_run_again(batcher):
    prompt = _request(batcher, 0, " ".join(["3 4 5 6 7"] * 6), seed=1)
    batcher.submit(prompt).result(30)
    assert batcher.wait_idle(10)
    agent = batcher.team[0]
    with torch.no_grad():
        for parameter in agent.parameters:
            parameter.add_(0.5)  # an optimiser step, in place
    ran = batcher.prefilled_tokens
    again = batcher.submit(prompt).result(30)
    assert batcher.prefilled_tokens - ran == len(prompt.prompt_ids)
    agent.activate()
    ids, tokens = torch.tensor([again.prompt_ids]), torch.tensor([again.completion_ids])
    with torch.no_grad():
        recomputed = token_logprobs(agent.model, ids, torch.ones_like(ids), tokens, torch.ones_like(tokens),
                                    temperature=agent.sampling.temperature)[0]
    torch.testing.assert_close(recomputed, torch.tensor(again.logprobs), atol=1e-4, rtol=0)
