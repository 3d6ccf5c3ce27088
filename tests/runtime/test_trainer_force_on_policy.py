"""`train.force_on_policy` on the real FSDP2 actor group (Ray actors, gloo, world 1 and 2): one `train` call makes
exactly one optimizer step over each rank's whole shard, for fixed and token-budget micro-batches, and the step lands
where one full-batch step with the global token-mean loss lands (the same gradient norm, the same weights). Without
old log-probs (the plan's `old_logprob_pass` off, Molt B28) π_old is the training forward itself: the PPO ratio is
exactly 1 and nothing is clipped, while the IS correction against the engine's log-probs still weighs the loss.

Under the same plan without force_on_policy, these batches would take 4 / world (fixed) or 8 / (2 world) (token
budget) optimizer steps: the windows are 2 rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from loop_support import ROOT, trainer_rl
from test_trainer import make_batch

from runtime import algo
from runtime.trainer import start_trainer_group, token_logprobs

pytestmark = pytest.mark.slow

MODEL = str(ROOT / "recipes/data/demo_math/model")
IS = dict(level="token", mode="clip", low=0.8, high=1.2)
FIXED = dict(dynamic_batch_max_tokens=None, local_batch_size=None)
BUDGET = dict(dynamic_batch_max_tokens=24, local_batch_size=2)  # 2-3 rows per micro-batch, windows of 2 rows


def plan(world: int, batching: dict):
    return trainer_rl(
        world, ref=False,
        trainer=dict(micro_batch_size=2, grad_accum=1, max_epochs=1, temperature=0.7, seed=0, packing=False,
                     force_on_policy=True, old_logprob_pass=False, **batching),
        # eps 1e-3 as in test_trainer.py: Adam's first step then follows the gradient, not its fp32 rounding.
        optimizer=dict(lr=1e-2, betas=[0.9, 0.95], eps=1e-3, weight_decay=0.01, max_norm=0.0, scheduler="constant",
                       warmup_steps=0, total_steps=10, min_lr_ratio=0.1),
        loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0),
        is_correction=IS)


# Two groups, not four: each start costs seconds of CI; fixed micro-batches split by rank are test_trainer.py's case.
@pytest.mark.parametrize(("world", "batching"), [(1, FIXED), (2, BUDGET)], ids=["world1-fixed", "world2-token-budget"])
def test_one_step_per_batch_equals_the_full_batch_step(local_ray, world, batching):
    import ray
    from transformers import AutoModelForCausalLM

    rl = plan(world, batching)
    group = start_trainer_group(rl, [dict(num_cpus=1, resources={"device_slot": 1})] * world)
    try:
        ref_model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
        opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.01)
        batch = make_batch(8)
        mask = batch.action_mask
        g = torch.Generator().manual_seed(1)
        probe = batch.sequences[0].tolist()

        def reference_step(old: torch.Tensor | None, advantages, rollout) -> tuple[float, torch.Tensor]:
            """One AdamW step of the whole batch: loss normalised by all its action tokens; (grad norm, log-probs)."""
            logp, _ = token_logprobs(ref_model, batch.sequences, batch.attention_mask, rl.trainer.temperature)
            old = logp.detach() if old is None else old
            is_out = algo.is_correction(old, rollout, mask, **IS)
            out = algo.actor_loss(logp, old, advantages, mask, mode="ppo", clip_low=0.2, clip_high=0.2,
                                  global_num_tokens=mask.sum(), is_coef=is_out.coef)
            out.loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), float("inf"))
            opt.step()
            opt.zero_grad()
            return float(norm), logp.detach()

        # 1. π_old given (the trainer's no-grad pass): one step, the full-batch gradient.
        old, _ = group.forward_logprobs(ray.put(batch))
        advantages = torch.randn(mask.shape, generator=g) * mask
        rollout = (old + 0.1 * torch.randn(mask.shape, generator=g)) * mask  # an engine that disagrees a little
        stats = group.train(ray.put(replace(batch, old_log_probs=old, advantages=advantages,
                                            rollout_log_probs=rollout)), kl_coef=0.0)
        norm, _ = reference_step(old, advantages, rollout)
        assert stats["optimizer_steps"] == 1 and stats["tokens"] == mask.sum().item()
        assert stats["grad_norm"] == pytest.approx(norm, rel=1e-4), (stats["grad_norm"], norm)
        moved = (_probe(ref_model, probe) - _probe(AutoModelForCausalLM.from_pretrained(MODEL), probe)).abs().max()
        assert moved > 1e-3, moved  # the step did something
        _assert_same_policy(group, ref_model, probe)

        # 2. No π_old (no old-logprob pass): the training forward is π_old, ratio exactly 1, IS still applies.
        advantages = torch.randn(mask.shape, generator=g) * mask
        rollout = (old + 0.3 * torch.randn(mask.shape, generator=g)) * mask
        stats = group.train(ray.put(replace(batch, old_log_probs=None, advantages=advantages,
                                            rollout_log_probs=rollout)), kl_coef=0.0)
        norm, logp = reference_step(None, advantages, rollout)
        assert stats["optimizer_steps"] == 1
        assert stats["ratio_mean"] == 1.0 and stats["clip_ratio"] == 0.0 and stats["policy_kl"] == 0.0
        clipped = algo.is_correction(logp, rollout, mask, **IS).coef
        assert ((clipped != 1.0) & mask.bool()).any()  # the IS weights are not all 1: the check below sees them
        assert stats["grad_norm"] == pytest.approx(norm, rel=1e-4), (stats["grad_norm"], norm)
        _assert_same_policy(group, ref_model, probe)
    finally:
        group.shutdown()


def _probe(model, probe: list[int]) -> torch.Tensor:
    seq = torch.tensor([probe])
    with torch.no_grad():
        return token_logprobs(model, seq, torch.ones_like(seq, dtype=torch.bool), 1.0)[0][0]


def _assert_same_policy(group, ref_model, probe: list[int]) -> None:
    """The trained FSDP policy scores a probe sequence as the single-process reference does (both at temperature 1)."""
    diff = (torch.tensor(group.probe_logprobs(probe)) - _probe(ref_model, probe)).abs().max()
    assert diff < 1e-4, diff
