"""CPU attention that copies no keys and values: none per query head, none per sample of a prompt.

transformers' ``sdpa`` attention lets torch handle grouped-query attention (``enable_gqa``) only when no
attention mask is given; with one (every left-padded batch, every pass over completions behind a cached
prompt) it first copies each key/value head once per query head (``repeat_kv``) and the backward pass
sums the copies' gradients back. torch's CPU flash-attention kernel reads the grouped heads directly,
mask or not: the same outputs, in less time (why: see docs/reports/step-time.md#attention-without-copies).

:func:`use_grouped_attention` switches a CPU model from ``sdpa`` to ``teamrl_sdpa``, registered here
with transformers' ``AttentionInterface``: that grouped kernel for masked multi-query passes on CPU,
transformers' own ``sdpa`` for everything else (one-token decoding steps, which transformers already runs
without copies, unmasked passes, other devices, softcapping and position biases).

The same attention decodes G samples of one prompt without G copies of the prompt's keys and values
(:class:`SharedPrefixCache`, inside :func:`attending_through`): each prompt's keys and values are held
once, each row's own positions after them, and a decoding step attends to the two parts separately
and merges them by their log-sum-exps ("cascade" attention, as vLLM and FlashInfer do on GPUs), which
shortens generation's decoding steps (measured in docs/reports/step-time.md#attention-without-copies).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

#: The name this module's attention is registered under in transformers.
GROUPED_SDPA = "teamrl_sdpa"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, with torch's grouped-query kernel where a mask made it copy keys
    and values per query head, and the prompts' keys and values added by :func:`attending_through`
    (see the module docstring)."""
    if torch.is_autocast_enabled(query.device.type):
        # Mixed precision (teamrl.models.precision): rotary embeddings leave queries and keys float32 and values
        # 16-bit, and the in-place kernels below do not autocast; attend in the autocast dtype, as autocast's own
        # scaled_dot_product_attention would.
        dtype = torch.get_autocast_dtype(query.device.type)
        with torch.autocast(query.device.type, enabled=False):
            return grouped_sdpa_attention(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask,
                                          dropout, scaling, **kwargs)
    shared = getattr(_active, "cache", None)
    if shared is not None:
        return shared.attend(module.layer_idx, query, key, value, scaling)
    if query.device.type == "cpu" and query.dtype == torch.bfloat16 and torch.is_grad_enabled():
        # torch's CPU flash kernel runs its bfloat16 backward slower than its float32 one, casts included:
        # train in float32 (why: see docs/reports/step-time.md#bfloat16-on-cpu)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        output, weights = grouped_sdpa_attention(module, query.float(), key.float(), value.float(), attention_mask,
                                                 dropout, scaling, **kwargs)
        return output.to(query.dtype), weights
    groups = getattr(module, "num_key_value_groups", 1)
    grouped = (query.device.type == "cpu" and attention_mask is not None and query.shape[2] > 1 and groups > 1
               and key.shape[1] * groups == query.shape[1] and key.shape[-1] == value.shape[-1]
               and not any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "cache"))
               and not kwargs.get("output_attentions", False))
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                            scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def _grouped_sdpa_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' ``sdpa`` mask, or none inside :func:`attending_through` (the cache knows its layout)."""
    return None if getattr(_active, "cache", None) is not None else sdpa_mask(*args, **kwargs)


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
AttentionMaskInterface.register(GROUPED_SDPA, _grouped_sdpa_mask)


