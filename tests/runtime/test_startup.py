"""Nothing compiles clean that the runtime refuses: every plan the compiler accepts passes the runtime's start-up.

The property test mutates the shipped recipes with the settings users flip (hypothesis draws a few at a time) and
compiles each; for every plan the compiler accepts, `startup_problems` (the capability table as the runtime reads
it; the actors take their plan sections as they are) must be empty. A plan compiled without the
capability pass stands for one from another build of molt-compile: the entrypoint refuses it in one line, exit 2.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_compile.compile import compile_recipe
from runtime.plan_file import startup_problems

ROOT = Path(__file__).resolve().parents[2]

RECIPES = ["recipes/demo_math.yaml", "recipes/demo_math_hf.yaml", "recipes/demo_tool.yaml", "recipes/demo_sft.yaml",
           "recipes/qwen3_4b_math_quickstart.yaml", "recipes/sft_qwen3_4b_quickstart.yaml",
           "recipes/qwen3_6_35b_geo3k_quickstart.yaml"]
MUTATIONS = [
    "actor.packing=true", "actor.packing=false", "train.dynamic_batch={max_tokens_per_gpu: 4096}",
    "model.attn=flash_attention_2", "model.backend=automodel", "model.backend=hf", "actor.offload=optimizer",
    "actor.mesh.tp=2", "actor.mesh.cp=2", "actor.mesh.ep=2", "train.routing_replay=true", "train.force_on_policy=true",
    "train.full_determinism=true", "algo.estimator=gae", "algo.estimator=grpo", "algo.kl.coef=0.01",
    "ref={placement: separate, nodes: 1, gpus_per_node: 1}", "ref={placement: colocate}", "eval.only=true",
    "logging.wandb={project: p}", "logging.wandb=null", "data.max_images_per_prompt=1", "data.max_images_per_prompt=0",
    "ckpt.max_disk_gb=10", "ckpt.warm_resume_rollouts=true", "train.async.queue_size=1", "train.async.queue_size=3",
    "train.async.partial_rollout=true", "actor.optimizer.name=muon", "rollout.engine=hf", "cluster.gpu=h100-80gb",
    "cluster.gpu=cpu", "data.prompts=recipes/data/demo_math/train.jsonl",
    # Molt 0.2.1 keys
    "actor.lora={dim: 8, target_modules: ['*.q_proj']}", "algo.estimator=flash_reinforce",
    "algo.score_centering_top_k=8", "actor.loss.agg_mode=prompt-mean-token-mean",
    "algo.stop_properly_penalty_coef=-1.0", "algo.kl={coef: 0.01, estimator: k3, use_loss: true, ref: rollout}",
]


def _compile(recipe: str, sets: list[str], capabilities: bool = True):
    with contextlib.chdir(ROOT):
        return compile_recipe(recipe, sets, capabilities=capabilities)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=st.sampled_from(RECIPES), sets=st.lists(st.sampled_from(MUTATIONS), max_size=4, unique=True))
def test_every_accepted_plan_passes_the_runtime_start_up(recipe, sets):
    result = _compile(recipe, sets)
    if result.plan is not None:
        with contextlib.chdir(ROOT):
            assert startup_problems(result.plan) == []


def test_the_shipped_demos_are_accepted_and_start():
    for recipe in RECIPES[:4]:
        result = _compile(recipe, [])
        assert result.plan is not None, [d.message for d in result.diagnostics if d.severity == "error"]
        with contextlib.chdir(ROOT):
            assert startup_problems(result.plan) == []


def test_a_plan_from_another_build_is_refused_in_one_line_with_exit_2(tmp_path):
    plan = _compile("recipes/sft_qwen3_4b.yaml", ["actor.optimizer.name=muon"], capabilities=False).plan
    assert plan is not None
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    proc = subprocess.run([sys.executable, "-m", "runtime", str(plan_file)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith(f"{plan_file}: this plan cannot run on this build of the runtime: actor.optimizer.name")
    assert "capability sft-muon" in line and "\n" not in line
