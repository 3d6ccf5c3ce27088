"""KL to the reference policy: per-token estimators and the coefficient controllers.

Estimators (`reference/molt_rules.md` §6.5, Schulman's "Approximating KL divergence"), with the log-ratio
r = log π − log π_ref (NaN → 0, ±∞ → ±30):

    k1 = r                      unclamped (on_policy_distill's dense reward must never be capped)
    k2 = r² / 2                 clamped to [−10, 10]
    k3 = exp(−r) − 1 + r        clamped to [−10, 10]; unbiased for KL(π‖π_ref) under samples of π, always ≥ 0

Against the rollout policy (Molt 0.2.1 `kl.ref: rollout`, molt_0_2_1.md §3.5) the reference log-probs are the
engine's own (π_ref = μ) and the tokens are drawn from μ, so k3 takes its mirrored form e^r − 1 − r, whose gradient
(π/μ − 1)∇log π descends KL(μ‖π) and is exactly 0 where π = μ. (k1 as a loss would ascend it: rule KL001.)

Where they go: folded into the per-token reward (−β·kl_t) for reinforce, gae and on_policy_distill when
`kl.use_loss` is off, or added to the actor loss as β·token-mean(kl) when it is on (`losses.actor_loss`).

Coefficient: fixed, or adaptive (Ziegler et al. 2019) when the plan sets `kl.target` (rule C9):
    β ← β · (1 + clip(KL / target − 1, −0.2, 0.2) · n / horizon),  n = samples in the step.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_LIMIT = 30.0
KL_CLAMP = 10.0
KL_ESTIMATORS = ("k1", "k2", "k3")


def safe_log_ratio(log_probs: Tensor, other_log_probs: Tensor) -> Tensor:
    """log π − log π_other in fp32 with NaN → 0 and ±∞ → ±30, so one bad logit cannot poison a batch."""
    diff = log_probs.float() - other_log_probs.float()
    return torch.nan_to_num(diff, nan=0.0, posinf=LOG_RATIO_LIMIT, neginf=-LOG_RATIO_LIMIT)


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str, action_mask: Tensor | None = None,
                ref: str = "model") -> Tensor:
    """(B, T) per-token KL estimate; zero off `action_mask` when one is given. `ref` is the plan's `kl.ref`:
    `model` (a frozen reference) or `rollout` (the engine's log-probs), which only changes k3's form."""
    r = safe_log_ratio(log_probs, ref_log_probs)
    if estimator == "k1":
        kl = r
    elif estimator == "k2":
        kl = (r.pow(2) / 2).clamp(-KL_CLAMP, KL_CLAMP)
    elif estimator == "k3" and ref == "rollout":
        kl = (torch.expm1(r) - r).clamp(-KL_CLAMP, KL_CLAMP)  # expm1: never below 0 in floats (exp - 1 cancels)
    elif estimator == "k3":
        kl = (torch.expm1(-r) + r).clamp(-KL_CLAMP, KL_CLAMP)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")
    return kl if action_mask is None else kl * action_mask.float()


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller that drives the measured KL toward `target` (rule C9)."""

    def __init__(self, init_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """One step's update; `n_steps` is the number of samples it trained on (rollout batch × n)."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def make_kl_controller(coef: float, target: float | None, horizon: int) -> FixedKLController | AdaptiveKLController:
    """Adaptive when the plan carries a (truthy) target, fixed otherwise."""
    if target:
        return AdaptiveKLController(coef, target, horizon)
    return FixedKLController(coef)
