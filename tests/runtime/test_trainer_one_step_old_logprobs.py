"""One optimizer step per rollout batch without force_on_policy (one epoch, train batch = rollout batch): the
compiler turns the old-logprob pass off (Molt B28 widened) and the trainer's step is exact without it.

A real FSDP2 rank (gloo, world 1, fp32) trains the same batch twice from the same weights (lr 0): once with π_old
from the no-grad pass the loop would run, once without it (the plan's `old_logprob_pass` off: the training
forward's detached log-probs serve). Both make exactly one optimizer step; the gradients agree to fp32 rounding and
the PPO ratio of the second is exactly 1. The compiled demo recipe with the batch sizes made equal carries the pass
off, with the reason `explain` prints.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.multiprocessing as mp
from loop_support import trainer_rl
from test_trainer_packing import skewed_batch

from molt_compile.derive import derive
from tests.plan_support import rl as rl_recipe


def _rank_main(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    from runtime.trainer import PolicyWorker

    plan = trainer_rl(  # 8 rows, micro 2 x accum 4: one window, as train.batch_size = samples per rollout batch
        1, ref=False,
        trainer={"micro_batch_size": 2, "grad_accum": 4, "max_epochs": 1, "temperature": 0.7, "seed": 0,
                 "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                 "force_on_policy": False, "old_logprob_pass": False},
        optimizer=dict(lr=0.0, max_norm=0.0, scheduler="constant", warmup_steps=0, total_steps=10),
        loss=dict(mode="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None, entropy_coef=0.0),
        kl=dict(use_loss=False), is_correction=dict(level="token", mode="clip", low=0.8, high=1.2))
    worker = PolicyWorker(plan.trainer, plan.model, plan.ref, plan.algo, plan.device, plan.dist_backend, rank,
                          "127.0.0.1", port)
    grads: list[list[torch.Tensor]] = []
    real_step = worker._optimizer_step

    def record_then_step() -> float:
        grads.append([p.grad.full_tensor().clone() for p in worker.model.parameters()])
        return real_step()

    worker._optimizer_step = record_then_step
    batch = skewed_batch()
    mask = batch.action_mask
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(mask.shape, generator=g) * mask
    _, old, _ = worker.forward_logprobs(batch)
    rollout = (old + 0.1 * torch.randn(mask.shape, generator=g)) * mask
    step = replace(batch, advantages=advantages, rollout_log_probs=rollout)
    with_pass = worker.train(replace(step, old_log_probs=old), 0.0)
    without = worker.train(replace(step, old_log_probs=None), 0.0)
    torch.save({"with": with_pass, "without": without, "grads": grads}, out)
    worker.shutdown()


def test_one_step_per_batch_needs_no_old_logprob_pass(tmp_path):
    from runtime.trainer import free_port

    d = derive(rl_recipe(rollout={"batch_size": 8, "n_samples_per_prompt": 8},
                         train={"batch_size": 64, "max_epochs": 1}))
    assert d.value("actor.old_logprob_pass") is False
    assert "one optimizer step per rollout batch" in d["actor.old_logprob_pass"].reason

    out = str(tmp_path / "r.pt")
    mp.spawn(_rank_main, args=(free_port(), out), nprocs=1, join=True)
    r = torch.load(out)
    assert r["with"]["optimizer_steps"] == 1 and r["without"]["optimizer_steps"] == 1
    mean = {k: {m: v[f"{m}_x_tokens"] / v["tokens"] for m in ("ratio_mean", "clip_ratio")} for k, v in r.items()
            if k != "grads"}
    assert mean["without"] == {"ratio_mean": 1.0, "clip_ratio": 0.0}
    assert r["with"]["grad_norm"] > 0
    first, second = r["grads"]
    for a, b in zip(first, second, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    assert abs(mean["with"]["ratio_mean"] - 1.0) < 1e-5  # the no-grad pass and the training forward agree
