"""Policy, value and SFT losses with global-token-mean aggregation (`reference/molt_rules.md` §6.4, rules E1–E5).

Shared preprocessing of the policy surrogates: the log-ratio ℓ = log π − log π_old has NaN → 0, ±∞ → ±30 and is zeroed
off the action mask; non-finite advantages are zeroed; ρ = exp(clamp(ℓ, ±30)).

    ppo   (Schulman et al. 2017, eq. 7):  −min(ρA, clip(ρ, 1−ε_l, 1+ε_h)·A)
          dual clip c (Ye et al. 2020, arXiv:1912.09729), for A < 0 only:  −max(min(ρA, clip(ρ)·A), c·A)
    gspo  (arXiv:2507.18071, GSPO-token):  s = sg(exp(mean_t ℓ)),  s_t = exp(log π − sg(log π) + log s)
          loss = −min(s_t·A, clip(s_t, 1−ε_l, 1+ε_h)·A)
    cispo (arXiv:2506.13585):  −sg(min(ρ, ε_h))·A·log π, where ε_h is an absolute ceiling ≥ 1

Aggregation (`global_token_mean`): loss = Σ(masked per-token loss) / N_global × dp, where N_global is the number of
action tokens in the whole optimizer step: every micro-batch of the accumulation window, on every data-parallel rank.
The caller counts it once per step (an all-reduce) and passes it in. Each micro-batch's backward then contributes
exactly its share, and the FSDP gradient *average* over dp ranks (hence × dp) yields Σ_all / N_global: long and short
micro-batches weigh per token, not per micro-batch, and the result does not depend on how the batch was split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.algo.aggregation import aggregate
from runtime.algo.is_correction import masked_mean
from runtime.algo.kl import LOG_RATIO_LIMIT, kl_estimate, safe_log_ratio

LOSS_MODES = ("ppo", "gspo", "cispo")


def global_token_mean(loss_mat: Tensor, action_mask: Tensor, global_num_tokens: int | float | Tensor,
                      dp_size: int = 1) -> Tensor:
    """Σ_{b,t} loss·m / N_global × dp. `global_num_tokens` = action tokens of the whole optimizer step (all
    micro-batches, all dp ranks). Zero tokens gives a zero loss that still has a graph (no NaN)."""
    loss_sum = torch.where(action_mask.bool(), loss_mat, torch.zeros_like(loss_mat)).sum()
    denom = torch.as_tensor(global_num_tokens, dtype=loss_sum.dtype, device=loss_sum.device)
    if denom.item() == 0:
        return loss_sum * 0.0
    return loss_sum / denom * dp_size


# --------------------------------------------------------------------------------------------------- surrogates
def ppo_loss(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
             dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token clipped surrogate (B, T) and the (B, T) bool "clipped term was smaller" indicator."""
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    clip1 = torch.min(surr1, surr2)
    if dual_clip is None:
        loss = -clip1
    else:
        # For A < 0 a huge ρ makes ρA unboundedly negative; c·A bounds it from below.
        loss = -torch.where(advantages < 0, torch.max(clip1, dual_clip * advantages), clip1)
    return loss, surr2 < surr1


def gspo_loss(log_probs: Tensor, log_ratio: Tensor, advantages: Tensor, action_mask: Tensor, clip_low: float,
              clip_high: float) -> tuple[Tensor, Tensor]:
    """Sequence-level ratio with per-token gradient; `log_ratio` is the sanitised ℓ (B, T)."""
    log_s = masked_mean(log_ratio, action_mask, dim=-1).detach().unsqueeze(-1)  # (B, 1) log of the geometric mean
    seq_ratio = torch.exp(log_probs - log_probs.detach() + log_s)  # numerically s, gradient of log π_t
    surr1 = seq_ratio * advantages
    surr2 = seq_ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.min(surr1, surr2), surr2 < surr1


def cispo_loss(ratio: Tensor, advantages: Tensor, log_probs: Tensor, clip_high: float) -> tuple[Tensor, Tensor]:
    """REINFORCE through log π with a stop-gradient IS weight capped at `clip_high`: clipped tokens still learn."""
    weight = ratio.clamp(max=clip_high).detach()
    return -weight * advantages * log_probs, ratio > clip_high


# --------------------------------------------------------------------------------------------------- policy loss
@dataclass(frozen=True)
class PolicyLossOutput:
    loss: Tensor  # () global-token-mean loss to backpropagate
    reported_loss: Tensor  # () plain per-token mean over this micro-batch, for logging
    clip_ratio: Tensor  # () fraction of action tokens clipped
    policy_kl: Tensor  # () masked mean of log π_old − log π (approx KL(π_old‖π))
    ratio_mean: Tensor  # () masked mean of ρ = π/π_old (exactly 1 when π_old is this forward, detached)


