"""Advantage estimators (`reference/molt_rules.md` §6.3): per-rollout rewards in, per-token advantages out.

Notation (shapes in comments): R rollouts, B samples, T token positions on the action axis. `action_mask` (B, T)
marks the tokens the policy generated; R_i is the clipped reward of rollout i; kl_t the per-token KL to the reference
(0 when KL is a loss term or there is no reference); β = kl_coef.

| estimator          | advantage                                                   | whitened       |
|--------------------|-------------------------------------------------------------|----------------|
| reinforce          | G_t = Σ_{k≥t} γ^{k−t} r_k, r_t = −β·kl_t (+ R at last action) | yes            |
| reinforce_baseline | R − mean_group(R), on every action token                      | yes            |
| dr_grpo            | R − mean_group(R)                                             | no             |
| grpo               | (R − mean_group(R)) / (std_group(R) + 1e-9), unbiased std     | no             |
| rloo               | R − (Σ_group R − R)/(n − 1); a singleton keeps R              | no             |
| gae                | A_t = δ_t + γλ·A_{t+1}, δ_t = r_t + γ·V_{t+1} − V_t           | A yes, returns no |
| on_policy_distill  | A_t = −β·kl_t (kl = log π_student − log π_teacher with k1)    | no             |
| flash_reinforce    | R_i − mean_batch(R), per sample; no KL reward, γ, λ (0.2.1)    | no             |

The group statistics are vectorised with `index_add_` over `group_index`, so a 10k-rollout batch costs a handful of
tensor ops, not a Python loop per group. Only reinforce with γ < 1 and gae walk the token axis (a loop over T with
vector ops over B), because their recursions are sequential in t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.algo.reward import GROUP_ESTIMATORS, RolloutRewards, whiten

ESTIMATORS = ("reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae", "on_policy_distill",
              "flash_reinforce")
GRPO_EPS = 1e-9


@dataclass(frozen=True)
class Advantages:
    advantages: Tensor  # (B, T) what the policy loss multiplies, zero off the action mask
    returns: Tensor  # (B, T) un-whitened returns (gae: the value-regression target A + V)


# --------------------------------------------------------------------------------------------------- group baselines
# Group statistics are taken in float64: a group of identical fp32 rewards then has an exactly equal mean (n·x and
# n·x/n are exact in float64), so its deviations are exactly 0 and GRPO's (R − μ)/(σ + 1e-9) is 0, not rounding
# noise divided by 1e-9 (which gives advantages of ±0.8 for a group that carries no signal at all).
def _group_sums(values: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor]:
    """Per-group sum and count (float64), gathered back to each rollout: both (R,)."""
    num_groups = int(group_index.max().item()) + 1 if group_index.numel() else 0
    values = values.double()
    sums = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(0, group_index, values)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=values.device).index_add_(
        0, group_index, torch.ones_like(values))
    return sums[group_index], counts[group_index]


def group_mean(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(R,) mean reward of each rollout's own group (float64)."""
    sums, counts = _group_sums(rewards, group_index)
    return sums / counts


