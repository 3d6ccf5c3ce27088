"""Policy/value/SFT losses and global-token-mean aggregation against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.algo.losses import (
    actor_loss,
    cispo_loss,
    entropy_from_logits,
    global_token_mean,
    policy_loss,
    ppo_loss,
    sft_loss,
    value_loss,
)

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def logs(ratios):
    """log π and log π_old such that exp(log π − log π_old) = ratios; log π is a leaf with grad."""
    old = torch.full((1, len(ratios)), -1.0)
    new = (old + torch.log(T([ratios]))).requires_grad_(True)
    return new, old


# ρ = [.5, 1, 1.5, 3], A = [1, -1, 1, -1], ε = .2 (band [.8, 1.2])
#   t0: ρA = .5,  clip(ρ)A = .8   -> min .5   -> loss -.5   (below band, A>0: not clipped, gradient flows)
#   t1: ρA = -1,  clip(ρ)A = -1   -> min -1   -> loss  1
#   t2: ρA = 1.5, clip(ρ)A = 1.2  -> min 1.2  -> loss -1.2  (clipped: zero gradient)
#   t3: ρA = -3,  clip(ρ)A = -1.2 -> min -3   -> loss  3;  with dual clip c=2: max(-3, 2·-1) = -2 -> loss 2
RATIOS, ADV = [0.5, 1.0, 1.5, 3.0], T([[1.0, -1.0, 1.0, -1.0]])


def test_ppo_hand_computed():
    loss, clipped = ppo_loss(T(RATIOS), ADV[0], 0.2, 0.2)
    assert close(loss, [-0.5, 1.0, -1.2, 3.0])
    assert clipped.tolist() == [False, False, True, False]
    loss, _ = ppo_loss(T(RATIOS), ADV[0], 0.2, 0.2, dual_clip=2.0)
    assert close(loss, [-0.5, 1.0, -1.2, 2.0])


def test_policy_loss_ppo_value_metrics_and_gradient():
    new, old = logs(RATIOS)
    out = policy_loss(new, old, ADV, torch.ones(1, 4), mode="ppo", clip_low=0.2, clip_high=0.2,
                      global_num_tokens=4, dual_clip=2.0)
    # (-.5 + 1 - 1.2 + 2) / 4 = .325
    assert close(out.loss, 0.325) and close(out.reported_loss, 0.325)
    assert close(out.clip_ratio, 0.25)
    # policy_kl = mean(log π_old − log π) = -mean(log ρ) = -(ln .5 + 0 + ln 1.5 + ln 3)/4
    assert close(out.policy_kl, -(math.log(0.5) + math.log(1.5) + math.log(3.0)) / 4)
    out.loss.backward()
    # d/dlogπ of -ρA/N = -ρA/4: t0 -.5/4 = -.125, t1 +1/4 = .25; t2 clipped 0; t3 dual-clipped (constant c·A) 0
    assert close(new.grad, [[-0.125, 0.25, 0.0, 0.0]])


def test_ppo_band_edges():
    # exactly at the edges the clipped and unclipped terms are equal: not counted as clipped, gradient still flows
    ratio = T([0.8, 1.2], requires_grad=True)
    loss, clipped = ppo_loss(ratio, T([-1.0, 1.0]), 0.2, 0.2)
    assert clipped.tolist() == [False, False]
    loss.sum().backward()
    assert close(ratio.grad, [1.0, -1.0])  # d(-ρA)/dρ = -A
    # just outside: A>0 above the band and A<0 below it are clipped (no gradient); the other sides are not
    new, old = logs([1.21, 0.79, 1.21, 0.79])
    out = policy_loss(new, old, T([[1.0, -1.0, -1.0, 1.0]]), torch.ones(1, 4), mode="ppo", clip_low=0.2,
                      clip_high=0.2, global_num_tokens=4)
    assert close(out.clip_ratio, 0.5)
    out.loss.backward()
    assert close(new.grad, [[0.0, 0.0, 1.21 / 4, -0.79 / 4]])


def test_asymmetric_clip_band():
    # ε_l = .2, ε_h = .28 (DAPO clip-higher): ρ = 1.25 with A>0 is inside the band
    loss, clipped = ppo_loss(T([1.25, 1.3]), T([1.0, 1.0]), 0.2, 0.28)
    assert close(loss, [-1.25, -1.28]) and clipped.tolist() == [False, True]


def test_cispo_hand_computed():
    # ρ = [.5, 2], A = [1, 2], log π = [-1, -.5], ceiling 1.5: w = sg(min(ρ, 1.5)) = [.5, 1.5]
    # loss = -w·A·logπ = [-.5·1·-1, -1.5·2·-.5] = [.5, 1.5]
    loss, clipped = cispo_loss(T([0.5, 2.0]), T([1.0, 2.0]), T([-1.0, -0.5]), 1.5)
    assert close(loss, [0.5, 1.5]) and clipped.tolist() == [False, True]
    # through policy_loss: log π − log π_old = ln ρ with log π = [-1, -.5] -> old = [-1 − ln .5, -.5 − ln 2]
    new = T([[-1.0, -0.5]], requires_grad=True)
    old = T([[-1.0 - math.log(0.5), -0.5 - math.log(2.0)]])
    out = policy_loss(new, old, T([[1.0, 2.0]]), torch.ones(1, 2), mode="cispo", clip_low=0.2, clip_high=1.5,
                      global_num_tokens=2)
    assert close(out.loss, 1.0) and close(out.clip_ratio, 0.5)
    out.loss.backward()
    # d/dlogπ = -w·A/N = [-.5/2, -3/2]: the clipped token still gets gradient (CISPO's point)
    assert close(new.grad, [[-0.25, -1.5]])


def test_gspo_hand_computed():
    # row 0: ℓ = [ln 2, 0] -> s = exp(mean) = √2 ≈ 1.414; A = [1, 1]; clip(s) = 1.2 -> loss [-1.2, -1.2], clipped
    # row 1: ℓ = [.1, -.1] -> s = 1; A = [2, -1] -> loss [-2, 1], gradient -s·A/N per token
    old = torch.zeros(2, 2)
    new = T([[math.log(2.0), 0.0], [0.1, -0.1]], requires_grad=True)
    adv = T([[1.0, 1.0], [2.0, -1.0]])
    out = policy_loss(new, old, adv, torch.ones(2, 2), mode="gspo", clip_low=0.2, clip_high=0.2,
                      global_num_tokens=4)
    assert close(out.loss, (-1.2 - 1.2 - 2.0 + 1.0) / 4)
    assert close(out.clip_ratio, 0.5)
    out.loss.backward()
    assert close(new.grad, [[0.0, 0.0], [-2.0 / 4, 1.0 / 4]])


def test_is_coefficient_scales_the_per_token_loss():
    new, old = logs([1.0, 1.0])
    out = policy_loss(new, old, T([[1.0, 1.0]]), torch.ones(1, 2), mode="ppo", clip_low=0.2, clip_high=0.2,
                      global_num_tokens=2, is_coef=T([[0.5, 0.0]]))
    # loss = (-1·.5 + -1·0)/2 = -.25; the masked-out token gives no gradient
    assert close(out.loss, -0.25)
    out.loss.backward()
    assert close(new.grad, [[-0.25, 0.0]])


def test_non_finite_inputs_are_sanitised():
    new = T([[float("nan"), -1.0, -1.0]], requires_grad=True)
    old = T([[-1.0, float("-inf"), -1.0]])
    adv = T([[1.0, 1.0, float("inf")]])
    out = policy_loss(new, old, adv, torch.ones(1, 3), mode="ppo", clip_low=0.2, clip_high=0.2, global_num_tokens=3)
    # t0: ℓ NaN -> 0, ρ = 1 -> -1; t1: ℓ = +∞ -> 30, ρ huge, A>0 -> clipped at 1.2 -> -1.2; t2: A = inf -> 0
    assert torch.isfinite(out.loss) and close(out.loss, (-1.0 - 1.2) / 3)


def test_masked_tokens_do_not_contribute():
    new, old = logs([1.0, 5.0])
    out = policy_loss(new, old, T([[1.0, 100.0]]), T([[1, 0]]), mode="ppo", clip_low=0.2, clip_high=0.2,
                      global_num_tokens=1)
    assert close(out.loss, -1.0) and close(out.clip_ratio, 0.0)


def test_unknown_loss_mode():
    new, old = logs([1.0])
    with pytest.raises(ValueError, match="unknown policy loss mode 'dpo'"):
        policy_loss(new, old, T([[1.0]]), T([[1]]), mode="dpo", clip_low=0.2, clip_high=0.2, global_num_tokens=1)


# --------------------------------------------------------------------------------------------------- aggregation
def test_global_token_mean_hand_computed():
    # Σ masked = 1 + 3 = 4 over a global window of 8 tokens on dp = 2 -> 4/8·2 = 1
    loss = global_token_mean(T([[1.0, 2.0], [3.0, 4.0]]), T([[1, 0], [1, 0]]), 8, dp_size=2)
    assert close(loss, 1.0)
    zero = global_token_mean(T([[1.0]], requires_grad=True), T([[0]]), 0)
    assert zero.item() == 0.0 and zero.requires_grad


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 6), st.integers(1, 7), st.integers(1, 3), st.integers(0, 10_000))
def test_accumulation_and_dp_match_the_full_batch_token_mean(B, T_len, dp, seed):
    """Splitting a batch across dp ranks × micro-batches and summing the per-micro-batch backward passes (with the
    gradient averaged over ranks, as FSDP does) gives the gradient of the plain token mean over the whole batch."""
    g = torch.Generator().manual_seed(seed)
    B = B * dp
    mask = (torch.rand(B, T_len, generator=g) > 0.4).float()
    mask[0, 0] = 1.0
    logp = (-torch.rand(B, T_len, generator=g) * 2).requires_grad_(True)
    old = logp.detach() + torch.randn(B, T_len, generator=g) * 0.1
    adv = torch.randn(B, T_len, generator=g)
    kwargs = dict(mode="ppo", clip_low=0.2, clip_high=0.28, dual_clip=3.0)

    full = policy_loss(logp, old, adv, mask, global_num_tokens=mask.sum(), **kwargs).loss
    (full_grad,) = torch.autograd.grad(full, logp)

    n_global = mask.sum()
    per_rank = B // dp
    grad = torch.zeros_like(logp)
    for rank in range(dp):
        rank_grad = torch.zeros_like(logp)
        for mb in range(rank * per_rank, (rank + 1) * per_rank):  # micro-batch of one sample
            sl = slice(mb, mb + 1)
            loss = policy_loss(logp[sl], old[sl], adv[sl], mask[sl], global_num_tokens=n_global, dp_size=dp,
                               **kwargs).loss
            rank_grad += torch.autograd.grad(loss, logp)[0]
        grad += rank_grad / dp  # the data-parallel all-reduce averages
    assert torch.allclose(grad, full_grad, atol=1e-6)


# --------------------------------------------------------------------------------------------------- entropy, value, sft
def test_entropy_from_logits():
    # uniform over 2 -> ln 2; probs (.75, .25) from logits (ln 3, 0): -(.75 ln .75 + .25 ln .25) ≈ .562335
    logits = T([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    h = entropy_from_logits(logits)
    assert close(h, [[math.log(2.0), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]])
    # τ = 2 halves the logits: (ln 3 / 2, 0) -> probs (√3, 1)/(√3 + 1)
    p = math.sqrt(3) / (math.sqrt(3) + 1)
    assert close(entropy_from_logits(logits, temperature=2.0)[0, 1], -(p * math.log(p) + (1 - p) * math.log(1 - p)))


def test_actor_loss_adds_kl_and_subtracts_entropy():
    new, old = logs([1.0, 1.0])
    ref = new.detach() - T([[0.5, -1.0]])  # r = log π − log π_ref = [.5, -1] -> k2 = [.125, .5]
    entropy = T([[2.0, 4.0]])
    out = actor_loss(new, old, T([[1.0, 1.0]]), torch.ones(1, 2), mode="ppo", clip_low=0.2, clip_high=0.2,
                     global_num_tokens=2, ref_log_probs=ref, kl_coef=0.1, kl_estimator="k2", entropy=entropy,
                     entropy_coef=0.01)
    # policy (-1 - 1)/2 = -1; KL .1·(.125 + .5)/2 = .03125; entropy .01·(2 + 4)/2 = .03
    assert close(out.loss, -1.0 + 0.03125 - 0.03)
    assert close(out.metrics["kl_loss"], 0.3125) and close(out.metrics["entropy"], 3.0)
    # β = 0 drops the KL term entirely
    out0 = actor_loss(new, old, T([[1.0, 1.0]]), torch.ones(1, 2), mode="ppo", clip_low=0.2, clip_high=0.2,
                      global_num_tokens=2, ref_log_probs=ref, kl_coef=0.0)
    assert close(out0.loss, -1.0) and "kl_loss" not in out0.metrics


def test_value_loss_hand_computed():
    # t0: (1-2)² = 1; clipped V = .5 + clamp(.5, ±.2) = .7 -> (.7-2)² = 1.69 -> .5·1.69 = .845
    # t1: (2-1)² = 1; V - V_old = 0 -> same -> .5
    loss, clip_frac = value_loss(T([[1.0, 2.0]]), T([[0.5, 2.0]]), T([[2.0, 1.0]]), torch.ones(1, 2),
                                 value_clip=0.2, global_num_tokens=2)
    assert close(loss, (0.845 + 0.5) / 2) and close(clip_frac, 0.5)


def test_sft_loss_is_token_mean_nll():
    # -(−1 − 3)/2 over the two loss tokens
    assert close(sft_loss(T([[-1.0, -2.0, -3.0]]), T([[1, 0, 1]]), global_num_tokens=2), 2.0)
