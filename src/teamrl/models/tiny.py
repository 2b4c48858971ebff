"""A random-initialised tiny causal LM with a word-level tokenizer, built in memory in well under a second.

Tests, the docs' examples and smoke runs use it instead of a downloaded model: its vocabulary is the
task's own words, so a few hundred updates on a laptop CPU are enough for a team of them to learn a
built-in game. It is a real ``transformers`` Llama model and a real ``PreTrainedTokenizerFast``, so
everything that works on it works on a hub model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def tiny_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``words`` with distinct pad, eos and unk tokens."""
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([PAD, EOS, UNK, *words]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # single spaces, no punctuation gluing
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_model(
    vocab_size: int,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_key_value_heads: int | None = None,
    max_positions: int = 256,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with the given size (``num_key_value_heads``: fewer than ``num_heads`` for
    grouped-query attention; as many by default); the same seed gives the same weights."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads or num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # building a model must not perturb the caller's sampling
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model


def tiny_model_and_tokenizer(words: Sequence[str], *, seed: int = 0,
                             **sizes) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A tiny model and its tokenizer over ``words``."""
    tokenizer = tiny_tokenizer(words)
    model = tiny_model(len(tokenizer), seed=seed, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, **sizes)
    return model, tokenizer
