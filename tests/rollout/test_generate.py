"""Sampling, completion masks and the training forward pass, on the in-memory tiny Llama.

The central claim checked here: only completion tokens up to and including the first EOS are trained.
Prompt padding and post-EOS tokens get exactly zero gradient, whatever token ids they hold, and an EOS
token inside the prompt (chat templates end every turn with it) truncates nothing.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from teamrl.algorithms.losses import loss_normalizer, policy_loss
from teamrl.config import SamplingConfig
from teamrl.envs.digit_sum import DigitSumGame
from teamrl.models.tiny import tiny_model_and_tokenizer, tiny_tokenizer
from teamrl.rollout.generate import Generation, completion_mask, generate, prompt_stem, token_logprobs
from teamrl.team import Agent

WORDS = [str(d) for d in range(10)] + "target first second partner you hits nothing".split()
PAD, EOS = 0, 1  # tiny_tokenizer: <pad>, <eos>, <unk>, then the words


# ------------------------------------------------------------------------------------------------
# completion_mask
# ------------------------------------------------------------------------------------------------


def test_completion_mask_single_eos():
    ids = torch.tensor([
        [5, 1, 7, 1],   # EOS at 1: kept through it
        [5, 6, 7, 8],   # no EOS: everything
        [1, 3, 3, 3],   # EOS first: only it
        [3, 3, 3, 1],   # EOS last
        [1, 1, 1, 1],
    ])
    expected = [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert completion_mask(ids, [1]).tolist() == expected


def test_completion_mask_several_eos_ids():
    ids = torch.tensor([[5, 9, 1, 7], [5, 1, 9, 7], [5, 6, 7, 9], [4, 4, 4, 4]])
    expected = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert completion_mask(ids, [1, 9]).tolist() == expected
    assert completion_mask(ids, [9, 1]).tolist() == expected


# ------------------------------------------------------------------------------------------------
# generate on the tiny model
# ------------------------------------------------------------------------------------------------


def make_agent(temperature: float = 1.0, max_new_tokens: int = 6) -> Agent:
    model, tokenizer = tiny_model_and_tokenizer(WORDS, seed=0)
    return Agent(name="a", model=model, tokenizer=tokenizer,
                 sampling=SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens))


PROMPTS = [
    "target 9 first",
    "target 7 partner 1 2 3 you 4 5 hits 0 second",
    "target 9 second <eos>",  # ends with the EOS token, as a chat template ends its turns
]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_layout_and_logprobs_match_training_forward(temperature):
    agent = make_agent(temperature)
    vocab = agent.tokenizer.get_vocab()
    num_samples = 4
    torch.manual_seed(3)
    gen = generate(agent, PROMPTS, num_samples)

    rows = len(PROMPTS) * num_samples
    assert gen.completion_ids.shape[0] == rows
    assert gen.prompt_ids.shape == gen.prompt_mask.shape
    assert gen.completion_mask.shape == gen.completion_ids.shape == gen.sampling_logprobs.shape
    assert gen.completion_ids.shape[1] <= 6
    assert len(gen.texts) == rows

    # prompt-major: rows p*G .. p*G+G-1 hold prompt p, left-padded, token ids straight from the vocabulary
    width = gen.prompt_ids.shape[1]
    for b in range(rows):
        words = PROMPTS[b // num_samples].split()
        expected = [vocab[w] for w in words]
        pad = width - len(expected)
        assert gen.prompt_ids[b].tolist() == [PAD] * pad + expected
        assert gen.prompt_mask[b].tolist() == [0] * pad + [1] * len(expected)
    assert gen.prompt_ids[2 * num_samples, -1].item() == EOS  # the EOS-terminated prompt kept its EOS

    # masks: up to and including the first EOS, independently of any EOS in the prompt
    assert torch.equal(gen.completion_mask, completion_mask(gen.completion_ids, [EOS]))
    assert gen.completion_mask[:, 0].eq(1).all()
    post_eos = gen.completion_mask == 0
    assert post_eos.any(), "seed should produce at least one completion that stops early"

    # sampling log-probs == a training forward pass on the same left-padded batch, on trained tokens;
    # rows in another order would be conditioned on the wrong prompt and fail this check
    trained = token_logprobs(agent.model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                             gen.completion_mask, temperature=temperature)
    on = gen.completion_mask.bool()
    torch.testing.assert_close(gen.sampling_logprobs[on], trained[on].detach(), atol=1e-4, rtol=0)
    assert (gen.sampling_logprobs[~on] == 0).all()
    assert (gen.sampling_logprobs[on] < 0).all()

    # texts: the trained tokens only, special tokens dropped, words joined by single spaces
    inverse = {i: w for w, i in vocab.items()}
    special = set(agent.tokenizer.all_special_ids)
    for b in range(rows):
        kept = [int(i) for i, m in zip(gen.completion_ids[b], gen.completion_mask[b]) if m and int(i) not in special]
        assert gen.texts[b] == " ".join(inverse[i] for i in kept)


def test_generate_on_an_eos_terminated_prompt_keeps_sampling():
    agent = make_agent()
    torch.manual_seed(0)
    gen = generate(agent, ["target 9 first <eos>"], 8)
    assert gen.prompt_ids[:, -1].eq(EOS).all()
    # a prompt-side EOS neither empties the completion masks nor stops generation at step 0
    assert gen.completion_mask.sum(dim=1).min() >= 1
    assert gen.completion_ids.shape[1] > 1
    assert gen.completion_mask.sum() > gen.completion_ids.shape[0]


def test_tiny_tokenizer_decode_round_trips_digit_sum_words():
    tokenizer = tiny_tokenizer(DigitSumGame().vocabulary())
    text = "6 ? 3 4"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = tokenizer.batch_decode([ids], skip_special_tokens=True)[0]  # as generate() decodes
    assert DigitSumGame().digits(decoded) == [6, None, 3, 4]
    assert decoded == text


# ------------------------------------------------------------------------------------------------
# the zero-gradient proof, end to end through the model
# ------------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------------
# shared prompts: one prompt pass for the G samples of a group
# ------------------------------------------------------------------------------------------------


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


def test_lora_team_samples_in_one_call_and_each_row_is_its_own_adapters(tiny_config, monkeypatch):
    import teamrl.rollout.generate as generate_module
    from teamrl.train import Trainer

    trainer = Trainer(tiny_config(steps=1, team={"training": "lora"}))
    with torch.no_grad():
        for agent in trainer.team:  # adapters that differ, so a row through the wrong one would show
            for p in agent.parameters:
                p.normal_(0, 0.3)
    calls = []
    real_generate = generate_module.generate
    monkeypatch.setattr(generate_module, "generate", lambda *a, **k: calls.append(k) or real_generate(*a, **k))
    observations = [trainer.env.observe(item) for item in trainer.env.items("train")[:3]]
    prompts = [[agent.prompt(obs[i]) for obs in observations] for i, agent in enumerate(trainer.team)]
    assert len({len(p) for p in prompts[0]} | {len(p) for p in prompts[1]}) > 1  # padding is involved
    torch.manual_seed(0)
    generations = generate_module.generate_team(trainer.team, prompts, 4)

    assert len(calls) == 1 and calls[0]["adapter_names"] == ["agent_first"] * 3 + ["agent_second"] * 3
    for agent, gen in zip(trainer.team, generations):
        assert gen.completion_ids.shape[0] == 12 and gen.prompt_mask[:, 0].any()  # no all-padding column left
        agent.activate()
        with torch.no_grad():
            own = token_logprobs(agent.model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        on = gen.completion_mask.bool()
        torch.testing.assert_close(gen.sampling_logprobs[on], own[on], atol=1e-4, rtol=0)


def test_a_shared_prompt_opening_is_prefilled_once_per_agent_and_samples_what_training_scores(tiny_config,
                                                                                            monkeypatch):
    import teamrl.rollout.generate as generate_module

    team = _lora_team_with_distinct_adapters(tiny_config)
    draw = torch.Generator().manual_seed(2)
    words = WORDS[:10] + WORDS[11:]  # everything but "target"

    def text(n: int) -> str:
        return " ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=draw))

    # Each agent's prompts open with its own 20 words (an agent's role and the task's text), then differ.
    prompts = [[f"target {opening} target {text(n)}" for n in (2, 4, 3)] for opening in (text(20), text(20))]
    stems = []
    run_stem = generate_module._run_stem
    monkeypatch.setattr(generate_module, "_run_stem", lambda *a, **k: stems.append(len(a[1])) or run_stem(*a, **k))

    def sample() -> list[Generation]:
        return generate_module.generate_team(team, prompts, 3, seed=5)

    with_stems = sample()
    assert stems == [22, 22]  # each agent's opening, once
    for agent, gen in zip(team, with_stems):
        agent.activate()
        with torch.no_grad():
            own = token_logprobs(agent.model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
        on = gen.completion_mask.bool()
        torch.testing.assert_close(gen.sampling_logprobs[on], own[on], atol=1e-4, rtol=0)
    monkeypatch.setattr(generate_module, "MIN_STEM_TOKENS", 10**6)
    for shared, whole in zip(with_stems, sample()):  # the same tokens as one pass over every prompt
        assert torch.equal(shared.completion_ids, whole.completion_ids)
        torch.testing.assert_close(shared.sampling_logprobs, whole.sampling_logprobs, atol=1e-5, rtol=0)
    assert stems == [22, 22]


@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 0.7)])
def test_chosen_logprobs_equal_log_softmax_gather_in_value_and_gradient(dtype, temperature, monkeypatch):
    from teamrl.rollout.generate import _ChosenLogProbs

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
def test_training_forward_runs_the_active_adapter_as_peft_does(tiny_config, dtype):
    """token_logprobs adds the active adapter itself (fused low-rank update): same log-probs and gradients
    as PEFT's own LoRA forward, PEFT's forward back afterwards, and a disabled adapter stays disabled. On a
    bfloat16 base the float32 adapters compute in bfloat16 (PEFT's forward casts activations to float32
    instead): the same up to bfloat16 rounding, and the gradients still reach the float32 weights."""
    import teamrl.rollout.generate as generate_module

    # bfloat16: adapters of a trained size (on the tiny model, 0.3 makes the adapters' own rounding dominate)
    team = _lora_team_with_distinct_adapters(tiny_config, scale=0.3 if dtype == "float32" else 0.05, dtype=dtype)
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
                    generate_module, "active_adapter_fused", lambda model: contextlib.nullcontext())
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


def _lora_team_with_distinct_adapters(tiny_config, scale: float = 0.3, **team):
    from teamrl.train import Trainer

    trainer = Trainer(tiny_config(steps=1, team={"training": "lora", **team}))
    with torch.no_grad():
        for agent in trainer.team:
            for p in agent.parameters:
                p.normal_(0, scale)
    return trainer.team


@pytest.mark.parametrize("layout", ["uneven", "blocks"])
def test_stacked_adapters_compute_what_peft_routing_computes(tiny_config, monkeypatch, layout):
    import teamrl.rollout.generate as generate_module
    from teamrl.rollout.generate import _RowAdapters

    team = _lora_team_with_distinct_adapters(tiny_config)
    model = team[0].model.eval()
    first, second = team[1].adapter, team[0].adapter
    # Uneven runs of rows take the masked sum; a team's layout (consecutive equal blocks) the batched one.
    names = [first, second, second, first] if layout == "uneven" else [first, first, second, second]
    own_row = names.index(team[0].adapter)
    grouped_calls = []
    grouped = generate_module._add_low_rank_grouped
    monkeypatch.setattr(generate_module, "_add_low_rank_grouped",
                        lambda *args: grouped_calls.append(1) or grouped(*args))
    ids = torch.randint(3, 15, (4, 6))
    rows = _RowAdapters.build(model, names)
    assert len(rows.layers) > 0
    with torch.no_grad(), rows.route(names) as routing:
        assert routing == {}  # the replaced forwards route, not PEFT
        stacked = model(input_ids=ids).logits
    assert bool(grouped_calls) == (layout == "blocks")
    with torch.no_grad():
        peft_routed = model(input_ids=ids, adapter_names=names).logits
        team[0].activate()
        own = model(input_ids=ids[own_row:own_row + 1]).logits
    torch.testing.assert_close(stacked, peft_routed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stacked[own_row:own_row + 1], own, atol=1e-5, rtol=1e-5)
    assert not any("forward" in vars(module) for module, _, _ in rows.layers)  # PEFT's forward is back
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids[:1]).logits, stacked[:1])  # adapters are back on


def test_adapter_variants_keep_peft_routing(tiny_config):
    from teamrl.rollout.generate import _RowAdapters

    team = _lora_team_with_distinct_adapters(tiny_config)
    model = team[0].model
    names = [team[0].adapter, team[1].adapter]
    layer = next(m for m, _, _ in _RowAdapters.build(model, names).layers)
    layer.lora_variant[team[0].adapter] = object()  # e.g. DoRA: not a plain A/B pair
    rows = _RowAdapters.build(model, names)
    with rows.route(names) as routing:
        assert routing == {"adapter_names": names} and not rows.layers


def test_merged_adapters_keep_peft_routing(tiny_config):
    from teamrl.rollout.generate import _RowAdapters, active_adapter_fused

    team = _lora_team_with_distinct_adapters(tiny_config)
    model = team[0].model
    names = [team[0].adapter, team[1].adapter]
    team[0].activate()
    model.merge_adapter()  # the base weights now hold the adapter: adding it again would count it twice
    rows = _RowAdapters.build(model, names)
    with rows.route(names) as routing:
        assert routing == {"adapter_names": names} and not rows.layers
    with active_adapter_fused(model):
        assert not any("forward" in vars(module) for module in model.modules())


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.6)])
def test_sampler_draws_from_the_filtered_policy_and_records_the_tempered_logprob(temperature, top_k, top_p):
    from teamrl.rollout.generate import _Sampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0, 1.0]])
    tempered = logits / temperature
    expected = torch.softmax(tempered, dim=-1)
    if top_k:
        expected = torch.where(tempered >= tempered.topk(top_k).values[:, -1:], expected, 0)
    if top_p < 1:  # keep the smallest set of top tokens whose mass reaches top_p
        order = expected.argsort(dim=-1, descending=True)
        before = expected.gather(1, order).cumsum(dim=-1) - expected.gather(1, order)
        expected = expected * torch.zeros_like(expected).scatter(1, order, (before < top_p).float())
    expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.manual_seed(0)
    sampler = _Sampler(temperature, top_k, top_p)
    draws, recorded = [], []
    for _ in range(4000):
        out = sampler(torch.zeros(2, 1, dtype=torch.long), logits)
        token = out.argmax(dim=-1)  # what generate's greedy step picks
        assert torch.equal(out.isfinite().sum(dim=-1), torch.ones(2, dtype=torch.long))
        draws.append(token)
        recorded.append(sampler.finish(token)[:, -1])
        sampler.logprobs.clear()
    draws = torch.stack(draws)
    frequencies = torch.stack([torch.bincount(draws[:, r], minlength=5) for r in range(2)]) / len(draws)
    assert frequencies[expected == 0].sum() == 0
    torch.testing.assert_close(frequencies, expected, atol=0.03, rtol=0)
    torch.testing.assert_close(torch.stack(recorded), torch.log_softmax(tempered, -1).gather(1, draws.T).T)


def test_a_sliding_window_model_keeps_the_dynamic_cache_and_samples_what_training_scores(monkeypatch):
    from transformers import MistralConfig, MistralForCausalLM

    import teamrl.rollout.generate as generate_module

    tokenizer = tiny_tokenizer(WORDS)
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=3, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None))
    agent = Agent(name="a", model=model, tokenizer=tokenizer, sampling=SamplingConfig(max_new_tokens=5))
    caches = []
    repeated = generate_module._repeated_preallocated
    monkeypatch.setattr(generate_module, "_repeated_preallocated",
                        lambda *args: caches.append(repeated(*args)) or caches[-1])
    gen = generate(agent, PROMPTS[:2], 3, seed=1)
    assert [type(c).__name__ for c in caches] == ["DynamicCache"]  # no static layer type for a sliding window
    trained = token_logprobs(model, gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    on = gen.completion_mask.bool()
    torch.testing.assert_close(gen.sampling_logprobs[on], trained[on].detach(), atol=1e-4, rtol=0)
