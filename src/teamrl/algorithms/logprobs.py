"""Log-probabilities of sampled completions under the policy being trained: the loss's forward pass.

:func:`completion_logprobs` computes them as they read: one pass over prompt + completion, a
log-softmax, the sampled tokens' entries. :func:`token_logprobs` computes the same faster, as the fast
update runs it: each distinct prompt once for its G rows, behind an optional shared opening
(:class:`~teamrl.models.stem.PromptStem`), and the chosen tokens' log-softmax without holding the
(tokens x vocabulary) tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from teamrl.models.kv_cache import cache_arg, cache_of
from teamrl.models.lora import active_adapter_fused
from teamrl.models.stem import PromptStem

if TYPE_CHECKING:
    from teamrl.rollout.generate import Generation


def completion_logprobs(model: torch.nn.Module, gen: Generation, temperature: float = 1.0) -> torch.Tensor:
    """(B, C) log-prob of each completion token of ``gen`` under ``model`` (temperature-scaled), with
    positions counted over real tokens only, as the model saw them while sampling with left padding.
    Tokens after a completion's end hold whatever the model gives them: the loss masks them out."""
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], dim=1)
    logits = model(input_ids=torch.cat([gen.prompt_ids, gen.completion_ids], dim=1), attention_mask=mask,
                   position_ids=(mask.cumsum(dim=1) - 1).clamp(min=0)).logits
    scored = logits[:, gen.prompt_ids.shape[1] - 1:-1].float() / temperature  # position p predicts token p + 1
    return torch.log_softmax(scored, dim=-1).gather(-1, gen.completion_ids.unsqueeze(-1)).squeeze(-1)


def token_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    stem: PromptStem | None = None,
) -> torch.Tensor:
    """(B, C) log-prob of each completion token under ``model`` (temperature-scaled).

    Masked completion tokens are excluded from attention, and positions are counted over real tokens
    only, so the numbers match what the model computed while sampling with left padding.

    Rows that share a prompt (the G samples of a group) share its forward pass: each distinct prompt
    runs once, its key/value cache is copied to its rows (differentiably, so the prompt's gradient is
    the sum over its rows, as in G separate passes), and only the completions run per row. With
    prompts much longer than completions this is close to G times less work. With a ``stem`` (whose
    tokens every prompt starts with), the prompts run only after it, attending to its keys and values.

    The last completion token is never fed to the model (nothing is trained on what it predicts), so the
    logits computed are exactly the ones scored: no (tokens x vocabulary) slice or copy of them is made.
    """
    past = 0
    if stem is not None:
        prompt_ids, prompt_mask = stem.remainder(prompt_ids, prompt_mask)
        past = stem.length
    unique_prompts, row_prompt = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0,
                                              return_inverse=True)
    num_prompt, num_completion = prompt_ids.shape[1], completion_ids.shape[1]
    attention_mask = torch.cat([prompt_mask.new_ones(prompt_mask.shape[0], past), prompt_mask,
                                completion_mask[:, :-1]], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)[:, past:]
    with active_adapter_fused(model):
        if unique_prompts.shape[0] == prompt_ids.shape[0]:  # nothing shared: one pass over prompt + completion
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids[:, :-1]], dim=1),
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_arg(stem.cache(prompt_ids.shape[0]) if stem else None),
                logits_to_keep=num_completion,
            ).logits
            return _ChosenLogProbs.apply(logits, completion_ids, temperature)
        num_unique = unique_prompts.shape[0]
        prefix = model(
            input_ids=unique_prompts[:, :num_prompt],
            attention_mask=torch.cat([attention_mask[:num_unique, :past], unique_prompts[:, num_prompt:]], dim=1),
            position_ids=position_ids[:, :num_prompt][_first_rows(row_prompt, num_unique)],
            **cache_arg(stem.cache(num_unique) if stem else None),
            use_cache=True,
            logits_to_keep=1,  # the prompt's last position predicts the first completion token
        )
        first = _ChosenLogProbs.apply(prefix.logits[row_prompt], completion_ids[:, :1], temperature)
        if num_completion == 1:
            return first
        cache = cache_of(prefix)
        cache.reorder_cache(row_prompt)
        rest = model(
            input_ids=completion_ids[:, :-1],
            attention_mask=attention_mask,
            position_ids=position_ids[:, num_prompt:],
            **cache_arg(cache),
            logits_to_keep=num_completion - 1,
        ).logits
        return torch.cat([first, _ChosenLogProbs.apply(rest, completion_ids[:, 1:], temperature)], dim=1)


class _ChosenLogProbs(torch.autograd.Function):
    """``log_softmax(logits / temperature).gather(-1, tokens)``, a few rows of logits at a time.

    The (tokens x vocabulary) log-softmax is never held, and the backward writes
    ``(one_hot - softmax) * grad / temperature`` straight into the logits' gradient. Autograd's
    log_softmax + gather would allocate the log-softmax, a zero-filled gradient for the gather and the
    log-softmax's own gradient: three passes over a (tokens x vocabulary) tensor, each slower than the
    whole of this (docs/reports/step-time.md, "Fourth round").
    """

    #: About 4 MB of float32 logits at a time, so that each block's passes stay in cache.
    BLOCK_BYTES = 4 << 20

    @staticmethod
    def _blocks(flat: torch.Tensor) -> Iterator[slice]:
        rows = max(1, _ChosenLogProbs.BLOCK_BYTES // (4 * flat.shape[-1]))
        return (slice(start, start + rows) for start in range(0, flat.shape[0], rows))

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
        flat, index = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        chosen = torch.empty(index.shape, dtype=torch.float32, device=logits.device)
        log_normalizer = torch.empty_like(chosen)  # logsumexp of each row of logits / temperature
        for block in _ChosenLogProbs._blocks(flat):
            scaled = flat[block].float() if temperature == 1.0 else flat[block].float() / temperature
            chosen[block] = torch.log_softmax(scaled, dim=-1).gather(1, index[block])
            log_normalizer[block] = scaled.gather(1, index[block]) - chosen[block]
        ctx.save_for_backward(logits, tokens, log_normalizer)
        ctx.temperature = temperature
        return chosen.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, tokens, log_normalizer = ctx.saved_tensors
        flat, index = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        grad = grad.reshape(-1, 1).float() / ctx.temperature
        grad_logits = torch.empty_like(flat)
        for block in _ChosenLogProbs._blocks(flat):
            out = grad_logits[block] if flat.dtype == torch.float32 else None
            if ctx.temperature == 1.0:
                shifted = torch.sub(flat[block].float(), log_normalizer[block], out=out)
            else:
                shifted = torch.div(flat[block].float(), ctx.temperature, out=out).sub_(log_normalizer[block])
            softmax = shifted.exp_()
            block_grad = softmax.mul_(-grad[block]).scatter_add_(1, index[block], grad[block])
            if out is None:
                grad_logits[block] = block_grad
        return grad_logits.view(logits.shape), None, None


def _first_rows(row_group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """For each group, the index of one row that belongs to it."""
    rows = torch.arange(row_group.shape[0], device=row_group.device)
    return torch.empty(num_groups, dtype=torch.long, device=row_group.device).scatter_(0, row_group, rows)