def policy_loss(
    log_probs: Tensor,  # (B, T) log π(a_t|s_t) under the current weights, with grad
    old_log_probs: Tensor,  # (B, T) log π_old, the trainer's forward at experience time
    advantages: Tensor,  # (B, T)
    action_mask: Tensor,  # (B, T)
    *,
    mode: str,
    clip_low: float,
    clip_high: float,
    global_num_tokens: int | float | Tensor,
    dp_size: int = 1,
    dual_clip: float | None = None,
    is_coef: Tensor | None = None,  # (B, T) from `is_correction`, None = no IS correction
    row_weights: Tensor | None = None,  # (B,) from `aggregation.row_weights`; None = global token mean
    centering: Tensor | None = None,  # (B, T) c_t of `score_centering.centering`; the loss adds A_t·c_t
) -> PolicyLossOutput:
    mask = action_mask.bool()
    log_ratio = torch.where(mask, safe_log_ratio(log_probs, old_log_probs), torch.zeros_like(log_probs.float()))
    adv = torch.nan_to_num(advantages.float(), nan=0.0, posinf=0.0, neginf=0.0)
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if mode == "ppo":
        loss_mat, clipped = ppo_loss(ratio, adv, clip_low, clip_high, dual_clip)
    elif mode == "gspo":
        loss_mat, clipped = gspo_loss(log_probs.float(), log_ratio, adv, mask, clip_low, clip_high)
    elif mode == "cispo":
        loss_mat, clipped = cispo_loss(ratio, adv, log_probs.float(), clip_high)
    else:
        raise ValueError(f"unknown policy loss mode {mode!r}; expected one of {', '.join(LOSS_MODES)}")
    if is_coef is not None:
        loss_mat = loss_mat * is_coef
    if centering is not None:  # Molt 0.2.1 §3.4: ℓ_t = coef_t·surrogate_t + A_t·c_t, aggregated like the rest
        loss_mat = loss_mat + adv * centering
    return PolicyLossOutput(
        loss=global_token_mean(loss_mat, mask, global_num_tokens, dp_size) if row_weights is None
        else aggregate(loss_mat, mask, row_weights, dp_size),
        reported_loss=masked_mean(loss_mat.detach(), mask),
        clip_ratio=masked_mean(clipped.float(), mask),
        policy_kl=masked_mean(-log_ratio.detach(), mask),
        ratio_mean=masked_mean(ratio.detach(), mask),
    )


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """(B, T) entropy H = logsumexp(z) − Σ softmax(z)·z of the temperature-scaled logits z = logits / τ (B, T, V)."""
    z = logits.float() / temperature
    return torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(dim=-1)


@dataclass(frozen=True)
class ActorLossOutput:
    loss: Tensor  # () total to backpropagate
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars


def actor_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    mode: str,
    clip_low: float,
    clip_high: float,
    global_num_tokens: int | float | Tensor,
    dp_size: int = 1,
    dual_clip: float | None = None,
    is_coef: Tensor | None = None,
    ref_log_probs: Tensor | None = None,  # (B, T), only when KL is a loss term
    kl_coef: float = 0.0,
    kl_estimator: str = "k2",
    kl_ref: str = "model",  # plan `kl.ref`: k3's form against a model or the rollout policy
    entropy: Tensor | None = None,  # (B, T) from `entropy_from_logits`, only when entropy_coef != 0
    entropy_coef: float = 0.0,
    row_weights: Tensor | None = None,  # (B,) `loss.agg_mode` weights of the policy term (None: token mean)
    centering: Tensor | None = None,  # (B, T) score-centering correction c_t, added as A_t·c_t (None: off)
) -> ActorLossOutput:
    """total = policy + β·token-mean(k(log π, log π_ref)) − entropy_coef·token-mean(H)  (Molt policy_actor.py).
    The policy term follows `row_weights` (Molt 0.2.1 loss_agg_mode); KL and entropy stay token-mean (I17).

    Every term uses the same global token count, so the sum stays split-invariant. The KL term is skipped when
    β = 0 (as Molt zeroes it when the initial coefficient is 0).
    """
    out = policy_loss(log_probs, old_log_probs, advantages, action_mask, mode=mode, clip_low=clip_low,
                      clip_high=clip_high, global_num_tokens=global_num_tokens, dp_size=dp_size,
                      dual_clip=dual_clip, is_coef=is_coef, row_weights=row_weights, centering=centering)
    total = out.loss
    metrics = {"policy_loss": out.reported_loss, "clip_ratio": out.clip_ratio, "policy_kl": out.policy_kl,
               "ratio_mean": out.ratio_mean}
    if ref_log_probs is not None and kl_coef != 0.0:
        kl = kl_estimate(log_probs, ref_log_probs, kl_estimator, action_mask, ref=kl_ref)
        total = total + kl_coef * global_token_mean(kl, action_mask, global_num_tokens, dp_size)
        metrics["kl_loss"] = masked_mean(kl.detach(), action_mask)
    if entropy is not None and entropy_coef != 0.0:
        total = total - entropy_coef * global_token_mean(entropy, action_mask, global_num_tokens, dp_size)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), action_mask)
    return ActorLossOutput(loss=total, metrics=metrics)


# --------------------------------------------------------------------------------------------------- value / sft
def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, *, value_clip: float | None,
               global_num_tokens: int | float | Tensor, dp_size: int = 1) -> tuple[Tensor, Tensor]:
    """Clipped value regression 0.5·max((V − R)², (V_old + clamp(V − V_old, ±c) − R)²), token-mean.
    Returns (loss, clip_frac) where clip_frac is the fraction of action tokens with |V − V_old| > c."""
    v, ret = values.float(), returns.float()
    unclipped = (v - ret) ** 2
    if value_clip is None:
        loss_mat = 0.5 * unclipped
        clip_frac = torch.zeros(())
    else:
        v_clipped = old_values.float() + (v - old_values.float()).clamp(-value_clip, value_clip)
        loss_mat = 0.5 * torch.max(unclipped, (v_clipped - ret) ** 2)
        clip_frac = masked_mean(((v - old_values.float()).abs() > value_clip).float(), action_mask)
    return global_token_mean(loss_mat, action_mask, global_num_tokens, dp_size), clip_frac


def sft_loss(log_probs: Tensor, loss_mask: Tensor, *, global_num_tokens: int | float | Tensor,
             dp_size: int = 1) -> Tensor:
    """Negative log-likelihood, global-token-mean over `loss_mask` (B, T)."""
    return global_token_mean(-log_probs.float(), loss_mask, global_num_tokens, dp_size)
