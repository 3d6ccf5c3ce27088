"""`train.async.colocated_gpus: alternate` end to end: the demo with its hf engine colocated on trainer rank 0's
device, each training step holding the engine lock with the engine paused (runtime.engine_lock.trainer_turn), on a
real local Ray cluster: the run finishes (no step waits forever on the lock or a paused engine), every step takes its
turn, the engine serves the trainer's weights after each sync, and each batch's slot comes back after the previous
step's sync. With `rollout.min_new_tokens` at the cap (4), as the GPU benchmark runs it (bench_loop `+alternate+fixed`),
every response is full length: the demo's model answers in 2-3 tokens otherwise. That the engine generates nothing
during a turn is checked against a real engine actor in test_engines_hf.py."""

from __future__ import annotations

import pytest
from loop_support import run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 4
SETS = (
    "name=test-e2e-alternate",
    "rollout.engine=hf",
    "rollout.placement=colocate",
    "train.async.queue_size=1",
    "train.async.force_sync=true",
    "train.async.colocated_gpus=alternate",
    "rollout.min_new_tokens=4",  # = the demo's max_new_tokens
    "ignore.SAMP002=fixed-length responses as the GPU benchmark runs them",
    f"data.max_samples={STEPS * 8}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-alternate/state",
    "logging.tensorboard_dir=null",
)


@pytest.fixture(scope="module")
def alternate_run(local_ray):
    plan, result, records = run_recipe("recipes/demo_math.yaml", *SETS)
    assert plan.rl.queue.colocated_gpus == "alternate" and plan.rl.engines.kind == "hf"
    assert plan.rl.sampling.min_new_tokens == plan.rl.sampling.max_new_tokens == 4
    return result, step_records(records)


def test_every_step_takes_its_turn_and_the_engine_serves_its_weights(alternate_run):
    result, steps = alternate_run
    assert result.status == "finished" and len(steps) == STEPS
    for r in steps:
        # the turn was taken and the engine paused for it (both keys exist only under alternate); the phases are
        # disjoint parts of the step's wall time, so they add up to less than it (bench_loop's `untimed_s`)
        phases = ("actor_idle_wait", "engine_lock_wait", "engine_pause", "make_experience", "policy_train",
                  "weight_sync_total", "probe")
        assert r["timing/engine_lock_wait"] > 0.0 and r["timing/engine_pause"] > 0.0
        assert sum(r[f"timing/{k}"] for k in phases) < r["timing/step_total"]
        assert r["weight_sync/logprob_diff_max"] < 1e-4
        assert r["rollout/response_length_mean"] == 4.0 and r["rollout/truncated_rate"] == 1.0
        # force_sync + alternate: the batch's slot came back after the previous step's sync; groups carried
        # between batches (D12) may hold older tokens, never newer
        assert r["staleness"] == 0.0
        assert 0 <= r["rollout/policy_version_min"] <= r["rollout/policy_version_max"] <= r["step"] - 1
