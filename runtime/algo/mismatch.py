"""Train–inference mismatch metrics (Molt 0.2.1 `mismatch/*`, molt_0_2_1.md §5): how far the trainer's log-probs of
the sampled tokens are from the engine's, over the action tokens.

    bitwise_frac   fraction whose fp32 bit pattern differs (0: bitwise consistent)
    abs_diff_mean  masked mean of |d|, d = lp_train − lμ
    k3_kl          masked mean of e^d − 1 − d, a k3 estimate of KL(rollout ‖ train)

Rollout [−1, −2, −3] against train [−1, −2.0000002, −3.5]: 0.666667, 0.166667, 0.035510. Token-weighted scalars,
so the reduction over micro-batches and ranks is exact.
"""

from __future__ import annotations

import torch
from torch import Tensor


def mismatch_metrics(train_log_probs: Tensor, rollout_log_probs: Tensor, action_mask: Tensor) -> dict[str, float]:
    mask = action_mask.bool()
    n = max(int(mask.sum()), 1)
    a, b = train_log_probs.float(), rollout_log_probs.float()
    d = (a - b)[mask]
    differs = a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)
    return {
        "mismatch/bitwise_frac": float(differs[mask].sum()) / n,
        "mismatch/abs_diff_mean": float(d.abs().sum()) / n,
        # expm1 in float64: e^d - 1 - d in fp32 cancels to a few 1e-9 below 0 when d ~ 0 (most tokens equal)
        "mismatch/k3_kl": float((torch.expm1(d.double()) - d.double()).sum()) / n,
    }

