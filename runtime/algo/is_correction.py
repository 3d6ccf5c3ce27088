"""Importance-sampling correction between the trainer's and the rollout engine's log-probs
(`reference/molt_rules.md` §6.4 "IS correction", rules D1–D9).

The engine samples from π_rollout (vLLM's kernels, possibly stale weights in async mode); the loss is computed
under π_old (the trainer's forward on the same tokens). The per-token ratio w_t = π_old/π_rollout corrects the
mismatch. Two knobs:

- level, the unit the band is checked on:
    token: u_t = w_t                                   (one unit per token)
    seq:   u = exp(Σ_t m_t·log w_t)                    (product of the sequence's ratios; unbiased, high variance)
    geo:   u = exp(mean_t log w_t)                     (geometric mean; the recipe default)
- mode, what a unit outside [low, high] does:
    mask:  coef_t = w_t if low ≤ u ≤ high else 0       (drop the unit; survivors keep their per-token weight)
    clip:  coef = clamp(u, low, high)
    trunc: coef = min(u, high)                         (TIS: only the upper tail is capped)

Gating (Molt 0.2.1 `is_correction_gating`, molt_0_2_1.md §3.3): the statistic tested against the band is the ratio
(above), or a divergence between the sampled token's probability under the sampler P = e^{lμ} and the trainer
Q = e^{lo}: `binary_kl` = P·ln(P/Q) + (1−P)·ln((1−P)/(1−Q)) (P, Q clamped to [1e-6, 1−1e-6]) or `tv` = |P − Q|.
At seq level a divergence is averaged over the sequence's tokens; divergences take mode mask at token or seq level
only, and survivors keep their per-token ratio. A band `low` of None is −inf (one threshold value).

The loss is multiplied by `coef` (detached). Known schemes: token+trunc = TIS, token+mask = IcePop,
geo+mask = seq-mask-TIS, seq+mask = product-ratio rejection. seq/geo only make sense with mask (rule D5; the compiler
rejects the other combinations, and so does this function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.algo.kl import LOG_RATIO_LIMIT, safe_log_ratio

IS_LEVELS = ("off", "token", "seq", "geo")
IS_MODES = ("mask", "clip", "trunc")
IS_GATINGS = ("ratio", "binary_kl", "tv")
PROB_EPS = 1e-6


@dataclass(frozen=True)
class IsCorrection:
    coef: Tensor  # (B, T) detached per-token loss multiplier (ones when level is off)
    filtered: Tensor  # (B, T) bool for token level, (B, 1) for seq/geo: the unit fell outside [low, high]
    is_filter_ratio: Tensor  # () fraction of units out of band: per action token (token level) or per sequence
    vllm_kl: Tensor  # () masked mean of log π_rollout − log π_old over action tokens


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is set (0 when nothing is set)."""
    mask = mask.float()
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1.0)


def is_correction(
    old_log_probs: Tensor,  # (B, T) log π_old, the trainer's forward on the rollout tokens
    rollout_log_probs: Tensor | None,  # (B, T) log π_rollout from the engine, 0.0 off the action ranges
    action_mask: Tensor,  # (B, T)
    *,
    level: str,
    mode: str,
    low: float | None,
    high: float,
    gating: str = "ratio",
) -> IsCorrection:
    if level not in IS_LEVELS or mode not in IS_MODES or gating not in IS_GATINGS:
        raise ValueError(f"IS correction level must be one of {IS_LEVELS}, mode one of {IS_MODES} and gating one of "
                         f"{IS_GATINGS}, got {level!r}, {mode!r}, {gating!r}")
    if gating != "ratio" and (mode != "mask" or level == "geo"):
        raise ValueError(f"gating {gating!r} supports only mode 'mask' at level token or seq")
    mask = action_mask.bool()
    if level == "off":
        ones = torch.ones_like(old_log_probs, dtype=torch.float32)
        zero = torch.zeros((), dtype=torch.float32)
        vllm_kl = zero if rollout_log_probs is None else masked_mean(
            safe_log_ratio(rollout_log_probs, old_log_probs), mask)
        return IsCorrection(ones, torch.zeros_like(mask), zero, vllm_kl)
    if rollout_log_probs is None:
        raise ValueError("IS correction needs rollout_log_probs (the engine's per-token logprobs)")
    if level != "token" and mode != "mask":
        raise ValueError(f"IS level {level!r} is a rejection filter and supports only mode 'mask', got {mode!r}")

    with torch.no_grad():
        log_w = safe_log_ratio(old_log_probs, rollout_log_probs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        w = torch.exp(log_w)  # (B, T) per-token π_old / π_rollout
        low = float("-inf") if low is None else low
        if gating != "ratio":
            div = divergence(old_log_probs, rollout_log_probs, gating)
            unit = div if level == "token" else masked_mean(div, mask, dim=-1).unsqueeze(-1)
        elif level == "token":
            unit = w  # (B, T)
        elif level == "seq":
            unit = torch.exp((log_w * mask).sum(dim=-1, keepdim=True).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
        else:  # geo
            unit = torch.exp(masked_mean(log_w, mask, dim=-1).unsqueeze(-1))  # (B, 1)

        if mode == "mask":
            keep = (unit >= low) & (unit <= high)
            coef = torch.where(keep.expand_as(w), w, torch.zeros_like(w))
            filtered = ~keep
        elif mode == "clip":
            coef = unit.clamp(min=low, max=high).expand_as(w)
            filtered = (unit < low) | (unit > high)
        else:  # trunc
            coef = unit.clamp(max=high).expand_as(w)
            filtered = unit > high

        if level == "token":
            is_filter_ratio = masked_mean(filtered.float(), mask)
        else:
            is_filter_ratio = filtered.float().mean()
        vllm_kl = masked_mean(safe_log_ratio(rollout_log_probs, old_log_probs), mask)
    return IsCorrection(coef=coef * mask, filtered=filtered, is_filter_ratio=is_filter_ratio, vllm_kl=vllm_kl)


def divergence(old_log_probs: Tensor, rollout_log_probs: Tensor, gating: str) -> Tensor:
    """(B, T) per-token divergence between the sampler's and the trainer's probability of the sampled token.
    e^{lμ} = 0.5, e^{lo} = 0.6 gives binary_kl 0.020411 and tv 0.1."""
    p_rollout = torch.exp(rollout_log_probs.float())
    q_train = torch.exp(old_log_probs.float())
    if gating == "tv":
        return (p_rollout - q_train).abs()
    p = p_rollout.clamp(PROB_EPS, 1 - PROB_EPS)
    q = q_train.clamp(PROB_EPS, 1 - PROB_EPS)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))
