"""The per-agent policy loss (paper Eq. 2): gradients, clipping, KL, masks and micro-batching.

Tensors are float64 so that hand-computed gradients can be compared tightly.
"""

from __future__ import annotations

import math

import pytest
import torch

from teamrl.algorithms.losses import AGGREGATIONS, kl_k3, loss_normalizer, policy_loss

AGGS = ["token_sum", "sequence_mean", "token_mean"]
D = torch.float64

# 3 completions of 3, 2 and 4 trained tokens (9 in all), padded to C = 4
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
ADV = torch.tensor([2.0, -1.0, 0.5], dtype=D)
LOGPROBS = torch.tensor([[-0.5, -1.0, -2.0, -3.0], [-0.1, -4.0, -0.7, -0.2], [-1.5, -0.3, -0.9, -2.2]], dtype=D)


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def test_aggregations_registered():
    assert set(AGGS) <= set(AGGREGATIONS)


def test_unknown_aggregation():
    lp = LOGPROBS.clone().requires_grad_()
    with pytest.raises(ValueError, match="logprob_aggregation"):
        policy_loss(lp, LOGPROBS, ADV, MASK, aggregation="token_max", normalizer=1.0)


def test_loss_normalizer():
    # sequences for token_sum / sequence_mean, trained tokens for token_mean
    assert loss_normalizer([MASK], "token_sum") == 3.0
    assert loss_normalizer([MASK], "sequence_mean") == 3.0
    assert loss_normalizer([MASK], "token_mean") == 9.0
    # over several micro-batches (of different widths): the whole update's count
    other = torch.tensor([[1, 0], [1, 1]])
    assert loss_normalizer([MASK, other], "token_sum") == 5.0
    assert loss_normalizer([MASK, other], "token_mean") == 12.0


@pytest.mark.parametrize(
    ("aggregation", "expected_grad", "expected_loss"),
    [
        # d loss / d logprob = -A_b / normalizer (= 3 sequences) on every trained token
        # loss = -(2*3 - 1*2 + 0.5*4) / 3 = -2
        ("token_sum", [[-2 / 3] * 3 + [0], [1 / 3] * 2 + [0, 0], [-0.5 / 3] * 4], -2.0),
        # -A_b / (n_b * 3): n = 3, 2, 4 ; loss = -(2 - 1 + 0.5) / 3 = -0.5
        ("sequence_mean", [[-2 / 9] * 3 + [0], [1 / 6] * 2 + [0, 0], [-0.5 / 12] * 4], -0.5),
        # -A_b / 9 tokens ; loss = -(6 - 2 + 2) / 9 = -2/3
        ("token_mean", [[-2 / 9] * 3 + [0], [1 / 9] * 2 + [0, 0], [-0.5 / 9] * 4], -2 / 3),
    ],
)
def test_on_policy_gradient_is_minus_advantage_over_normalizer(aggregation, expected_grad, expected_loss):
    lp = LOGPROBS.clone().requires_grad_()
    normalizer = loss_normalizer([MASK], aggregation)
    loss, stats = policy_loss(lp, LOGPROBS.clone(), ADV, MASK, aggregation=aggregation, normalizer=normalizer)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor(expected_grad, dtype=D), atol=1e-12, rtol=0)
    assert stats["clip_fraction"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(1.0)
    assert stats["tokens"] == 9.0


def test_sequence_mean_with_an_empty_completion_is_finite_and_zero():
    mask = torch.tensor([[1, 1], [0, 0]])
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], dtype=D, requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach().clone(), torch.tensor([1.0, 5.0], dtype=D), mask,
                          aggregation="sequence_mean", normalizer=2.0)
    # only row 0 counts: -1 / 2 ; its gradient -1 / (2 tokens * 2)
    assert loss.item() == pytest.approx(-0.5)
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[-0.25, -0.25], [0.0, 0.0]], dtype=D))


# ------------------------------------------------------------------------------------------------
# clipping
# ------------------------------------------------------------------------------------------------

RATIOS = [1.5, 1.1, 0.5, 0.9]


def ratio_batch(ratios, advantages):
    old = torch.full((len(advantages), len(ratios)), -1.0, dtype=D)
    lp = (old + torch.log(torch.tensor(ratios, dtype=D))).requires_grad_()
    return lp, old, torch.tensor(advantages, dtype=D), torch.ones_like(old, dtype=torch.long)


