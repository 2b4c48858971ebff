"""Sampling and completion masks, on the in-memory tiny Llama.

A completion's mask covers its tokens up to and including the first EOS, an EOS token inside the prompt
(chat templates end every turn with it) truncates nothing, and what sampling records (each token's
log-prob) is what the loss's forward pass scores.
"""

from __future__ import annotations

import pytest
import torch

from teamrl.algorithms.logprobs import token_logprobs
from teamrl.config import SamplingConfig
from teamrl.envs.digit_sum import DigitSumGame
from teamrl.models.tiny import tiny_model_and_tokenizer, tiny_tokenizer
from teamrl.rollout.generate import Generation, completion_mask, generate
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
# shared prompts: one prompt pass for the G samples of a group
# ------------------------------------------------------------------------------------------------


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


def test_a_shared_prompt_opening_is_prefilled_once_per_agent_and_samples_what_training_scores(lora_team,
                                                                                            monkeypatch):
    import teamrl.models.stem as stem_module
    import teamrl.rollout.generate as generate_module

    team = lora_team()
    draw = torch.Generator().manual_seed(2)
    words = WORDS[:10] + WORDS[11:]  # everything but "target"

    def text(n: int) -> str:
        return " ".join(words[i] for i in torch.randint(0, len(words), (n,), generator=draw))

    # Each agent's prompts open with its own 20 words (an agent's role and the task's text), then differ.
    prompts = [[f"target {opening} target {text(n)}" for n in (2, 4, 3)] for opening in (text(20), text(20))]
    stems = []
    run_stem = generate_module.run_stem
    monkeypatch.setattr(generate_module, "run_stem", lambda *a, **k: stems.append(len(a[1])) or run_stem(*a, **k))

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
    monkeypatch.setattr(stem_module, "MIN_STEM_TOKENS", 10**6)
    for shared, whole in zip(with_stems, sample()):  # the same tokens as one pass over every prompt
        assert torch.equal(shared.completion_ids, whole.completion_ids)
        torch.testing.assert_close(shared.sampling_logprobs, whole.sampling_logprobs, atol=1e-5, rtol=0)
    assert stems == [22, 22]


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


# ------------------------------------------------------------------------------------------------
# compilation: transformers compiles generate() on CUDA when handed a static cache
# ------------------------------------------------------------------------------------------------


def _criteria_as_on_cuda(monkeypatch) -> list[tuple[bool, str]]:
    """Spy on transformers' auto-compile decision: each generate() call records (what the criteria decide for a
    model on a CUDA device with the very cache and settings teamrl passed, the calling thread's name), and is
    told not to compile, so nothing compiles on this CPU."""
    import threading
    from types import SimpleNamespace

    from transformers.generation.utils import GenerationMixin

    decide = GenerationMixin._valid_auto_compile_criteria
    decisions = []

    def spy(self, model_kwargs, generation_config):
        on_cuda = SimpleNamespace(device=torch.device("cuda"), config=self.config)
        decisions.append((decide(on_cuda, model_kwargs, generation_config), threading.current_thread().name))
        return False

    monkeypatch.setattr(GenerationMixin, "_valid_auto_compile_criteria", spy)
    # On CUDA the shared-prefix cache (CPU only) is never used: generate() hands transformers a StaticCache.
    monkeypatch.setattr("teamrl.rollout.generate.shares_prefixes", lambda model, cache=None: False)
    return decisions


def test_generate_asks_transformers_not_to_compile_on_cuda(monkeypatch):
    decisions = _criteria_as_on_cuda(monkeypatch)
    agent = make_agent()
    generate(agent, PROMPTS, 4, seed=0)
    assert [decision for decision, _ in decisions] == [False]
    # With G > 1 the cache is a StaticCache, which transformers compiles on CUDA unless asked not to.
    generate(agent, PROMPTS, 4, seed=0, compile=True)
    assert [decision for decision, _ in decisions] == [False, True]


def test_compiled_generation_runs_the_models_one_after_another(tiny_config, monkeypatch):
    """A team of several models samples in threads (decentralised execution), but never two compiling at once."""
    from teamrl.rollout.generate import generate_team
    from teamrl.train import Trainer

    with Trainer(tiny_config(steps=1)) as trainer:  # training 'full': each agent a model of its own
        team = trainer.team
    decisions = _criteria_as_on_cuda(monkeypatch)
    prompts = team.prompts([["target 9 first"], ["target 9 second"]])
    generate_team(team, prompts, 2, concurrent=True)
    assert {thread for _, thread in decisions} != {threading_main()}  # concurrent: in the pool's threads
    decisions.clear()
    generate_team(team, prompts, 2, concurrent=True, compile=True)
    assert [decision for decision, _ in decisions] == [True, True]
    assert {thread for _, thread in decisions} == {threading_main()}


def threading_main() -> str:
    import threading

    return threading.main_thread().name
