"""Score centering on the real stack (local Ray, the hf engine, 2 FSDP2 ranks): the engine's top-k of every
generated token reaches the loss through runners, generator, queue and the ranks' micro-batches. At the first step
the trainer still has the engine's weights, so the policy's mass on the engine's top-k ids must equal the engine's
own: a top-k row shifted by one position, or given to the wrong row, would put it on other ids."""

from __future__ import annotations

import pytest
from loop_support import run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 1
SETS = (
    "name=test-e2e-centering",
    "rollout.engine=hf",
    "algo.score_centering_top_k=4",
    "algo.is_correction.level=token",  # centering composes with token-level IS only (SC005)
    "rollout.batch_size=4",  # one small step: 4 groups x 4 samples, one optimizer step
    "rollout.generate_batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "train.batch_size=16",
    "train.micro_batch_size=4",
    f"data.max_samples={STEPS * 4}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-centering/state",
    "logging.tensorboard_dir=null",
)


@pytest.fixture(scope="module")
def centering_run(local_ray):
    plan, result, records = run_recipe("recipes/demo_math.yaml", *SETS)
    assert plan.rl.algo.score_centering_top_k == 4 and plan.rl.sampling.top_logprobs == 4
    assert plan.rl.eval.sampling.top_logprobs == 0
    return result, step_records(records)


def test_centering_run_trains_on_the_engines_top_k(centering_run):
    result, steps = centering_run
    assert result.status == "finished" and len(steps) == STEPS
    first = steps[0]
    sampler, policy = first["train/score_centering_sampler_head_mass"], first["train/score_centering_policy_head_mass"]
    assert 0.5 < sampler <= 1.0  # the demo model is sharp: its top 4 hold most of the mass
    assert abs(sampler - policy) < 1e-4, (sampler, policy)
