"""Length penalties on the reward, applied before `reward_clip` (Molt 0.2.1 `--reward.*`, molt_0_2_1.md §3.6).

Shaped per rollout (the group estimators' merged rewards) or per sample (every other estimator, I11):

- DAPO overlong (buffer B, factor F, context budget L = data.max_len), on a rollout's longest context `peak`:
  R' = R − clamp(peak − (L − B), 0, B) / B · F. L = 4096, B = 512, F = 1: peak 3584 → 0, 3840 → −0.5, 4096 → −1.
- ProRL stop-properly (coefficient C), on a truncated rollout: R' = C if C < 0 else C·R; otherwise R' = R.

Both return (R', R' − R): the second is the logged `overlong_penalty` / `stop_properly_penalty`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(rewards: Tensor, peak_context: Tensor, *, buffer_len: float, factor: float,
                     max_len: int) -> tuple[Tensor, Tensor]:
    """rewards, peak_context: (R,). Linear ramp over the last `buffer_len` tokens of `max_len`."""
    over = (peak_context.float() - (max_len - buffer_len)).clamp(min=0.0, max=buffer_len)
    shaped = rewards.float() - over / buffer_len * factor
    return shaped, shaped - rewards.float()


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, *, coef: float) -> tuple[Tensor, Tensor]:
    """rewards, truncated: (R,). A negative `coef` replaces a truncated rollout's reward, else scales it."""
    r = rewards.float()
    penalised = torch.full_like(r, coef) if coef < 0 else coef * r
    shaped = torch.where(truncated.bool(), penalised, r)
    return shaped, shaped - r


def peak_per_rollout(context_length: Tensor, sample_to_rollout: Tensor, num_rollouts: int) -> Tensor:
    """(R,) the longest context over each rollout's samples (segments)."""
    out = torch.zeros(num_rollouts, dtype=torch.float32, device=context_length.device)
    return out.scatter_reduce(0, sample_to_rollout, context_length.float(), reduce="amax", include_self=False)


def truncated_per_rollout(truncated: Tensor, sample_to_rollout: Tensor, num_rollouts: int) -> Tensor:
    """(R,) bool: any of the rollout's samples was truncated."""
    return peak_per_rollout(truncated.float(), sample_to_rollout, num_rollouts) > 0
