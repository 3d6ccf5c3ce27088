"""The RL runtime refuses, before starting anything, plan settings it does not implement (instead of training
something other than what the recipe says)."""

import subprocess
import sys
from pathlib import Path

from molt_compile.compile import compile_recipe
from runtime.loop import unsupported_features

ROOT = Path(__file__).resolve().parents[2]


def plan_of(recipe: str, *sets: str):
    result = compile_recipe(ROOT / "recipes" / recipe, sets)
    assert result.plan is not None, [d.message for d in result.diagnostics if d.severity == "error"]
    return result.plan


def test_the_demo_uses_only_implemented_features():
    assert unsupported_features(plan_of("demo_math.yaml")) == []
    assert unsupported_features(plan_of("demo_math_hf.yaml")) == []


def test_gpu_recipes_name_what_is_missing():
    assert unsupported_features(plan_of("qwen3_4b_math.yaml")) == ["actor.packing"]
    glm = unsupported_features(plan_of("glm5_ep256.yaml"))
    assert "actor.mesh tp/cp/ep/pp = 1/16/256/1 (only 1/1/1/1)" in glm and "actor.packing" in glm
    assert "train.routing_replay" in glm


def test_entrypoint_refuses_with_one_line_and_exit_2(tmp_path):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan_of("qwen3_4b_math.yaml").to_json())
    proc = subprocess.run([sys.executable, "-m", "runtime", str(plan_file)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{plan_file}: not implemented by this runtime yet: actor.packing"
