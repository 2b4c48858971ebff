"""The loss's forward pass (teamrl.algorithms.logprobs) on the in-memory tiny Llama.

The central claim checked here: only completion tokens up to and including the first EOS are trained.
Prompt padding and post-EOS tokens get exactly zero gradient, whatever token ids they hold. And what the
fast forward shares (a prompt pass per group, a shared opening, the fused adapter, the chosen-token
log-softmax) gives the log-probs and gradients of the plain computation.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from teamrl.algorithms.logprobs import _ChosenLogProbs, token_logprobs
from teamrl.algorithms.losses import loss_normalizer, policy_loss
from teamrl.models.stem import prompt_stem
from teamrl.models.tiny import tiny_model_and_tokenizer
from teamrl.rollout.generate import Generation, completion_mask

WORDS = [str(d) for d in range(10)] + "target first second partner you hits nothing".split()
PAD, EOS = 0, 1  # tiny_tokenizer: <pad>, <eos>, <unk>, then the words


def hand_batch(vocab: dict[str, int]):
    w = vocab.__getitem__
    prompt_ids = torch.tensor([
        [PAD, PAD, PAD, w("target"), w("9"), w("first")],             # left padding
        [w("target"), w("9"), w("partner"), w("1"), w("second"), EOS],  # full width, ends with EOS
        [PAD, PAD, w("target"), w("4"), w("first"), EOS],              # padding and ends with EOS
    ])
    prompt_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    completion_ids = torch.tensor([
        [w("3"), w("4"), EOS, w("7"), PAD],    # stops after 3 tokens; post-EOS tokens 7, <pad>
        [w("5"), w("6"), w("7"), w("8"), w("9")],  # never stops: all trained
        [EOS, w("5"), EOS, w("5"), PAD],       # stops at once; post-EOS holds even another EOS
    ])
    return prompt_ids, prompt_mask, completion_ids


def scramble(ids: torch.Tensor, where: torch.Tensor, vocab_size: int, seed: int) -> torch.Tensor:
    """Replace ids at ``where`` by different, arbitrary ids (EOS and PAD included among the choices)."""
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randint(1, vocab_size, ids.shape, generator=gen)
    return torch.where(where, (ids + offset) % vocab_size, ids)


def loss_and_grads(model, ref_model, prompt_ids, prompt_mask, completion_ids, mask, aggregation, kl_coef):
    model.zero_grad(set_to_none=True)
    captured = []

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured.append(output)

    handle = model.get_input_embeddings().register_forward_hook(keep)
    try:
        logprobs = token_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask)
    finally:
        handle.remove()
    # an off-policy pass: old log-probs a little away from the current ones (some ratios leave [0.8, 1.2])
    shift = torch.tensor([[0.05, -0.3, 0.1, 0.0, 0.0], [0.25, -0.1, 0.0, 0.15, -0.05], [0.1, 0.0, 0.0, 0.0, 0.0]])
    old = logprobs.detach() + shift
    ref = None
    if kl_coef:
        with torch.no_grad():
            ref = token_logprobs(ref_model, prompt_ids, prompt_mask, completion_ids, mask)
    loss, _ = policy_loss(logprobs, old, torch.tensor([1.0, -0.5, 2.0]), mask, aggregation=aggregation,
                          normalizer=loss_normalizer([mask], aggregation), ref_logprobs=ref, kl_coef=kl_coef)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, captured[0].grad


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("aggregation", ["token_sum", "sequence_mean", "token_mean"])
def test_padding_and_post_eos_tokens_get_exactly_zero_gradient(aggregation, kl_coef):
    model, tokenizer = tiny_model_and_tokenizer(WORDS, seed=0)
    ref_model, _ = tiny_model_and_tokenizer(WORDS, seed=1)
    vocab_size = len(tokenizer)
    prompt_ids, prompt_mask, completion_ids = hand_batch(tokenizer.get_vocab())
    mask = completion_mask(completion_ids, [EOS])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]  # prompt EOS truncates nothing

    loss, grads, embed_grad = loss_and_grads(model, ref_model, prompt_ids, prompt_mask, completion_ids, mask,
                                             aggregation, kl_coef)
    assert torch.isfinite(loss)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    assert sum(g.abs().sum() for g in grads.values()) > 0

    # embedding gradient: exactly 0 on prompt padding and post-EOS positions
    # (the last completion token is never an input: nothing is trained on what it would predict)
    attention = torch.cat([prompt_mask, mask[:, :-1]], dim=1)
    assert embed_grad.shape[:2] == attention.shape
    assert (embed_grad[attention == 0] == 0).all()
    # ...and not trivially 0: every row's real prompt tokens (EOS-terminated ones too) carry gradient
    for b in range(3):
        real_prompt = embed_grad[b, : prompt_ids.shape[1]][prompt_mask[b] == 1]
        assert real_prompt.abs().sum() > 0
    # the token right after a prompt-side EOS is trained: its logit row (the EOS position) gets gradient
    assert embed_grad[1, prompt_ids.shape[1] - 1].abs().sum() > 0
    assert embed_grad[2, prompt_ids.shape[1] - 1].abs().sum() > 0

    # arbitrary other ids at every padding and post-EOS position: same loss, same gradient everywhere
    new_prompt = scramble(prompt_ids, prompt_mask == 0, vocab_size, seed=1)
    new_completion = scramble(completion_ids, mask == 0, vocab_size, seed=2)
    assert not torch.equal(new_prompt, prompt_ids) and not torch.equal(new_completion, completion_ids)
    assert torch.equal(completion_mask(new_completion, [EOS]), mask)
    loss2, grads2, embed_grad2 = loss_and_grads(model, ref_model, new_prompt, prompt_mask, new_completion, mask,
                                                aggregation, kl_coef)
    torch.testing.assert_close(loss2, loss, atol=1e-7, rtol=0)
    assert grads2.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads2[name], grad, atol=1e-7, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(embed_grad2, embed_grad, atol=1e-7, rtol=0)


def test_rows_sharing_a_prompt_give_the_same_logprobs_and_gradients_as_separate_passes():
    model, tokenizer = tiny_model_and_tokenizer(WORDS, seed=0)
    prompt_ids, prompt_mask, completion_ids = hand_batch(tokenizer.get_vocab())
    # every prompt twice, each copy with its own completion: the G-samples layout
    order = torch.tensor([0, 0, 1, 1, 2, 2])
    completions = torch.cat([completion_ids, completion_ids.flip(1)])[torch.tensor([0, 3, 1, 4, 2, 5])]
    batch = (prompt_ids[order], prompt_mask[order], completions, completion_mask(completions, [EOS]))
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(0))

    def run(rows_at_a_time: int):
        model.zero_grad(set_to_none=True)
        parts = [token_logprobs(model, *(t[r:r + rows_at_a_time] for t in batch), temperature=0.7)
                 for r in range(0, 6, rows_at_a_time)]
        logprobs = torch.cat(parts)
        (logprobs * weights * batch[3]).sum().backward()
        return logprobs.detach() * batch[3], {n: p.grad.clone() for n, p in model.named_parameters()}

    shared, shared_grads = run(6)  # 3 distinct prompts: the prefix-sharing path
    alone, alone_grads = run(1)    # one row per call: nothing to share, the single-pass path
    torch.testing.assert_close(shared, alone, atol=1e-5, rtol=0)
    for name, grad in alone_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)])
def test_chosen_logprobs_equal_log_softmax_gather_in_value_and_gradient(dtype, temperature, monkeypatch):

    monkeypatch.setattr(_ChosenLogProbs, "BLOCK_BYTES", 3 * 4 * 50)  # 3 rows of 50 logits: 5 blocks, the last short
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, 50, generator=gen) * 4).to(dtype)
    tokens = torch.randint(0, 50, (2, 7), generator=gen)
    weights = torch.randn(2, 7, generator=gen)
    ours = logits.clone().requires_grad_()
    chosen = _ChosenLogProbs.apply(ours, tokens, temperature)
    (chosen * weights).sum().backward()
    reference = logits.clone().requires_grad_()
    expected = torch.log_softmax(reference.float() / temperature, dim=-1).gather(2, tokens[..., None]).squeeze(-1)
    (expected * weights).sum().backward()
    assert chosen.dtype == torch.float32 and ours.grad.dtype == dtype
    torch.testing.assert_close(chosen, expected, atol=1e-5, rtol=1e-5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours.grad, reference.grad, atol=tolerance, rtol=tolerance)


def test_completions_of_one_token_are_scored():
    model, tokenizer = tiny_model_and_tokenizer(WORDS, seed=0)
    prompt_ids, prompt_mask, completion_ids = hand_batch(tokenizer.get_vocab())
    one = completion_ids[:, :1]
    full = token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask(completion_ids, [EOS]))
    for rows in (torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1])):  # distinct prompts, then a shared one
        first = token_logprobs(model, prompt_ids[rows], prompt_mask[rows], one[rows], torch.ones_like(one[rows]))
        assert first.shape == (3, 1)
        torch.testing.assert_close(first, full[rows, :1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_training_forward_runs_the_active_adapter_as_peft_does(lora_team, dtype):
    """token_logprobs adds the active adapter itself (fused low-rank update): same log-probs and gradients
    as PEFT's own LoRA forward, PEFT's forward back afterwards, and a disabled adapter stays disabled. On a
    bfloat16 base the float32 adapters compute in bfloat16 (PEFT's forward casts activations to float32
    instead): the same up to bfloat16 rounding, and the gradients still reach the float32 weights."""
    import teamrl.algorithms.logprobs as logprobs_module

    # bfloat16: adapters of a trained size (on the tiny model, 0.3 makes the adapters' own rounding dominate)
    team = lora_team(scale=0.3 if dtype == "float32" else 0.05, dtype=dtype)
    agent = team[1]
    agent.activate()
    model = agent.model
    ids = torch.randint(3, 15, (4, 9))
    batch = (ids[:, :5], torch.ones(4, 5, dtype=torch.long), ids[:, 5:], torch.ones(4, 4, dtype=torch.long))
    weights = torch.randn(4, 4)

    def run(fused: bool):
        model.zero_grad(set_to_none=True)
        if fused:
            logprobs = token_logprobs(model, *batch, temperature=0.7)
        else:
            with contextlib.ExitStack() as stack:  # PEFT's forward: the fused path switched off
                stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                    logprobs_module, "active_adapter_fused", lambda model: contextlib.nullcontext())
                logprobs = token_logprobs(model, *batch, temperature=0.7)
        (logprobs * weights).sum().backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fused, fused_grads = run(fused=True)
    peft, peft_grads = run(fused=False)
    assert set(fused_grads) == set(peft_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(agent.adapter in n for n in fused_grads)  # only the active adapter trains
    assert all(grad.dtype == torch.float32 for grad in fused_grads.values())
    if dtype == "float32":
        torch.testing.assert_close(fused, peft, atol=1e-5, rtol=0)
        for name, grad in peft_grads.items():
            torch.testing.assert_close(fused_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    else:  # bfloat16 rounding (8 mantissa bits) in other places: measured ~1% apart
        torch.testing.assert_close(fused, peft, atol=1e-2, rtol=2e-2)
        difference = sum((fused_grads[n] - grad).square().sum() for n, grad in peft_grads.items())
        assert difference.sqrt() <= 0.03 * sum(grad.square().sum() for grad in peft_grads.values()).sqrt()
    assert not any("forward" in vars(module) for module in model.modules())  # PEFT's forward is back
    with torch.no_grad(), agent.reference() as reference:
        base = token_logprobs(reference, *batch)
        with model.disable_adapter():
            torch.testing.assert_close(base, token_logprobs(model.get_base_model(), *batch))
    assert not torch.allclose(base, fused)


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_a_shared_prompt_opening_run_once_gives_the_same_logprobs_and_gradients():
    model, _ = tiny_model_and_tokenizer(WORDS, seed=0)
    draw = torch.Generator().manual_seed(1)
    opening = torch.randint(3, 3 + len(WORDS), (20,), generator=draw).tolist()  # the role and task text
    own = [torch.randint(3, 3 + len(WORDS), (n,), generator=draw).tolist() for n in (3, 7, 1, 5)]
    generations = []
    for prompts in ([0, 0, 1, 1], [2, 3, 3, 2]):  # two micro-batches: samples sharing prompts, ends of 1 to 7 tokens
        prompt_ids, prompt_mask = _left_padded([opening + own[p] for p in prompts])
        completions = torch.randint(3, 3 + len(WORDS), (4, 5), generator=draw)
        completions[torch.arange(4), torch.tensor([4, 1, 2, 4])] = EOS
        mask = completion_mask(completions, [EOS])
        generations.append(Generation(prompt_ids, prompt_mask, completions, mask, torch.zeros(4, 5), [""] * 4))
    weights = [torch.randn(4, 5, generator=draw) for _ in generations]

    def run(use_stem: bool):
        model.zero_grad(set_to_none=True)
        stem = prompt_stem(model, generations) if use_stem else None
        outputs = []
        for gen, weight in zip(generations, weights):
            logprobs = token_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                      gen.completion_mask, temperature=0.7, stem=stem)
            (logprobs * weight * gen.completion_mask).sum().backward()
            outputs.append(logprobs.detach() * gen.completion_mask)
        if stem is not None:
            assert torch.equal(stem.ids, torch.tensor(opening))
            stem.backward([leaf.grad for leaf in stem.leaves()])
        return torch.cat(outputs), {n: p.grad.clone() for n, p in model.named_parameters()}

    with_stem, stem_grads = run(True)
    without, grads = run(False)
    torch.testing.assert_close(with_stem, without, atol=1e-5, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(stem_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")

    stem = prompt_stem(model, generations)
    other = _left_padded([own[1] + opening])
    with pytest.raises(ValueError, match="does not start with the stem"):
        stem.remainder(*other)
    first = generations[0]
    assert prompt_stem(model, [first.rows(0, 2)]) is None  # one distinct prompt: nothing to share
    assert prompt_stem(model, [first.rows(1, 3)]) is not None