def use_grouped_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` attention to :func:`grouped_sdpa_attention`, in place;
    whether it was switched (models on another attention implementation, or that cannot change it after
    loading, are left as they are)."""
    if model.config._attn_implementation != "sdpa" or not model._can_set_attn_implementation():
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return model.config._attn_implementation == GROUPED_SDPA


_active = threading.local()
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def shares_prefixes(model: PreTrainedModel, prompt_cache: Cache | None = None) -> bool:
    """Whether ``model`` can decode through a :class:`SharedPrefixCache` (a CPU model on
    :func:`grouped_sdpa_attention`, with torch's CPU flash-attention kernel) built from ``prompt_cache``
    (full-attention layers only: no sliding windows or states), where one is given."""
    return (model.config._attn_implementation == GROUPED_SDPA and _flash_with_lse is not None
            and model.device.type == "cpu" and (prompt_cache is None or _full_attention_only(prompt_cache)))


def _full_attention_only(cache: Cache) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


@contextlib.contextmanager
def attending_through(cache: SharedPrefixCache) -> Iterator[None]:
    """While open, this thread's passes of a model on :func:`grouped_sdpa_attention` attend through
    ``cache`` (which they must also be given as their key/value cache argument)."""
    _active.cache = cache
    try:
        yield
    finally:
        _active.cache = None


class SharedPrefixCache(Cache):
    """The key/value cache of ``rows_per_prompt`` rows per prompt that share the prompt's cached positions.

    Built from the cache of each prompt run once (``prompt_cache``, one row per prompt, left-padded as
    ``prompt_mask`` says); rows are laid out prompt by prompt (rows ``i * rows_per_prompt`` onwards are
    prompt i's). New positions, up to ``max_new_positions`` per row, are each row's own. Where a
    :class:`~transformers.StaticCache` of the same rows holds every prompt ``rows_per_prompt`` times
    (zero-filled, then copied in), and every decoding step reads all of them, this holds and reads each
    prompt once, so a decoding step's attention reads less (why: see
    docs/reports/step-time.md#attention-without-copies).
    """

    def __init__(self, prompt_cache: Cache, prompt_mask: torch.Tensor, rows_per_prompt: int, max_new_positions: int):
        if not _full_attention_only(prompt_cache):
            raise ValueError("SharedPrefixCache: the prompt cache must hold only full-attention layers "
                             f"(got {sorted({type(layer).__name__ for layer in prompt_cache.layers})})")
        super().__init__(layers=[_RowsAfterSharedPrompt(layer.keys, layer.values, rows_per_prompt, max_new_positions)
                                 for layer in prompt_cache.layers])
        self.rows_per_prompt = rows_per_prompt
        # Added to the prompt's attention scores: the lowest float (not -inf, which a prompt that is all
        # padding would turn into NaN) at padding positions.
        self.prompt_bias = torch.zeros(prompt_mask.shape, dtype=prompt_cache.layers[0].keys.dtype,
                                       device=prompt_mask.device)
        self.prompt_bias.masked_fill_(prompt_mask == 0, torch.finfo(self.prompt_bias.dtype).min)
        self.prompt_bias = self.prompt_bias[:, None, None, :]

    def attend(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scaling: float | None) -> tuple[torch.Tensor, None]:
        """Attention of ``query`` (rows, heads, queries, head dim) to layer ``layer_idx``'s prompt and to the
        rows' own ``keys``/``values`` (causally), in the layout transformers' attention functions return."""
        layer = self.layers[layer_idx]
        if query.shape[2] == 1:
            return self._attend_one_position(layer, query, keys, values, scaling), None
        prompts, kv_heads, prompt_length, head_dim = layer.prompt_keys.shape
        prompt_keys, prompt_values = layer.prompt_keys.to(query.dtype), layer.prompt_values.to(query.dtype)
        rows, heads, num_queries, _ = query.shape
        samples, groups, own = self.rows_per_prompt, heads // kv_heads, keys.shape[2]
        # Each prompt's queries (all its rows, every head of a key/value head) against its keys, once.
        by_prompt = (query.reshape(prompts, samples, kv_heads, groups * num_queries, head_dim).transpose(1, 2)
                     .reshape(prompts, kv_heads, samples * groups * num_queries, head_dim))
        prompt_out, prompt_lse = _flash_with_lse(by_prompt, prompt_keys, prompt_values,
                                                 attn_mask=self.prompt_bias.to(query.dtype), scale=scaling)
        prompt_out = (prompt_out.reshape(prompts, kv_heads, samples, groups * num_queries, head_dim).transpose(1, 2)
                      .reshape(rows, kv_heads, groups * num_queries, head_dim))
        prompt_lse = (prompt_lse.reshape(prompts, kv_heads, samples, groups * num_queries).transpose(1, 2)
                      .reshape(rows, kv_heads, groups * num_queries))
        by_row = query.reshape(rows, kv_heads, groups * num_queries, head_dim)
        causal = None
        if num_queries > 1:  # query i sees the row's own positions up to its own
            visible = (torch.arange(own, device=query.device)[None, :]
                       <= torch.arange(own - num_queries, own, device=query.device)[:, None])
            causal = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
            causal = causal.masked_fill_(~visible, torch.finfo(query.dtype).min).repeat(groups, 1)[None, None]
        own_out, own_lse = _flash_with_lse(by_row, keys, values, attn_mask=causal, scale=scaling)
        # softmax over both parts = each part's softmax weighted by its share of the total exp-sum (the
        # kernel's log-sum-exps are float32 whatever the model's dtype; the output goes back to it)
        total = torch.logaddexp(prompt_lse, own_lse)
        out = (prompt_out * (prompt_lse - total).exp_().unsqueeze(-1)
               + own_out * (own_lse - total).exp_().unsqueeze(-1))
        out = out.to(query.dtype).reshape(rows, heads, num_queries, head_dim)
        return out.transpose(1, 2).contiguous(), None

    def _attend_one_position(self, layer: _RowsAfterSharedPrompt, query: torch.Tensor, keys: torch.Tensor,
                             values: torch.Tensor, scaling: float | None) -> torch.Tensor:
        """:meth:`attend` for one new position per row (a decoding step), in plain batched matmuls: each
        prompt's scores against all of its rows' queries at once, each row's against its own positions,
        and one softmax over both. At decoding's sizes the flash kernel's per-call work outweighs the
        arithmetic, so this is faster than two kernel calls and their merge (why: see
        docs/reports/step-time.md#attention-without-copies)."""
        prompts, kv_heads, prompt_length, head_dim = layer.prompt_keys.shape
        prompt_keys, prompt_values = layer.prompt_keys.to(query.dtype), layer.prompt_values.to(query.dtype)
        rows, heads = query.shape[:2]
        samples, groups = self.rows_per_prompt, heads // kv_heads
        scale = head_dim ** -0.5 if scaling is None else scaling
        by_prompt = (query.reshape(prompts, samples, kv_heads, groups, head_dim).transpose(1, 2)
                     .reshape(prompts * kv_heads, samples * groups, head_dim))
        bias = self.prompt_bias.expand(prompts, kv_heads, 1, prompt_length)
        bias = bias.reshape(prompts * kv_heads, 1, prompt_length)
        prompt_scores = torch.baddbmm(bias.to(query.dtype), by_prompt,
                                      prompt_keys.reshape(-1, prompt_length, head_dim).mT,
                                      alpha=scale)
        prompt_scores = (prompt_scores.view(prompts, kv_heads, samples, groups, prompt_length).transpose(1, 2)
                         .reshape(rows * kv_heads, groups, prompt_length))
        by_row = query.reshape(rows * kv_heads, groups, head_dim)
        own_keys = keys.reshape(rows * kv_heads, -1, head_dim)
        own_scores = torch.bmm(by_row, own_keys.mT).mul_(scale)
        weights = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1, dtype=torch.float32)
        weights = weights.to(query.dtype)
        prompt_weights = (weights[..., :prompt_length].reshape(prompts, samples, kv_heads, groups, prompt_length)
                          .transpose(1, 2).reshape(prompts * kv_heads, samples * groups, prompt_length))
        out = (torch.bmm(prompt_weights, prompt_values.reshape(-1, prompt_length, head_dim))
               .view(prompts, kv_heads, samples, groups, head_dim).transpose(1, 2)
               .reshape(rows * kv_heads, groups, head_dim))
        out = out.baddbmm_(weights[..., prompt_length:], values.reshape(rows * kv_heads, -1, head_dim))
        return out.view(rows, heads, 1, head_dim).transpose(1, 2).contiguous()


class _RowsAfterSharedPrompt(CacheLayerMixin):
    """One layer of a :class:`SharedPrefixCache`: the prompts' keys/values once, and each row's own."""

    is_sliding = False

    def __init__(self, prompt_keys: torch.Tensor, prompt_values: torch.Tensor, rows_per_prompt: int, capacity: int):
        super().__init__()
        self.prompt_keys, self.prompt_values = prompt_keys, prompt_values
        prompts, kv_heads, self.prompt_length, head_dim = prompt_keys.shape
        shape = (prompts * rows_per_prompt, kv_heads, capacity, head_dim)
        # never read past self.length, so never needs filling
        self.keys = torch.empty(shape, dtype=prompt_keys.dtype, device=prompt_keys.device)
        self.values = torch.empty_like(self.keys)
        self.length = 0
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[2]
        if end > self.keys.shape[2]:
            raise ValueError(f"SharedPrefixCache: {end} new positions per row, room for {self.keys.shape[2]}")
        self.keys[:, :, self.length:end] = key_states
        self.values[:, :, self.length:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prompt_length + self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.prompt_length + self.length

    def get_max_length(self) -> int:
        return self.prompt_length + self.keys.shape[2]