def group_std(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(R,) unbiased (n − 1) std of each rollout's group, as `torch.std`; 0 for a singleton group (float64)."""
    mean = group_mean(rewards, group_index)
    sq, counts = _group_sums((rewards.double() - mean) ** 2, group_index)
    return torch.where(counts > 1, (sq / (counts - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))


def reinforce_baseline(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(R,) a = R − mean_group(R). Dr.GRPO uses the same scalar (it differs only in not being whitened)."""
    return (rewards.double() - group_mean(rewards, group_index)).to(rewards.dtype)


dr_grpo = reinforce_baseline


def grpo(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(R,) a = (R − mean_group) / (std_group + 1e-9). A singleton group has std 0 and a = 0/1e-9 = 0."""
    centered = rewards.double() - group_mean(rewards, group_index)
    return (centered / (group_std(rewards, group_index) + GRPO_EPS)).to(rewards.dtype)


def rloo(rewards: Tensor, group_index: Tensor) -> Tensor:
    """(R,) a = R − (Σ_group R − R)/(n − 1): the baseline is the mean of the *other* rollouts.

    A singleton group has no other rollout; it keeps the raw reward (REINFORCE without baseline), as Molt does.
    """
    sums, counts = _group_sums(rewards, group_index)
    r = rewards.double()
    leave_one_out = (sums - r) / (counts - 1).clamp(min=1)
    return torch.where(counts > 1, r - leave_one_out, r).to(rewards.dtype)


def flash_reinforce(rewards: Tensor) -> Tensor:
    """(S,) a_i = R_i − mean_j R_j over the whole train-step batch of step-samples (Molt 0.2.1 advantage.py:199-210):
    no group structure, no whitening, KL reward or discount. R = [1, 0, 0, 1, 1] gives [.4, −.6, −.6, .4, .4]."""
    r = rewards.double()
    return (r - r.mean()).to(rewards.dtype) if r.numel() else rewards.clone()


def broadcast(rollout_advantages: Tensor, sample_to_rollout: Tensor, action_mask: Tensor) -> Tensor:
    """(B, T) each sample's rollout scalar on every one of its action tokens: A_t = a · m_t."""
    return rollout_advantages[sample_to_rollout].unsqueeze(-1) * action_mask.to(rollout_advantages.dtype)


# --------------------------------------------------------------------------------------------------- token rewards
def last_action_index(action_mask: Tensor) -> Tensor:
    """(B,) index of the last action token of each row (0 for a row without actions; callers mask it)."""
    T = action_mask.size(1)
    return T - 1 - action_mask.long().flip(1).argmax(dim=1)


def token_rewards(rewards: Tensor, action_mask: Tensor, kl: Tensor | None, kl_coef: float) -> Tensor:
    """(B, T) r_t = −β·kl_t on action tokens, plus the sample reward R on its last action token.

    rewards: (B,) per-sample reward. kl: (B, T) or None (no KL reward).
    """
    mask = action_mask.float()
    r = torch.zeros_like(mask) if kl is None else -kl_coef * kl.float()
    has_action = mask.sum(dim=1) > 0
    bonus = torch.where(has_action, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    r = r.scatter_add(1, last_action_index(action_mask).unsqueeze(1), bonus.unsqueeze(1))
    return r * mask


def discounted_returns(rewards_t: Tensor, gamma: float) -> Tensor:
    """(B, T) G_t = Σ_{k≥t} γ^{k−t} r_k over *all* positions: the discount also runs across masked gaps."""
    if gamma == 1.0:
        return rewards_t.flip(1).cumsum(1).flip(1)
    # Walk time-major (T, B) so each step touches one contiguous row instead of a strided column.
    r = rewards_t.t().contiguous()
    returns = torch.empty_like(r)
    running = torch.zeros_like(r[0])
    for t in reversed(range(r.size(0))):
        running = r[t] + gamma * running
        returns[t] = running
    return returns.t()


# --------------------------------------------------------------------------------------------------- estimators
def reinforce(rewards: Tensor, action_mask: Tensor, kl: Tensor | None, kl_coef: float, gamma: float) -> Tensor:
    """REINFORCE++ returns (B, T) (arXiv:2501.03262): discounted sum of the KL-shaped token rewards."""
    return discounted_returns(token_rewards(rewards, action_mask, kl, kl_coef), gamma)


def on_policy_distill(kl: Tensor, action_mask: Tensor, kl_coef: float) -> Tensor:
    """(B, T) A_t = −β·kl_t·m_t: the per-token reverse KL to the teacher is the whole signal (no task reward,
    no baseline, no discount). With k1, −kl = log π_teacher − log π_student."""
    return -kl_coef * kl.float() * action_mask.float()


def on_policy_distill_from_logprobs(student_log_probs: Tensor, teacher_log_probs: Tensor, action_mask: Tensor,
                                    kl_coef: float, estimator: str = "k1") -> Tensor:
    """(B, T) the same advantage from the two log-prob tensors: A_t = −β·k(log π_student, log π_teacher)·m_t."""
    from runtime.algo.kl import kl_estimate

    return on_policy_distill(kl_estimate(student_log_probs, teacher_log_probs, estimator), action_mask, kl_coef)


def gae(
    rewards: Tensor,  # (B,) per-sample reward
    values: Tensor,  # (B, T) critic V(s_t) at collection time
    action_mask: Tensor,  # (B, T)
    kl: Tensor | None,
    kl_coef: float,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over the action tokens.

        δ_t = r_t + γ·V_{t+1} − V_t,   A_t = δ_t + γλ·A_{t+1},   returns_t = (A_t + V_t)·m_t,   V_{T} = 0

    Masked positions (observation/tool tokens between turns, padding) are transparent: the bootstrap value V_{t+1}
    and the running A_{t+1} carry across them, so the last action token before a tool call bootstraps from the next
    action token, not from a spurious terminal 0 (this matters when λ < 1). Returns (advantages, returns), both
    un-whitened and masked.
    """
    mask = action_mask.float()
    r = token_rewards(rewards, action_mask, kl, kl_coef)
    v = values.float() * mask
    # Time-major (T, B) copies: each step of the recursion reads and writes contiguous rows.
    r_tm, v_tm, m_tm = r.t().contiguous(), v.t().contiguous(), mask.t().contiguous().bool()
    adv_tm = torch.empty_like(r_tm)
    next_value = torch.zeros_like(r_tm[0])
    next_advantage = torch.zeros_like(r_tm[0])
    for t in reversed(range(r_tm.size(0))):
        m = m_tm[t]
        a_t = r_tm[t] + gamma * next_value - v_tm[t] + (gamma * lam) * next_advantage
        next_advantage = torch.where(m, a_t, next_advantage)
        next_value = torch.where(m, v_tm[t], next_value)
        adv_tm[t] = next_advantage
    advantages = adv_tm.t() * mask
    return advantages, (advantages + v) * mask


# --------------------------------------------------------------------------------------------------- dispatch
_ROLLOUT_SCALAR = {"reinforce_baseline": reinforce_baseline, "dr_grpo": dr_grpo, "grpo": grpo, "rloo": rloo}
_WHITENED = frozenset({"reinforce", "reinforce_baseline", "gae"})


def compute_advantages(
    estimator: str,
    rollouts: RolloutRewards,
    action_mask: Tensor,  # (B, T)
    *,
    kl: Tensor | None = None,  # (B, T) per-token KL reward term, None when KL is a loss or there is no reference
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    values: Tensor | None = None,  # (B, T), gae only
    whiten_advantages: bool = True,  # plan `algo.whiten`; only reinforce, reinforce_baseline and gae whiten
) -> Advantages:
    """Run `estimator` on the prepared rewards (see `reward.prepare_rewards`) and return per-token tensors."""
    mask = action_mask.float()
    if estimator in _ROLLOUT_SCALAR:
        if estimator not in GROUP_ESTIMATORS:  # pragma: no cover - the two tables must agree
            raise AssertionError(estimator)
        returns = broadcast(_ROLLOUT_SCALAR[estimator](rollouts.rewards, rollouts.group_index),
                            rollouts.sample_to_rollout, action_mask)
        advantages = returns
    elif estimator == "reinforce":
        returns = reinforce(rollouts.rewards[rollouts.sample_to_rollout], action_mask, kl, kl_coef, gamma)
        advantages = returns
    elif estimator == "gae":
        if values is None:
            raise ValueError("gae needs the critic's values (B, T)")
        advantages, returns = gae(rollouts.rewards[rollouts.sample_to_rollout], values, action_mask, kl, kl_coef,
                                  gamma, lam)
    elif estimator == "flash_reinforce":
        returns = broadcast(flash_reinforce(rollouts.rewards), rollouts.sample_to_rollout, action_mask)
        advantages = returns
    elif estimator == "on_policy_distill":
        if kl is None:
            raise ValueError("on_policy_distill needs the per-token KL to the teacher")
        returns = on_policy_distill(kl, action_mask, kl_coef)
        advantages = returns
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")
    if whiten_advantages and estimator in _WHITENED:
        advantages = whiten(advantages, action_mask)
    return Advantages(advantages=advantages * mask, returns=returns)
