"""What the RL loop computes from one rollout batch besides the training inputs: the length shaping of its rewards
(`LengthShaping`) and its rollout/train statistics (`batch_metrics`, `image_metrics`), all documented in
runtime/metrics.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime import algo
from runtime.experience import Experience, check_image_alignment, image_token_count


@dataclass(frozen=True)
class Outcomes:
    rewards: torch.Tensor
    scores: torch.Tensor
    truncated: torch.Tensor
    group_ids: torch.Tensor
    rollout_ids: torch.Tensor


def outcomes(batch: Experience) -> Outcomes:
    """A rollout batch's outcomes and ids: the generator fills them in every batch it sends (they are optional in
    `Experience` for the batches the FSDP groups get)."""
    b = batch
    assert b.rewards is not None and b.scores is not None and b.truncated is not None
    assert b.group_ids is not None and b.rollout_ids is not None
    return Outcomes(b.rewards, b.scores, b.truncated, b.group_ids, b.rollout_ids)


def batch_metrics(batch: Experience, advantages: torch.Tensor, old: torch.Tensor | None) -> dict[str, float]:
    """Rollout statistics count each rollout once: a chat rollout may arrive as several step-samples that share its
    id and reward (their generated tokens add up, one truncated sample truncates the rollout). `old` is None
    without an old-logprob pass (then no `train/logprob_diff_max`: the trainer logs `train/mismatch/*`)."""
    mask, o = batch.action_mask, outcomes(batch)
    ids, sample_to_rollout = torch.unique(o.rollout_ids, return_inverse=True)
    n = len(ids)
    first = torch.full((n,), batch.batch_size).scatter_reduce(0, sample_to_rollout, torch.arange(batch.batch_size),
                                                              reduce="amin")
    rewards, scores, group_ids = o.rewards[first], o.scores[first], o.group_ids[first]
    lengths = torch.zeros(n).index_add(0, sample_to_rollout, batch.response_length.float())
    truncated = torch.zeros(n).scatter_reduce(0, sample_to_rollout, o.truncated.float(), reduce="amax")
    groups = group_ids.unique()
    group_std = [rewards[group_ids == g].std(unbiased=False) for g in groups]
    out = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std(unbiased=False)),
        "rollout/score_mean": float(scores.mean()),
        "rollout/pass1": float((scores > 0).float().mean()),
        "rollout/num_rollouts": float(n),
        "rollout/num_samples": float(batch.batch_size),
        "rollout/num_prompt_groups": float(len(groups)),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/truncated_rate": float(truncated.mean()),
        "rollout/group_reward_std": float(torch.stack(group_std).mean()),
        "train/advantage_mean": float(algo.masked_mean(advantages, mask)),
        "train/advantage_abs_mean": float(algo.masked_mean(advantages.abs(), mask)),
    }
    if old is not None:
        out["train/logprob_diff_max"] = float(((batch.rollout_log_probs - old).abs() * mask).max())
    return out


def image_metrics(batch: Experience, model_path: str) -> dict[str, float]:
    """VLM batches: placeholder tokens and image features, counted separately (equal when aligned; the batch is
    checked row by row first, so a misaligned row stops the run instead of training on shifted features)."""
    if batch.mm_inputs is None:
        return {}
    from runtime.engines.weights import image_token_id, merge_size
    from runtime.vlm import image_grid

    token_id, merge = image_token_id(model_path), merge_size(model_path)
    check_image_alignment(batch, token_id, merge)
    tokens = int(((batch.sequences == token_id) & batch.attention_mask).sum())
    features = sum(image_token_count(m, merge) for m in batch.mm_inputs)
    return {"rollout/image_tokens": float(tokens), "rollout/image_features": float(features),
            "rollout/images": float(sum(0 if m is None else len(image_grid(m)) for m in batch.mm_inputs))}


class LengthShaping:
    """The plan's length penalty (DAPO overlong or ProRL stop-properly) on the merged rewards, before the clip; its
    mean R' − R is logged as `train/overlong_penalty` or `train/stop_properly_penalty`."""

    def __init__(self, algo_plan, batch: Experience):
        self.a, self.batch = algo_plan, batch
        self.metrics: dict[str, float] = {}
        on = algo_plan.overlong_buffer_len is not None or algo_plan.stop_properly_penalty_coef is not None
        self.shape = self._shape if on else None

    def _shape(self, merged) -> torch.Tensor:
        from runtime.algo import penalties

        a, b, n = self.a, self.batch, merged.rewards.numel()
        if a.overlong_buffer_len is not None:
            peak = penalties.peak_per_rollout(b.attention_mask.sum(-1), merged.sample_to_rollout, n)
            shaped, delta = penalties.overlong_penalty(merged.rewards, peak, buffer_len=a.overlong_buffer_len,
                                                       factor=a.overlong_penalty_factor, max_len=a.overlong_max_len)
            name = "train/overlong_penalty"
        else:
            trunc = penalties.truncated_per_rollout(outcomes(b).truncated, merged.sample_to_rollout, n)
            shaped, delta = penalties.stop_properly_penalty(merged.rewards, trunc, coef=a.stop_properly_penalty_coef)
            name = "train/stop_properly_penalty"
        self.metrics[name] = float(delta.mean()) if n else 0.0
        return shaped