def test_clipping_symmetric():
    # row 0: A = +1 ; row 1: A = -1 ; token ratios 1.5, 1.1, 0.5, 0.9 ; eps 0.2 ; normalizer 2
    lp, old, adv, mask = ratio_batch(RATIOS, [1.0, -1.0])
    loss, stats = policy_loss(lp, old, adv, mask, aggregation="token_sum", normalizer=2.0)
    # d(-ratio * A)/d logprob = -A * ratio when unclipped, 0 when the clipped branch is the minimum.
    # row 0 (A>0): 1.5 > 1.2 clipped -> 0 ; 1.1 -> -1.1 ; 0.5 (below, but A>0) -> -0.5 ; 0.9 -> -0.9
    # row 1 (A<0): 1.5 (above, but A<0) -> +1.5 ; 1.1 -> +1.1 ; 0.5 < 0.8 clipped -> 0 ; 0.9 -> +0.9
    expected = torch.tensor([[0.0, -1.1, -0.5, -0.9], [1.5, 1.1, 0.0, 0.9]], dtype=D) / 2
    torch.testing.assert_close(grad_of(loss, lp), expected, atol=1e-12, rtol=0)
    # token losses: row 0: -(1.2 + 1.1 + 0.5 + 0.9) = -3.7 ; row 1: 1.5 + 1.1 + 0.8 + 0.9 = 4.3 ; (0.6) / 2
    assert loss.item() == pytest.approx(0.3, abs=1e-12)
    assert stats["clip_fraction"] == pytest.approx(2 / 8)
    assert stats["ratio_mean"] == pytest.approx(sum(RATIOS) / 4)


@pytest.mark.parametrize(
    ("ratio", "adv", "eps_low", "eps_high", "clipped"),
    [
        (1.25, 1.0, 0.2, 0.28, False),   # inside the wider upper bound
        (1.30, 1.0, 0.2, 0.28, True),    # above 1.28
        (1.25, 1.0, 0.28, 0.2, True),    # eps_low must not widen the upper bound
        (0.85, -1.0, 0.1, 0.5, True),    # below 1 - 0.1
        (0.85, -1.0, 0.2, 0.1, False),   # inside 1 - 0.2, eps_high irrelevant
        (1.40, 1.0, 0.1, 0.5, False),    # inside 1 + 0.5
        (0.50, 1.0, 0.1, 0.1, False),    # far below but A > 0: never clipped
        (3.00, -1.0, 0.1, 0.1, False),   # far above but A < 0: never clipped
    ],
)
def test_clipping_asymmetric(ratio, adv, eps_low, eps_high, clipped):
    lp, old, advantages, mask = ratio_batch([ratio], [adv])
    loss, stats = policy_loss(lp, old, advantages, mask, aggregation="token_sum", normalizer=1.0,
                              epsilon_low=eps_low, epsilon_high=eps_high)
    grad = grad_of(loss, lp).item()
    if clipped:
        assert grad == 0.0
        assert stats["clip_fraction"] == 1.0
        bound = 1 + eps_high if adv > 0 else 1 - eps_low
        assert loss.item() == pytest.approx(-bound * adv)
    else:
        assert grad == pytest.approx(-adv * ratio)
        assert stats["clip_fraction"] == 0.0
        assert loss.item() == pytest.approx(-adv * ratio)


# ------------------------------------------------------------------------------------------------
# KL
# ------------------------------------------------------------------------------------------------


def test_kl_k3_values():
    lp = torch.log(torch.tensor([0.5, 0.25, 0.3], dtype=D))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3], dtype=D))
    # d = log ref - log pi: log 0.5 -> 0.5 + ln 2 - 1 = 0.19314718 ; log 2 -> 2 - ln 2 - 1 = 0.30685282 ; 0 -> 0
    torch.testing.assert_close(kl_k3(lp, ref), torch.tensor([0.5 + math.log(2) - 1, 1 - math.log(2), 0.0], dtype=D))
    assert kl_k3(lp, lp).abs().max().item() == 0.0
    other = torch.randn(50, dtype=D)
    assert (kl_k3(other, other + torch.randn(50, dtype=D)) > 0).all()


def test_kl_term_added_to_loss():
    lp = torch.log(torch.tensor([[0.5, 0.25, 0.9]], dtype=D)).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.1]], dtype=D))
    mask = torch.tensor([[1, 1, 0]])  # third token untrained: its (large) KL must not count
    adv = torch.tensor([1.0], dtype=D)
    base, _ = policy_loss(lp, lp.detach(), adv, mask, aggregation="token_sum", normalizer=1.0)
    with_kl, stats = policy_loss(lp, lp.detach(), adv, mask, aggregation="token_sum", normalizer=1.0,
                                 ref_logprobs=ref, kl_coef=0.1)
    k3 = (0.5 + math.log(2) - 1) + (1 - math.log(2))  # = 0.5
    assert (with_kl - base).item() == pytest.approx(0.1 * k3, abs=1e-12)
    assert stats["kl"] == pytest.approx(k3 / 2)
    # d k3 / d logprob = 1 - exp(ref - logprob): 1 - 0.5 = 0.5 ; 1 - 2 = -1
    expected = torch.tensor([[-1 + 0.1 * 0.5, -1 + 0.1 * -1.0, 0.0]], dtype=D)
    torch.testing.assert_close(grad_of(with_kl, lp), expected, atol=1e-12, rtol=0)
    # kl_coef = 0 turns it off even with a reference
    off, stats_off = policy_loss(lp, lp.detach(), adv, mask, aggregation="token_sum", normalizer=1.0,
                                 ref_logprobs=ref, kl_coef=0.0)
    assert off.item() == base.item()
    assert "kl" not in stats_off


