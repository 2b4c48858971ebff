"""The losses an agent's update minimises, selectable by name (:data:`LOSSES`), and their pieces.

``policy_gradient``, the per-agent policy loss of paper Eq. 2 with PPO-style clipping and an optional KL
penalty: with one pass over the rollout the ratio is exactly 1 and the gradient is that of
A * log pi(a | o). Later passes over the same rollout are off-policy and the clipped ratio keeps them close
to the sampling policy. ``dpo``, multi-agent DPO's loss on pairs of completions (:mod:`teamrl.algorithms.madpo`).

Both update paths (:func:`teamrl.algorithms.update.update_agent` and :mod:`teamrl.algorithms.fast_update`)
run whichever loss ``AgentBackend.update(..., loss=name)`` names, on micro-batches of rows that each carry
one value (the advantage of ``policy_gradient``, the pair's offset of ``dpo``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from teamrl.registry import AGGREGATIONS, Registry

if TYPE_CHECKING:
    from teamrl.config import AlgorithmConfig

Aggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
register_aggregation = AGGREGATIONS.register
"""``@register_aggregation(name, per_token=False)``: make a ((B, C) token loss, (B, C) mask) -> summed loss function
selectable. The summed loss of an update is divided by its number of examples, or with ``per_token=True`` by its
number of completion tokens (:func:`loss_normalizer`)."""


@register_aggregation("token_sum")
def token_sum(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over a sequence's tokens (log pi of the whole completion, as in the paper), summed over sequences."""
    return (token_loss * mask).sum()


