"""The demo recipe with the hf (transformers) engine instead of vLLM: a short async run on a real local Ray cluster
with 2 FSDP2 ranks must raise the reward, and the engine must serve the trainer's weights after every sync."""

from __future__ import annotations

import pytest
from loop_support import run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 40
SETS = (
    "name=test-e2e-hf",
    "rollout.engine=hf",
    "actor.optimizer.lr=5.0e-4",  # as recipes/demo_math_hf.yaml: at 1e-3 one hf run collapsed onto empty answers
    f"data.max_samples={STEPS * 8}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-hf/state",
    "logging.tensorboard_dir=null",
)


@pytest.fixture(scope="module")
def hf_run(local_ray):
    plan, result, records = run_recipe("recipes/demo_math.yaml", *SETS)
    assert plan.rl.engines.kind == "hf"
    return result, step_records(records)


def test_hf_engine_run_improves_reward(hf_run):
    result, steps = hf_run
    assert result.status == "finished" and len(steps) == STEPS
    rewards = [r["rollout/reward_mean"] for r in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > first + 0.08, f"mean reward of the first 5 steps {first:.3f}, of the last 10 {last:.3f}"


def test_hf_engine_serves_the_trainers_weights(hf_run):
    _, steps = hf_run
    assert max(r["weight_sync/logprob_diff_max"] for r in steps) < 1e-4
    # through the broadcast group, the same bytes every step
    assert len({r["weight_sync/bytes"] for r in steps}) == 1 and steps[0]["weight_sync/bytes"] > 0


def test_every_step_reports_the_policy_versions_it_trains_on(hf_run):
    """Each trained token's sampling version is known and no newer than the weights the step trains (step - 1);
    the queue is 2 deep and groups carry over between batches, so tokens lag those weights by 0 to a few steps."""
    _, steps = hf_run
    for r in steps:
        assert 0 <= r["rollout/policy_version_min"] <= r["rollout/policy_version_max"] <= r["step"] - 1
        assert r["rollout/policy_version_lag_max"] == r["step"] - 1 - r["rollout/policy_version_min"]
        assert 0 <= r["rollout/partial_tokens_frac"] <= 1 and 0 <= r["rollout/partial_samples_frac"] <= 1
        assert (r["rollout/partial_tokens_frac"] > 0) == (r["rollout/partial_samples_frac"] > 0)
    assert steps[0]["rollout/policy_version_max"] == 0  # the first batch: the checkpoint's weights only
    assert max(r["rollout/policy_version_lag_mean"] for r in steps) > 0  # asynchronous: some tokens are stale
