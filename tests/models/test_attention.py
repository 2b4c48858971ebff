"""teamrl's CPU attention computes what transformers' sdpa computes: grouped heads without copies, and
decoding behind prompts whose keys and values are held once for all their rows."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from teamrl.config import SamplingConfig
from teamrl.models.attention import (
    GROUPED_SDPA,
    SharedPrefixCache,
    attending_through,
    shares_prefixes,
    use_grouped_attention,
)
from teamrl.models.kv_cache import cache_arg, cache_of
from teamrl.models.tiny import tiny_model, tiny_model_and_tokenizer
from teamrl.rollout import generate as generate_module
from teamrl.team import Agent

# float32 sums taken in another order (flash-attention blocks, two softmax parts merged): ~1e-6 relative.
TOL = {"rtol": 1e-5, "atol": 1e-5}
BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}


def _gqa_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same tiny model with 4 query heads on 2 key/value heads, on sdpa and on teamrl's attention."""
    reference = tiny_model(50, num_heads=4, num_key_value_heads=2, num_layers=2, seed=3).eval()
    grouped = copy.deepcopy(reference)
    assert reference.config._attn_implementation == "sdpa"
    assert use_grouped_attention(grouped)
    assert grouped.config._attn_implementation == GROUPED_SDPA
    assert reference.config._attn_implementation == "sdpa"  # the copy's switch did not leak into the original
    return reference, grouped


def _left_padded(lengths: list[int], width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 50, (len(lengths), width), generator=generator)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, width - length:] = 1
    return ids * mask, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def test_grouped_attention_matches_sdpa_in_values_and_gradients():
    reference, grouped = _gqa_pair()
    ids, mask = _left_padded([9, 4, 7], width=9)
    results = []
    for model in (reference, grouped):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        (logits * mask[..., None]).square().sum().backward()
        results.append((logits, [p.grad.clone() for p in model.parameters()]))
    (ref_logits, ref_grads), (logits, grads) = results
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], **TOL)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, **TOL)