@register_aggregation("sequence_mean")
def sequence_mean(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's tokens, summed over sequences (the original GRPO)."""
    return ((token_loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()


# 'token_mean' (DAPO) sums like 'token_sum'; it differs in its normalizer: tokens of the batch, not sequences.
register_aggregation("token_mean", per_token=True)(token_sum)


def loss_normalizer(masks: list[torch.Tensor], aggregation: str, rows_per_example: int = 1) -> float:
    """What the summed loss of a whole update is divided by: its token count for 'token_mean', else its examples
    (sequences, or pairs of them for a loss with ``rows_per_example`` = 2).

    Computed once over all micro-batches, so accumulating micro-batch gradients gives exactly the
    gradient of the full batch.
    """
    if AGGREGATIONS.properties(aggregation).get("per_token"):
        return float(sum(int(m.sum()) for m in masks))
    return float(sum(m.shape[0] for m in masks)) / rows_per_example


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate exp(d) - d - 1 with d = log pi_ref - log pi: unbiased and >= 0."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str,
    normalizer: float,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of one micro-batch, and statistics for logging.

    Args:
        logprobs: (B, C) log pi_theta of the completion tokens (with grad).
        old_logprobs: (B, C) log-probs under the policy that sampled them (no grad).
        advantages: (B,) one advantage per completion, shared by all its tokens.
        mask: (B, C) 1 on trained tokens: only these contribute, everything else gets exactly zero gradient.
        aggregation: a name in :data:`AGGREGATIONS`.
        normalizer: :func:`loss_normalizer` of the whole update this micro-batch belongs to.
    """
    aggregate = AGGREGATIONS.lookup(aggregation)
    keep = mask.bool()
    mask = mask.to(logprobs.dtype)
    # Untrained positions are replaced (not multiplied) by zeros before exp(): whatever they hold,
    # even -inf, cannot become inf * 0 = nan and must not reach the gradient.
    logprobs = torch.where(keep, logprobs, torch.zeros_like(logprobs))
    log_ratio = logprobs - torch.where(keep, old_logprobs, torch.zeros_like(old_logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
    token_loss = -torch.minimum(unclipped, clipped)
    kl = None
    if ref_logprobs is not None and kl_coef > 0:
        kl = kl_k3(logprobs, torch.where(keep, ref_logprobs, torch.zeros_like(ref_logprobs))) * mask
        token_loss = token_loss + kl_coef * kl
    loss = aggregate(token_loss, mask) / normalizer
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        was_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
        stats = {
            "clip_fraction": float((was_clipped * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "tokens": float(mask.sum()),
        }
        if kl is not None:
            stats["kl"] = float(kl.sum() / tokens)
    return loss, stats


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class UpdateLoss:
    """A loss an agent's update can minimise, and what the update loops need to know about it."""

    compute: LossFn
    """``(logprobs, old_logprobs, values, mask, *, config, normalizer, ref_logprobs)`` -> one micro-batch's loss
    (already divided by ``normalizer``) and its statistics, with at least ``clip_fraction`` and ``tokens``."""
    rows_per_example: int = 1
    """Rows one term of the loss reads together (2: a preferred and a rejected completion); micro-batches
    never split them, and :func:`loss_normalizer` counts examples."""
    linear_in_values: bool = True
    """All-zero values give exactly zero gradient (without a KL term): the update skips such a micro-batch."""


LOSSES: Registry[LossFn] = Registry("update loss", "loss")
"""The losses an update can minimise (``AgentBackend.update(..., loss=name)``), with their :class:`UpdateLoss`
settings as properties."""


def register_loss(name: str, *, rows_per_example: int = 1, linear_in_values: bool = True) -> Callable[[LossFn], LossFn]:
    """``@register_loss(name)``: make a loss function selectable as ``AgentBackend.update(..., loss=name)``;
    ``rows_per_example`` and ``linear_in_values`` as :class:`UpdateLoss` says."""
    return LOSSES.register(name, rows_per_example=rows_per_example, linear_in_values=linear_in_values)


def update_loss(name: str) -> UpdateLoss:
    """The registered loss ``name`` with its settings."""
    return UpdateLoss(LOSSES.lookup(name), **LOSSES.properties(name))


def contributes(loss: UpdateLoss, values: torch.Tensor, kl_coef: float) -> bool:
    """Whether a micro-batch with these values can move the weights (a zero advantage cannot, without KL)."""
    return kl_coef > 0 or not loss.linear_in_values or bool(values.any())


@register_loss("policy_gradient")
def policy_gradient(logprobs: torch.Tensor, old_logprobs: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
                    config: AlgorithmConfig, normalizer: float, ref_logprobs: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Paper Eq. 2 (:func:`policy_loss`) with the run's settings; ``values`` are the rows' advantages."""
    return policy_loss(logprobs, old_logprobs, values, mask, aggregation=config.logprob_aggregation,
                       normalizer=normalizer, epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
                       ref_logprobs=ref_logprobs, kl_coef=config.kl_coef)


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) log pi of each whole completion: the sum of its trained tokens' (B, C) log-probs (the others are
    replaced, not multiplied: they may hold -inf)."""
    return torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)).sum(dim=1)


def dpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, offsets: torch.Tensor, beta: float) -> torch.Tensor:
    """Per pair, -log sigma(beta * (chosen - rejected + offset)).

    ``chosen``, ``rejected``: the trained agent's log pi of its part of the preferred and of the rejected joint
    action; ``offsets``: every other term of the margin, constants of this update (minus the agent's reference
    log-ratio, and under 'joint' coupling the other agents' log-ratio margins: :mod:`teamrl.algorithms.madpo`).
    """
    return -F.logsigmoid(beta * (chosen - rejected + offsets))


@register_loss("dpo", rows_per_example=2, linear_in_values=False)
def dpo(logprobs: torch.Tensor, old_logprobs: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *,
        config: AlgorithmConfig, normalizer: float, ref_logprobs: torch.Tensor | None = None,
        ) -> tuple[torch.Tensor, dict[str, float]]:
    """Multi-agent DPO (:func:`dpo_loss`, ``algorithm.dpo.beta``) on rows that come in (preferred, rejected) pairs,
    the pair's offset in both rows' ``values``; a completion's log pi sums its trained tokens."""
    sequence = sequence_logprobs(logprobs, mask)
    losses = dpo_loss(sequence[0::2], sequence[1::2], values[0::2].to(sequence.dtype), config.dpo.beta)
    return losses.sum() / normalizer, {"clip_fraction": 0.0, "tokens": float(mask.sum())}