# ------------------------------------------------------------------------------------------------
# masks: untrained positions get exactly zero gradient whatever they hold
# ------------------------------------------------------------------------------------------------


def _garbage_case(garbage_lp, garbage_old, garbage_ref=None, kl_coef=0.0, aggregation="token_sum"):
    clean = LOGPROBS.clone()
    old = LOGPROBS.clone() - 0.05
    ref = LOGPROBS.clone() - 0.3
    dirty_lp, dirty_old, dirty_ref = clean.clone(), old.clone(), ref.clone()
    untrained = MASK == 0
    dirty_lp[untrained] = torch.tensor(garbage_lp, dtype=D)
    dirty_old[untrained] = torch.tensor(garbage_old, dtype=D)
    if garbage_ref is not None:
        dirty_ref[untrained] = torch.tensor(garbage_ref, dtype=D)
    norm = loss_normalizer([MASK], aggregation)
    results = []
    for lp_values, old_values, ref_values in ((clean, old, ref), (dirty_lp, dirty_old, dirty_ref)):
        lp = lp_values.clone().requires_grad_()
        loss, _ = policy_loss(lp, old_values, ADV, MASK, aggregation=aggregation, normalizer=norm,
                              ref_logprobs=ref_values if kl_coef else None, kl_coef=kl_coef)
        results.append((loss, grad_of(loss, lp)))
    (clean_loss, clean_grad), (dirty_loss, dirty_grad) = results
    assert torch.isfinite(dirty_grad).all(), dirty_grad
    assert torch.isfinite(dirty_loss)
    assert (dirty_grad[untrained] == 0).all()
    assert dirty_loss.item() == clean_loss.item()
    assert torch.equal(dirty_grad, clean_grad)


@pytest.mark.parametrize("aggregation", AGGS)
def test_masked_positions_with_finite_garbage(aggregation):
    # untrained positions: (row 0, col 3), (row 1, col 2), (row 1, col 3)
    _garbage_case([1e9, -1e9, 1e9], [-1e9, 1e9, 3.0], aggregation=aggregation)


def test_masked_positions_with_infinite_logprobs():
    inf = float("inf")
    _garbage_case([-inf, -inf, inf], [-inf, 0.0, -inf])


@pytest.mark.parametrize(
    ("garbage_lp", "garbage_ref"),
    [
        ([-1e4, -1e4, 50.0], None),          # garbage in the policy's log-probs, clean reference
        ([0.0, 0.0, 0.0], [1e9, 1e9, -1e9]),  # garbage in the reference's log-probs
    ],
    ids=["garbage-logprobs", "garbage-ref"],
)
def test_masked_positions_with_garbage_under_kl(garbage_lp, garbage_ref):
    _garbage_case(garbage_lp, [0.0, 0.0, 0.0], garbage_ref=garbage_ref, kl_coef=0.1)


def test_masked_positions_moderate_garbage_under_kl():
    # values a real model can produce at untrained positions (no overflow): still no leak
    _garbage_case([-30.0, 0.0, -1.0], [-2.0, -40.0, 0.0], garbage_ref=[-25.0, -0.5, -60.0], kl_coef=0.1)


# ------------------------------------------------------------------------------------------------
# micro-batching
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_micro_batches_sum_to_the_full_batch(aggregation, kl_coef):
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    values = -torch.rand(5, 5, generator=gen, dtype=D) * 3
    old = values + (torch.rand(5, 5, generator=gen, dtype=D) - 0.5)  # ratios in [0.6, 1.65]: some clipped
    ref = values + (torch.rand(5, 5, generator=gen, dtype=D) - 0.5)
    adv = torch.tensor([1.0, -2.0, 0.5, -0.3, 1.5], dtype=D)
    kwargs = dict(aggregation=aggregation, ref_logprobs=None, kl_coef=kl_coef)

    full_lp = values.clone().requires_grad_()
    norm = loss_normalizer([mask], aggregation)
    full_loss, full_stats = policy_loss(full_lp, old, adv, mask, normalizer=norm,
                                        **{**kwargs, "ref_logprobs": ref})
    full_loss.backward()
    assert full_stats["clip_fraction"] > 0  # the case exercises clipping

    micro_lp = values.clone().requires_grad_()
    parts = [torch.arange(0, 2), torch.arange(2, 5)]
    norm_micro = loss_normalizer([mask[rows] for rows in parts], aggregation)
    assert norm_micro == norm
    total = 0.0
    for rows in parts:
        loss, _ = policy_loss(micro_lp[rows], old[rows], adv[rows], mask[rows], normalizer=norm_micro,
                              **{**kwargs, "ref_logprobs": ref[rows]})
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full_loss.item(), abs=1e-12)
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, atol=1e-12, rtol=0)
