"""KL estimators and controllers, and IS correction level × mode, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from runtime.algo.is_correction import is_correction
from runtime.algo.kl import AdaptiveKLController, FixedKLController, kl_estimate, make_kl_controller

T = torch.tensor
E = math.e


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


# --------------------------------------------------------------------------------------------------- KL estimators
# log π = [-1, -2, -.5], log π_ref = [-1.5, -1, -.5] -> r = [.5, -1, 0]
LOGP, REF = T([[-1.0, -2.0, -0.5]]), T([[-1.5, -1.0, -0.5]])


def test_k1_k2_k3_hand_computed():
    assert close(kl_estimate(LOGP, REF, "k1"), [[0.5, -1.0, 0.0]])
    # r²/2 = [.125, .5, 0]
    assert close(kl_estimate(LOGP, REF, "k2"), [[0.125, 0.5, 0.0]])
    # exp(-r) - 1 + r: e^-.5 - .5 = .1065307; e^1 - 2 = .7182818; 0
    assert close(kl_estimate(LOGP, REF, "k3"), [[math.exp(-0.5) - 0.5, E - 2, 0.0]])


def test_clamps_and_non_finite_inputs():
    logp = T([[5.0, -5.0, 50.0, float("nan"), float("inf")]])
    ref = torch.zeros(1, 5)
    # k1 unclamped except ±∞ -> ±30 and NaN -> 0
    assert close(kl_estimate(logp, ref, "k1"), [[5.0, -5.0, 50.0, 0.0, 30.0]])
    # k2: 12.5 -> 10, 12.5 -> 10, 1250 -> 10, 0, 450 -> 10
    assert close(kl_estimate(logp, ref, "k2"), [[10.0, 10.0, 10.0, 0.0, 10.0]])
    # k3: r=5 -> e^-5 + 4 = 4.006738; r=-5 -> e^5 - 6 = 142.4 -> 10
    assert close(kl_estimate(logp, ref, "k3")[0, :2], [math.exp(-5) + 4, 10.0])


def test_k3_is_non_negative_and_mask_zeroes():
    r = torch.linspace(-8, 8, 101).unsqueeze(0)
    assert torch.all(kl_estimate(r, torch.zeros_like(r), "k3") >= 0)
    assert close(kl_estimate(LOGP, REF, "k1", action_mask=T([[1, 0, 1]])), [[0.5, 0.0, 0.0]])


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(LOGP, REF, "k4")


def test_adaptive_controller_hand_computed():
    ctl = AdaptiveKLController(0.1, target=0.05, horizon=1000)
    # KL .1 = 2× target: error clip(1, ±.2) = .2 -> β = .1 · (1 + .2·100/1000) = .102
    ctl.update(0.1, n_steps=100)
    assert ctl.value == pytest.approx(0.102)
    # KL .045: error -.1 -> β = .102 · (1 - .1·100/1000) = .10098
    ctl.update(0.045, n_steps=100)
    assert ctl.value == pytest.approx(0.10098)


def test_controller_choice():
    fixed = make_kl_controller(0.01, None, 10000)
    assert isinstance(fixed, FixedKLController)
    fixed.update(5.0, 1000)
    assert fixed.value == 0.01
    assert isinstance(make_kl_controller(0.01, 0.1, 10000), AdaptiveKLController)
    assert isinstance(make_kl_controller(0.01, 0.0, 10000), FixedKLController)  # a falsy target means fixed


# --------------------------------------------------------------------------------------------------- IS correction
# row 0: log w = old − rollout = [0, .5, -.8] -> w = [1, e^.5 = 1.6487, e^-.8 = .4493]
#        seq u = e^(-.3) = .7408 (in band), geo u = e^(-.1) = .9048 (in band)
# row 1: log w = [1, 1, (masked)] -> w = [e, e]; seq u = e² = 7.389, geo u = e: both out of band
OLD = T([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
ROLLOUT = T([[-1.0, -1.5, -0.2], [-2.0, -2.0, 0.0]])
MASK = T([[1, 1, 1], [1, 1, 0]])
W0 = [1.0, math.exp(0.5), math.exp(-0.8)]
BAND = dict(low=0.5, high=1.5)


def run(level, mode):
    return is_correction(OLD, ROLLOUT, MASK, level=level, mode=mode, **BAND)


def test_token_mask_icepop():
    out = run("token", "mask")
    # row 0 keeps only t0; row 1 drops both action tokens -> 4 of 5 action tokens filtered
    assert close(out.coef, [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert close(out.is_filter_ratio, 0.8)


def test_token_clip():
    out = run("token", "clip")
    # clamp(w, .5, 1.5): [1, 1.5, .5], [1.5, 1.5, masked 0]
    assert close(out.coef, [[1.0, 1.5, 0.5], [1.5, 1.5, 0.0]])
    assert close(out.is_filter_ratio, 0.8)


def test_token_trunc_tis():
    out = run("token", "trunc")
    # min(w, 1.5): small weights unchanged; only the upper tail counts as filtered: t1 of row 0, both of row 1
    assert close(out.coef, [[1.0, 1.5, W0[2]], [1.5, 1.5, 0.0]])
    assert close(out.is_filter_ratio, 3 / 5)


def test_seq_mask_product_ratio():
    out = run("seq", "mask")
    # row 0 survives with its per-token weights; row 1 is rejected whole; 1 of 2 sequences filtered
    assert close(out.coef, [W0, [0.0, 0.0, 0.0]])
    assert out.filtered.tolist() == [[False], [True]]
    assert close(out.is_filter_ratio, 0.5)


def test_geo_mask_seq_mask_tis():
    out = run("geo", "mask")
    assert close(out.coef, [W0, [0.0, 0.0, 0.0]])
    assert close(out.is_filter_ratio, 0.5)


def test_geo_band_edge_is_inclusive():
    # one token with log w = ln 1.5 exactly at the upper edge (inclusive) survives; slightly above is dropped
    old = T([[math.log(1.5)]])
    kept = is_correction(old, torch.zeros(1, 1), T([[1]]), level="geo", mode="mask", low=0.5, high=1.5 + 1e-6)
    dropped = is_correction(old, torch.zeros(1, 1), T([[1]]), level="geo", mode="mask", low=0.5, high=1.5 - 1e-4)
    assert close(kept.coef, [[1.5]]) and close(dropped.coef, [[0.0]])


def test_vllm_kl_metric():
    # mean over the 5 action tokens of rollout − old: row 0 [0, -.5, .8], row 1 [-1, -1] -> -1.7/5 = -.34
    assert close(run("token", "mask").vllm_kl, -0.34)
    assert close(run("geo", "mask").vllm_kl, -0.34)


def test_off_is_identity_and_still_reports_mismatch():
    out = is_correction(OLD, ROLLOUT, MASK, level="off", mode="mask", **BAND)
    assert torch.equal(out.coef, torch.ones(2, 3)) and out.is_filter_ratio.item() == 0.0
    assert close(out.vllm_kl, -0.34)
    assert is_correction(OLD, None, MASK, level="off", mode="mask", **BAND).vllm_kl.item() == 0.0


def test_coef_is_detached():
    old = OLD.clone().requires_grad_(True)
    out = is_correction(old, ROLLOUT, MASK, level="token", mode="clip", **BAND)
    assert not out.coef.requires_grad


@pytest.mark.parametrize(("level", "mode", "message"), [
    ("seq", "clip", "supports only mode 'mask'"),
    ("geo", "trunc", "supports only mode 'mask'"),
    ("sentence", "mask", "level must be one of"),
    ("token", "cap", "level must be one of"),
])
def test_invalid_combinations(level, mode, message):
    with pytest.raises(ValueError, match=message):
        run(level, mode)


def test_missing_rollout_logprobs():
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        is_correction(OLD, None, MASK, level="token", mode="mask", **BAND)
