"""Reward preprocessing before the advantage estimator (`reference/molt_rules.md` §6.2, rule C8).

1. Grouping. The group estimators (grpo, dr_grpo, rloo, reinforce_baseline) need one reward per *rollout*: a
   multi-turn rollout may arrive as several step-samples sharing a `rollout_id` (and the same terminal reward), and
   counting it once per step would over-weight long episodes in the group mean. So those estimators merge samples by
   `rollout_id` (first sample wins) and group rollouts by `group_id`. reinforce, gae and on_policy_distill score every
   sample on its own: each sample is its own rollout and its own group.
2. Length penalties (Molt 0.2.1 overlong / stop-properly, `penalties.py`), on the per-rollout reward, when the plan
   turns one on: `shape` maps the merged rewards to the shaped ones.
3. Clipping to `algo.reward_clip`, on the per-rollout reward, before any baseline.

Whitening (`whiten`) lives here too because several estimators share it: (A − μ)/σ with μ, σ over the action tokens
of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_baseline"})
"""Estimators whose baseline is computed within a prompt group; only these merge step-samples per rollout."""


@dataclass(frozen=True)
class RolloutRewards:
    """Rewards ready for an estimator, with the maps back to the samples."""

    rewards: Tensor  # (R,) float, one (clipped) reward per rollout
    group_index: Tensor  # (R,) long in [0, G): the prompt group of each rollout, numbered in first-seen order
    sample_to_rollout: Tensor  # (S,) long in [0, R): row of `rewards` each sample belongs to

    @property
    def num_groups(self) -> int:
        return int(self.group_index.max().item()) + 1 if self.group_index.numel() else 0


def merge_rollout_rewards(sample_rewards: Tensor, rollout_ids: Sequence[str], group_ids: Sequence[str]) -> RolloutRewards:
    """One reward per unique `rollout_id` (the first sample's), rollouts grouped by `group_id`.

    Example: samples [A, A, B, C] in groups [g0, g0, g0, g1] with rewards [1, 1, 0, .5] give
    rewards [1, 0, .5], group_index [0, 0, 1], sample_to_rollout [0, 0, 1, 2].
    """
    if not (len(rollout_ids) == len(group_ids) == sample_rewards.numel()):
        raise ValueError(f"{sample_rewards.numel()} rewards, {len(rollout_ids)} rollout_ids, {len(group_ids)} group_ids")
    row_of_rollout: dict[str, int] = {}
    group_of_id: dict[str, int] = {}
    first_sample: list[int] = []
    group_index: list[int] = []
    sample_to_rollout: list[int] = []
    for i, (rid, gid) in enumerate(zip(rollout_ids, group_ids, strict=True)):
        row = row_of_rollout.get(rid)
        if row is None:
            row = row_of_rollout[rid] = len(first_sample)
            first_sample.append(i)
            group_index.append(group_of_id.setdefault(gid, len(group_of_id)))
        sample_to_rollout.append(row)
    return RolloutRewards(
        rewards=sample_rewards.float()[torch.tensor(first_sample, dtype=torch.long)],
        group_index=torch.tensor(group_index, dtype=torch.long),
        sample_to_rollout=torch.tensor(sample_to_rollout, dtype=torch.long),
    )


def per_sample_rewards(sample_rewards: Tensor) -> RolloutRewards:
    """Every sample is its own rollout and its own group (reinforce, gae, on_policy_distill)."""
    n = sample_rewards.numel()
    index = torch.arange(n, dtype=torch.long)
    return RolloutRewards(rewards=sample_rewards.float().clone(), group_index=index, sample_to_rollout=index.clone())


def clip_rewards(rewards: Tensor, reward_clip: tuple[float, float]) -> Tensor:
    """Clamp each reward into [low, high]."""
    low, high = reward_clip
    return rewards.clamp(min=low, max=high)


def prepare_rewards(
    estimator: str,
    sample_rewards: Tensor,  # (S,) summed episode reward of each sample
    rollout_ids: Sequence[str],
    group_ids: Sequence[str],
    reward_clip: tuple[float, float],
    shape: Callable[[RolloutRewards], Tensor] | None = None,
) -> RolloutRewards:
    """Group (for the group estimators), shape (length penalties), then clip: the estimator's input."""
    if estimator in GROUP_ESTIMATORS:
        merged = merge_rollout_rewards(sample_rewards, rollout_ids, group_ids)
    else:
        merged = per_sample_rewards(sample_rewards)
    rewards = merged.rewards if shape is None else shape(merged)
    return RolloutRewards(clip_rewards(rewards, reward_clip), merged.group_index, merged.sample_to_rollout)


def whiten(advantages: Tensor, action_mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(A − μ)/σ with μ and the population σ taken over the action tokens of the whole batch.

    advantages, action_mask: (B, T). σ² is clamped at `eps` (as Molt's code does; its doc says σ), so a batch of
    equal advantages maps to zeros instead of dividing by 0. A batch without action tokens gives zeros.
    """
    mask = action_mask.float()
    num_actions = mask.sum()
    if num_actions == 0:
        return torch.zeros_like(advantages)
    mean = (advantages * mask).sum() / num_actions
    var = (((advantages - mean) ** 2) * mask).sum() / num_actions
    return (advantages - mean) * var.clamp(min=eps).rsqrt()
