"""The MoE demo (recipes/demo_moe.yaml: tiny Qwen3-MoE on the automodel backend, hf engine, routing replay, frozen
fp32 router) trains on a real local Ray cluster with 2 ranks of nemo-automodel's own Qwen3-MoE at expert parallelism
2 (its mesh and parallelizer: 2 of the 4 experts per rank, the torch token dispatcher): the routing reaches the
trainer and is replayed, the aux losses are reported, and the engine (transformers' Qwen3-MoE) serves the trainer's
weights after every sync (gathered from the EP-sharded experts, mapped to transformers' layout)."""

from __future__ import annotations

import pytest
from loop_support import run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 4
SETS = (  # a short run: 4 steps of 4 groups x 8 samples, one optimizer step each
    "name=test-e2e-moe",
    "rollout.batch_size=4",
    "rollout.generate_batch_size=4",
    "rollout.n_samples_per_prompt=8",
    "train.batch_size=32",
    "train.micro_batch_size=8",
    f"data.max_samples={STEPS * 4}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-moe/state",
    "logging.tensorboard_dir=null",
    "actor.mesh.ep=2",
)


def test_moe_demo_trains_with_routing_replay(local_ray):
    plan, result, records = run_recipe("recipes/demo_moe.yaml", *SETS)
    t = plan.rl.trainer
    assert plan.rl.model.backend == "automodel" and plan.rl.model.moe_dispatcher == "torch"
    assert t.mesh.ep == t.world == 2
    assert t.routing_replay and t.freeze_moe_router and plan.rl.engines.routed_experts
    steps = step_records(records)
    assert result.status == "finished" and len(steps) == STEPS
    for r in steps:
        # replayed: the routing came with every batch (a batch without it raises in the trainer)
        assert 0.0 < r["train/moe/router_agreement"] <= 1.0
        assert r["train/moe/load_balancing_loss"] >= 1.0 and r["train/moe/router_z_loss"] > 0
        assert r["weight_sync/logprob_diff_max"] < 1e-4
