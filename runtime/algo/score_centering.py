"""Score centering on the sampler's top-k head (Molt 0.2.1 `score_centering_top_k`, molt_0_2_1.md §3.4).

For each generated token, H = the k ids the engine returned with their sampler log-probs q_v, and p_v = the current
policy's probabilities of the same ids (one log-softmax, with grad). With f the IS weight function of the plan's mode
and band (`none` when IS is off: f ≡ 1; trunc min(x, high); clip clamp(x, low, high); mask x·[low ≤ x ≤ high]):

    ρ = max(1 − Σ_H q, 1e-6) / max(1 − Σ_H p, 1e-6)      tail ratio (the tail is modelled as q = ρ·p)
    α = ρ·f(1/ρ)
    w_v = sg[q_v·f(p_v/q_v) − α·p_v]                      head weights
    c = Σ_{v∈H} w_v·log p_v                              the correction; the per-token loss adds A_t·c_t

At ratio 1 the expected gradient over y ~ q is zero where H plus the tail model is exact. Test (V = 3):
q = (.5, .3, .2), p = (.5, .2, .3), H = {0, 1}, f = 1 → ρ = α = 2/3, w = (1/6, 1/6), c = −0.383764.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

TAIL_EPS = 1e-6
WEIGHT_MODES = ("none", "mask", "clip", "trunc")


def weight_fn(x: Tensor, mode: str, low: float | None, high: float) -> Tensor:
    """f(x) of the IS mode (Molt score_centering.py:47-66)."""
    low = float("-inf") if low is None else low
    if mode == "none":
        return torch.ones_like(x)
    if mode == "trunc":
        return x.clamp(max=high)
    if mode == "clip":
        return x.clamp(min=low, max=high)
    if mode == "mask":
        return x * ((x >= low) & (x <= high)).to(x.dtype)
    raise ValueError(f"unknown importance-weight mode {mode!r}; expected one of {', '.join(WEIGHT_MODES)}")


@dataclass(frozen=True)
class Centering:
    correction: Tensor  # (B, T) c_t, with grad through log p
    sampler_head_mass: Tensor  # () mean Σ_H q over action tokens
    policy_head_mass: Tensor  # () mean Σ_H p over action tokens


def centering(policy_top_log_probs: Tensor, sampler_top_log_probs: Tensor, action_mask: Tensor, *, mode: str,
              low: float | None, high: float) -> Centering:
    """Per-token correction c from (B, T, k) top-k log-probs under the policy (grad) and the sampler."""
    log_p = policy_top_log_probs.float()
    p, q = torch.exp(log_p.detach()), torch.exp(sampler_top_log_probs.float())
    with torch.no_grad():
        rho = (1 - q.sum(-1)).clamp(min=TAIL_EPS) / (1 - p.sum(-1)).clamp(min=TAIL_EPS)  # (B, T)
        alpha = rho * weight_fn(1 / rho, mode, low, high)
        w = q * weight_fn(p / q.clamp(min=1e-30), mode, low, high) - alpha.unsqueeze(-1) * p  # (B, T, k)
    mask = action_mask.float()
    c = (w * log_p).sum(-1) * mask
    n = mask.sum().clamp(min=1.0)
    return Centering(c, (q.sum(-1) * mask).sum() / n, (p.sum(-1) * mask).sum() / n)