def test_bfloat16_training_passes_attend_in_float32(monkeypatch):
    """A bfloat16 model's passes with gradients attend in float32 (torch's bfloat16 CPU backward is the
    slower one) and give sdpa's bfloat16 values and gradients up to bfloat16 rounding; passes without
    gradients (decoding) stay in bfloat16."""
    reference, grouped = _gqa_pair()
    reference.to(torch.bfloat16), grouped.to(torch.bfloat16)
    kernel_dtypes = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        kernel_dtypes.append(args[0].dtype)
        return sdpa(*args, **kwargs)

    ids, mask = _left_padded([9, 4, 7], width=9)
    results = []
    for model in (reference, grouped):
        if model is grouped:
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits
        (logits.float() * mask[..., None]).square().sum().backward()
        results.append((logits, [p.grad.float() for p in model.parameters()]))
    (ref_logits, ref_grads), (logits, grads) = results
    assert logits.dtype == torch.bfloat16 and kernel_dtypes == [torch.float32] * 2
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref_logits[real], **BF16_TOL)
    for grad, ref_grad in zip(grads, ref_grads):
        error = (grad - ref_grad).norm()
        assert error <= 0.02 * ref_grad.norm() + 1e-6, (error / ref_grad.norm()).item()
    with torch.no_grad():
        grouped(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    assert kernel_dtypes[2:] == [torch.bfloat16] * 2


def test_grouped_attention_runs_the_grouped_kernel_on_masked_passes(monkeypatch):
    _, grouped = _gqa_pair()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((args[0].shape[1], args[1].shape[1], kwargs.get("enable_gqa", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids, mask = _left_padded([6, 3], width=6)
    grouped(input_ids=ids, attention_mask=mask, position_ids=_positions(mask))
    # 4 query heads on the 2 key/value heads themselves: no per-query-head copies
    assert calls == [(4, 2, True)] * 2


def _decode_behind_shared_prompts(model, prompt_ids, prompt_mask, rows_per_prompt, new_tokens, step):
    """Logits of ``new_tokens`` (rows, T) fed ``step`` at a time behind a SharedPrefixCache of the prompts."""
    with torch.no_grad():
        prompt_cache = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=_positions(prompt_mask),
                             use_cache=True)
        prompt_cache = cache_of(prompt_cache)
        cache = SharedPrefixCache(prompt_cache, prompt_mask, rows_per_prompt, max_new_positions=new_tokens.shape[1])
        mask = prompt_mask.repeat_interleave(rows_per_prompt, dim=0)
        logits = []
        with attending_through(cache):
            for start in range(0, new_tokens.shape[1], step):
                chunk = new_tokens[:, start:start + step]
                mask = torch.cat([mask, torch.ones_like(chunk)], dim=1)
                logits.append(model(input_ids=chunk, attention_mask=mask, **cache_arg(cache),
                                    position_ids=_positions(mask)[:, -chunk.shape[1]:]).logits)
        return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("lengths", [[7, 3], [7, 1]], ids=["padded", "one-prompt-all-padding"])
def test_shared_prefix_decoding_matches_a_full_forward_pass(step, lengths, dtype):
    """Each row's logits equal those of one pass over its whole sequence (prompt, padding masked, then its
    own tokens), for decoding one position at a time and several at once, and with a prompt that is all
    padding (its rows see only their own positions); in bfloat16 too (the merge's float32 log-sum-exps
    must not leak into the model's dtype)."""
    _, model = _gqa_pair()
    model.to(dtype)
    prompt_ids, prompt_mask = _left_padded(lengths, width=7, seed=1)
    rows_per_prompt, steps = 3, 4
    new_tokens = torch.randint(2, 50, (len(lengths) * rows_per_prompt, steps),
                               generator=torch.Generator().manual_seed(2))
    logits, cache = _decode_behind_shared_prompts(model, prompt_ids, prompt_mask, rows_per_prompt, new_tokens, step)

    full_ids = torch.cat([prompt_ids.repeat_interleave(rows_per_prompt, dim=0), new_tokens], dim=1)
    full_mask = torch.cat([prompt_mask.repeat_interleave(rows_per_prompt, dim=0), torch.ones_like(new_tokens)], dim=1)
    with torch.no_grad():
        expected = model(input_ids=full_ids, attention_mask=full_mask, position_ids=_positions(full_mask)).logits
    assert logits.dtype == dtype
    # bfloat16: 8 mantissa bits, rounded at every layer, in another order than the full pass
    torch.testing.assert_close(logits, expected[:, -steps:], **(TOL if dtype == torch.float32 else BF16_TOL))
    # each prompt is held once; only the rows' own positions are per row
    assert cache.layers[0].prompt_keys.shape[0] == len(lengths)
    assert cache.get_seq_length() == prompt_ids.shape[1] + steps


def test_shared_prefix_cache_refuses_more_positions_than_it_has_room_for():
    _, model = _gqa_pair()
    prompt_ids, prompt_mask = _left_padded([4, 4], width=4)
    with torch.no_grad():
        cache = SharedPrefixCache(cache_of(model(input_ids=prompt_ids, use_cache=True)), prompt_mask, 2,
                                  max_new_positions=2)
        with attending_through(cache), pytest.raises(ValueError, match="room for 2"):
            model(input_ids=torch.randint(2, 50, (4, 3)), **cache_arg(cache))


def test_shared_prefix_cache_needs_full_attention_layers():
    cache = DynamicCache()
    cache.layers = [object()]
    with pytest.raises(ValueError, match="full-attention layers"):
        SharedPrefixCache(cache, torch.ones(1, 3), 2, 4)


def test_generate_samples_the_same_tokens_behind_shared_prompts(monkeypatch):
    """generate() with the shared-prompt cache draws what it draws with copies of the prompts (top-k 1, so a
    last-digit difference cannot move a draw), with the same log-probs."""
    words = [f"w{i}" for i in range(40)]
    model, tokenizer = tiny_model_and_tokenizer(words, seed=4, num_heads=4, num_key_value_heads=2)
    use_grouped_attention(model)
    agent = Agent(name="a", model=model.eval(), tokenizer=tokenizer,
                  sampling=SamplingConfig(max_new_tokens=6, temperature=1.0, top_k=1), use_chat_template=False)
    prompts = ["w1 w2 w3 w4 w5", "w6 w7"]
    assert shares_prefixes(model)
    caches = []
    prefill = generate_module._shared_prefill

    def recording_prefill(*args, **kwargs):
        caches.append(prefill(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(generate_module, "_shared_prefill", recording_prefill)
    shared = generate_module.generate(agent, prompts, num_samples=3, seed=5)
    assert isinstance(caches[-1], SharedPrefixCache)
    monkeypatch.setattr(generate_module, "shares_prefixes", lambda *args: False)
    copied = generate_module.generate(agent, prompts, num_samples=3, seed=5)
    assert not isinstance(caches[-1], SharedPrefixCache)
    assert torch.equal(shared.completion_ids, copied.completion_ids)
    torch.testing.assert_close(shared.sampling_logprobs, copied.sampling_logprobs, **TOL)


def test_models_off_cpu_or_off_sdpa_are_left_alone():
    model = tiny_model(50, seed=0)
    model.set_attn_implementation("eager")
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"
    assert not shares_prefixes(model)
