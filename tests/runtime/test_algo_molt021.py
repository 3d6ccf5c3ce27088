"""Molt 0.2.1's new math against the reference's test vectors (reference/molt_0_2_1.md §3, §5)."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.algo import aggregation, mismatch, penalties
from runtime.algo.advantages import compute_advantages, flash_reinforce
from runtime.algo.is_correction import divergence, is_correction
from runtime.algo.kl import kl_estimate
from runtime.algo.reward import prepare_rewards
from runtime.algo.score_centering import centering, weight_fn


def test_flash_reinforce_vector():
    adv = flash_reinforce(torch.tensor([1.0, 0, 0, 1, 1]))
    assert torch.allclose(adv, torch.tensor([0.4, -0.6, -0.6, 0.4, 0.4]))


def test_flash_reinforce_through_dispatch_is_per_sample_and_unwhitened():
    mask = torch.ones(5, 3, dtype=torch.bool)
    r = prepare_rewards("flash_reinforce", torch.tensor([1.0, 0, 0, 1, 1]), list("abcde"), list("ggggg"), (-10, 10))
    out = compute_advantages("flash_reinforce", r, mask, whiten_advantages=True)
    assert torch.allclose(out.advantages[:, 0], torch.tensor([0.4, -0.6, -0.6, 0.4, 0.4]))
    assert torch.allclose(flash_reinforce(torch.tensor([1.0, 1.0])), torch.zeros(2))  # one outcome class


def _agg_batch():
    # g1: a row of 1 token (loss 1) and a row of 3 tokens (loss 3 each); g2: a row of 2 tokens (loss 0)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    loss = torch.tensor([[1.0, 9, 9], [3, 3, 3], [0, 0, 9]])
    return loss, mask, torch.tensor([1, 1, 2])


@pytest.mark.parametrize(("mode", "expected"), [("token-mean", 10 / 6), ("seq-mean-token-mean", 4 / 3),
                                                ("prompt-mean-token-mean", 1.25)])
def test_aggregation_vectors(mode, expected):
    loss, mask, groups = _agg_batch()
    stats = aggregation.window_stats(mask, groups)
    w = aggregation.row_weights(mode, mask, groups, stats)
    assert aggregation.aggregate(loss, mask, w).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", aggregation.AGG_MODES)
def test_aggregation_is_split_invariant_over_micro_batches_and_ranks(mode):
    """Split the window into two "ranks" (rows 0 | rows 1-2), each backpropagating D·its share: the mean over D of the
    shares (FSDP's gradient average) equals the one-rank objective."""
    loss, mask, groups = _agg_batch()
    parts = [slice(0, 1), slice(1, 3)]
    stats = aggregation.merge(aggregation.window_stats(mask[p], groups[p]) for p in parts)
    whole = aggregation.aggregate(loss, mask, aggregation.row_weights(mode, mask, groups, stats))
    shares = [aggregation.aggregate(loss[p], mask[p], aggregation.row_weights(mode, mask[p], groups[p], stats),
                                    dp_size=2) for p in parts]
    assert (sum(shares) / 2).item() == pytest.approx(whole.item(), rel=1e-6)


def test_gating_vectors():
    lmu, lo = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.6]]))
    assert torch.exp(lo - lmu).item() == pytest.approx(1.2)
    assert divergence(lo, lmu, "binary_kl").item() == pytest.approx(0.020411, abs=1e-6)
    assert divergence(lo, lmu, "tv").item() == pytest.approx(0.1, abs=1e-6)


