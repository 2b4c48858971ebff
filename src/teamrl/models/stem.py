"""The opening that many prompts share, run once: its keys and values serve every prompt after it.

Sampling prefills a turn's prompts behind their shared opening (:mod:`teamrl.rollout.generate`), and
the update runs an agent's shared opening once per optimiser step with its gradient carried back
(:mod:`teamrl.algorithms.fast_update`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from teamrl.models.kv_cache import cache_of
from teamrl.models.lora import active_adapter_fused

if TYPE_CHECKING:
    from teamrl.rollout.generate import Generation


@dataclass
class PromptStem:
    """The opening tokens that every prompt of an agent's update shares (chat template, role, the task's
    text), run once per optimiser step (:func:`prompt_stem`).

    Each micro-batch attends to the stem's keys and values instead of running those tokens again. They are
    leaves of the autograd graph: the gradients the micro-batches leave on them add up, and
    :meth:`backward` carries the sum into the model, as if each micro-batch had run the stem itself. With
    two turns, an agent's turn-2 prompts repeat its turn-1 prompt's opening ahead of their own parts: about
    half of their tokens (docs/reports/step-time.md, "Ninth round").
    """

    ids: torch.Tensor
    """(S,) the shared tokens."""
    keys: list[torch.Tensor]
    """Per layer, (1, heads, S, head_dim): the leaves the micro-batches attend to."""
    values: list[torch.Tensor]
    outputs: list[torch.Tensor]
    """The stem pass's own keys then values, whose graph :meth:`backward` runs."""

    @property
    def length(self) -> int:
        return self.ids.shape[0]

    def leaves(self) -> list[torch.Tensor]:
        """Keys then values: what a micro-batch's gradient is taken with respect to, besides the weights."""
        return [*self.keys, *self.values]

    def cache(self, rows: int) -> DynamicCache:
        """A cache holding the stem for ``rows`` rows (views; each layer's first update copies them)."""
        return DynamicCache([(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
                             for k, v in zip(self.keys, self.values)])

    def remainder(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompts -> the same prompts after the stem, left-padded (padding ids zeroed)."""
        width, lengths = prompt_ids.shape[1], prompt_mask.sum(dim=1)
        offsets = torch.arange(self.length, device=prompt_ids.device)
        heads = prompt_ids.gather(1, ((width - lengths)[:, None] + offsets).clamp(max=width - 1))
        if bool((lengths <= self.length).any()) or not bool((heads == self.ids).all()):
            raise ValueError("token_logprobs: a prompt does not start with the stem's tokens and go on after them")
        rest = lengths - self.length
        keep = int(rest.max())
        mask = (torch.arange(keep, device=prompt_ids.device) >= keep - rest[:, None]).to(prompt_mask.dtype)
        return prompt_ids[:, width - keep:] * mask, mask

    def backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Carry the summed gradients of :meth:`leaves` through the stem pass into the model."""
        pairs = [(out, grad) for out, grad in zip(self.outputs, grads) if grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


#: A pass of its own costs about as much as this many prompt tokens run again (docs/reports/step-time.md,
#: "Ninth round"); shorter common openings run with each prompt.
MIN_STEM_TOKENS = 16


def long_enough(opening: torch.Tensor) -> bool:
    """Whether a shared opening of these tokens is worth a pass of its own (:data:`MIN_STEM_TOKENS`)."""
    return opening.shape[0] >= MIN_STEM_TOKENS


def prompt_stem(model: torch.nn.Module, generations: Sequence[Generation]) -> PromptStem | None:
    """The pass (through the active adapter) over the longest opening every prompt of ``generations``
    shares, leaving each at least one token of its own; None where sharing it saves nothing: under
    :data:`MIN_STEM_TOKENS`, a single distinct prompt, or a model whose cache is not plain full attention
    (sliding windows, states)."""
    opening: torch.Tensor | None = None
    distinct = set()
    for gen in generations:
        opening = common_opening(gen.prompt_ids, gen.prompt_mask, opening)
        distinct.update(hashlib.sha1(row[mask.bool()].numpy().tobytes()).digest()
                        for row, mask in zip(gen.prompt_ids.cpu(), gen.prompt_mask.cpu()))
    if opening is None or not long_enough(opening) or len(distinct) < 2:
        return None
    with active_adapter_fused(model):
        return run_stem(model, opening)


def common_opening(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                    reference: torch.Tensor | None = None) -> torch.Tensor:
    """The longest run of tokens that every left-padded prompt (and ``reference``, where given) starts with,
    leaving each prompt at least one token of its own."""
    lengths, width = prompt_mask.sum(dim=1), prompt_ids.shape[1]
    span = int(lengths.min()) - 1 if reference is None else min(int(lengths.min()) - 1, reference.shape[0])
    offsets = torch.arange(max(span, 0), device=prompt_ids.device)
    heads = prompt_ids.gather(1, (width - lengths)[:, None] + offsets)
    reference = heads[0] if reference is None else reference[:span]
    agree = (heads == reference).all(dim=0).long().cumprod(dim=0)
    return reference[:int(agree.sum())]


def run_stem(model: torch.nn.Module, ids: torch.Tensor, **forward_kwargs) -> PromptStem | None:
    """The pass over stem tokens ``ids`` (one row; ``forward_kwargs`` route it to an adapter); None where
    the model's cache is not plain full attention."""
    out = model(input_ids=ids[None], position_ids=torch.arange(ids.shape[0], device=ids.device)[None],
                use_cache=True, logits_to_keep=1, **forward_kwargs)
    cache = cache_of(out)
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    outputs = [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
    half = len(leaves) // 2
    return PromptStem(ids, leaves[:half], leaves[half:], outputs)