def test_divergence_gate_masks_by_sequence_and_keeps_the_ratio():
    lmu = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    lo = torch.log(torch.tensor([[0.6, 0.6], [0.5, 0.5]]))  # row 0 drifts, row 1 is on-policy
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = is_correction(lo, lmu, mask, level="seq", mode="mask", low=None, high=5e-3, gating="binary_kl")
    assert torch.allclose(out.coef, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert out.is_filter_ratio.item() == pytest.approx(0.5)  # per sequence
    tok = is_correction(lo, lmu, mask, level="token", mode="mask", low=None, high=0.2, gating="tv")
    assert torch.allclose(tok.coef, torch.tensor([[1.2, 1.2], [1.0, 1.0]]))  # survivors carry their ratio
    with pytest.raises(ValueError, match="only mode 'mask'"):
        is_correction(lo, lmu, mask, level="token", mode="clip", low=None, high=0.2, gating="tv")


def test_kl_rollout_vectors():
    pi, mu = torch.log(torch.tensor([0.6])), torch.log(torch.tensor([0.5]))
    assert (pi - mu).item() == pytest.approx(0.182322, abs=1e-6)
    assert kl_estimate(pi, mu, "k3", ref="rollout").item() == pytest.approx(0.017678, abs=1e-6)
    assert kl_estimate(pi, mu, "k3", ref="model").item() == pytest.approx(0.015655, abs=1e-6)


def test_k3_rollout_gradient_descends_kl_rollout_to_policy():
    """E_{y~μ}[∇ k3_rollout] = +∇KL(μ‖π): one descent step on it lowers KL(μ‖π)."""
    mu = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.tensor([0.3, 0.1, -0.2], requires_grad=True)
    log_pi = torch.log_softmax(logits, -1)
    loss = (mu * kl_estimate(log_pi, mu.log(), "k3", ref="rollout")).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    kl = lambda z: (mu * (mu.log() - torch.log_softmax(z, -1))).sum()  # noqa: E731
    assert kl(logits.detach() - 0.1 * grad) < kl(logits.detach())


def test_score_centering_vector_and_zero_expected_gradient():
    q, p = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.5, 0.2, 0.3])
    head = torch.tensor([0, 1])
    out = centering(p.log()[head].view(1, 1, 2), q.log()[head].view(1, 1, 2), torch.ones(1, 1), mode="none",
                    low=None, high=1.0)
    assert out.correction.item() == pytest.approx(-0.383764, abs=1e-6)
    assert out.sampler_head_mass.item() == pytest.approx(0.8)
    # Expected logit gradient of A·(−log p_y + c) over y ~ q with the tail modelled as ρ·p: zero when exact.
    logits = p.log().clone().requires_grad_(True)
    log_p = torch.log_softmax(logits, -1)
    c = centering(log_p[head].view(1, 1, 2), q.log()[head].view(1, 1, 2), torch.ones(1, 1), mode="none", low=None,
                  high=1.0).correction.sum()
    expected = -(q * log_p).sum() + c  # E_q[−log p_y] + c, with ratio 1
    (grad,) = torch.autograd.grad(expected, logits)
    # the tail (id 2) is q_2 = ρ·p_2 only approximately here (0.2 vs 2/3·0.3 = 0.2): exact, so the gradient is 0
    assert grad.abs().max().item() < 1e-6


def test_weight_functions():
    x = torch.tensor([0.2, 1.0, 3.0])
    assert torch.equal(weight_fn(x, "trunc", None, 2.0), torch.tensor([0.2, 1.0, 2.0]))
    assert torch.equal(weight_fn(x, "clip", 0.5, 2.0), torch.tensor([0.5, 1.0, 2.0]))
    assert torch.equal(weight_fn(x, "mask", 0.5, 2.0), torch.tensor([0.0, 1.0, 0.0]))


def test_overlong_vector():
    r = torch.zeros(3)
    shaped, pen = penalties.overlong_penalty(r, torch.tensor([3584.0, 3840, 4096]), buffer_len=512, factor=1.0,
                                             max_len=4096)
    assert torch.allclose(shaped, torch.tensor([0.0, -0.5, -1.0])) and torch.allclose(pen, shaped)


def test_stop_properly_scale_and_replace():
    r, trunc = torch.tensor([1.0, 1.0, -0.5]), torch.tensor([True, False, True])
    assert torch.allclose(penalties.stop_properly_penalty(r, trunc, coef=0.5)[0], torch.tensor([0.5, 1.0, -0.25]))
    assert torch.allclose(penalties.stop_properly_penalty(r, trunc, coef=-1.0)[0], torch.tensor([-1.0, 1.0, -1.0]))


def test_peak_and_truncated_per_rollout():
    s2r = torch.tensor([0, 0, 1])
    assert torch.equal(penalties.peak_per_rollout(torch.tensor([10, 30, 5]), s2r, 2), torch.tensor([30.0, 5.0]))
    assert torch.equal(penalties.truncated_per_rollout(torch.tensor([False, True, False]), s2r, 2),
                       torch.tensor([True, False]))


def test_mismatch_vector():
    m = mismatch.mismatch_metrics(torch.tensor([[-1.0, -2.0000002, -3.5]]), torch.tensor([[-1.0, -2.0, -3.0]]),
                                  torch.ones(1, 3, dtype=torch.bool))
    assert m["mismatch/bitwise_frac"] == pytest.approx(2 / 3, abs=1e-6)
    assert m["mismatch/abs_diff_mean"] == pytest.approx(0.166667, abs=1e-6)
    assert m["mismatch/k3_kl"] == pytest.approx(0.035510, abs=1e-6)
    assert math.isfinite(m["mismatch/k3_kl"])
