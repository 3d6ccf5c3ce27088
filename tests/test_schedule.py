"""Data that is not on the compiling machine (issue 30.1): the recipe compiles with DATA010, and the job derives the
step count and LR schedule at start with the compiler's own function (schemas/schedule.py), to the same values the
compiler writes when it can count the rows."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from schemas.schedule import DataNotCounted, at_job_start

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "recipes" / "data" / "demo_math"


def _plan(recipe: str, *sets: str):
    result = compile_recipe(ROOT / recipe, sets=list(sets))
    assert result.plan is not None, [(d.code, d.message) for d in result.diagnostics if d.severity == "error"]
    return result


@pytest.mark.parametrize("gae", [False, True], ids=["grpo", "gae-critic"])
def test_rl_job_derives_at_start_what_the_compiler_derives_when_it_can_count(tmp_path, gae):
    prompts = tmp_path / "train.jsonl"
    sets = [f"data.prompts={prompts}", "data.max_samples=200"]
    recipe = "recipes/demo_math_gae.yaml" if gae else "recipes/demo_math.yaml"
    deferred = _plan(recipe, *sets)
    assert [d.code for d in deferred.diagnostics if d.severity != "info"] == ["DATA010"]
    assert deferred.plan.rl.schedule.total_steps is None and deferred.plan.rl.data.count_at_start is not None
    with pytest.raises(DataNotCounted, match="cannot count its prompts"):
        at_job_start(deferred.plan)
    shutil.copy(DEMO / "train.jsonl", prompts)  # the data appears after compiling
    at_start, lines = at_job_start(deferred.plan)
    counted = _plan(recipe, *sets).plan  # compiled where the data is: derived at compile time, as before
    assert counted.rl.data.count_at_start is None and counted.rl.schedule.total_steps == 200 // 8
    assert at_start.rl.schedule == counted.rl.schedule
    assert at_start.rl.trainer == counted.rl.trainer
    assert at_start.rl.critic == counted.rl.critic
    assert at_start.rl.data.prompt_count == counted.rl.data.prompt_count == 200
    assert "data.prompt_count = 200" in lines[0] and any("train.total_steps" in line and "= 25" in line for line in lines)


def test_sft_job_derives_its_steps_and_per_epoch_eval_at_start(tmp_path):
    rows = tmp_path / "train.jsonl"
    sets = [f"data.dataset={rows}"]
    deferred = _plan("recipes/demo_sft.yaml", *sets).plan
    assert deferred.sft.schedule.eval_every is None and deferred.sft.data.count_at_start.eval_every_epoch
    shutil.copy(ROOT / "recipes/data/demo_sft/train.jsonl", rows)
    at_start, _ = at_job_start(deferred)
    counted = _plan("recipes/demo_sft.yaml", *sets).plan
    assert at_start.sft.schedule == counted.sft.schedule and counted.sft.schedule.eval_every
    assert at_start.sft.trainer == counted.sft.trainer


def test_zero_steps_at_start_is_refused_as_batch009_would(tmp_path):
    prompts = tmp_path / "train.jsonl"
    deferred = _plan("recipes/demo_math.yaml", f"data.prompts={prompts}").plan
    prompts.write_text("".join(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n" for _ in range(3)))
    with pytest.raises(DataNotCounted, match="BATCH009"):
        at_job_start(deferred)


def test_every_launch_recipe_compiles_without_its_data_with_a_deferral_warning():
    """Through the real program: no launch recipe fails for its data; each says what is deferred (DATA010)."""
    proc = subprocess.run([sys.executable, "-m", "molt_compile.cli", "lint", "recipes/", "--format", "json"],
                          capture_output=True, cwd=ROOT, text=True)
    out = json.loads(proc.stdout)
    data_errors = [d for d in out["diagnostics"]
                   if d["severity"] == "error" and d["path"] in ("data.prompts", "data.dataset")]
    assert data_errors == []
    deferred = {Path(d["file"]).name for d in out["diagnostics"] if d["code"] == "DATA010"}
    assert {"qwen3_4b_math.yaml", "sft_qwen3_4b.yaml", "glm5_ep256.yaml"} <= deferred
    assert all("step count" in d["message"] and "LR schedule" in d["message"] and "DATA006" in d["message"]
               for d in out["diagnostics"] if d["code"] == "DATA010")
    sft = subprocess.run([sys.executable, "-m", "molt_compile.cli", "recipes/sft_qwen3_4b.yaml"],
                         capture_output=True, cwd=ROOT, text=True)
    assert sft.returncode == 0, sft.stdout[-2000:]


def test_a_catalog_hub_id_without_arch_keeps_the_shape_checks_and_an_unknown_one_says_which_are_off():
    """Issue 30.2, through the real program: `Qwen/Qwen3-8B` is the catalog's qwen3-8b row (TP 3 cannot split its
    32 heads: VLLM009); a model whose shape cannot be read at all is a MODEL005 warning naming the checks that are off."""
    def program(recipe: str):
        proc = subprocess.run([sys.executable, "-m", "molt_compile.cli", recipe, "--format", "json"],
                              capture_output=True, cwd=ROOT, text=True)
        return proc.returncode, {d["code"]: d for d in json.loads(proc.stdout)["diagnostics"]}

    status, found = program("tests/rules/VLLM009_3.yaml")
    assert status == 1 and "VLLM009" in found and "MODEL005" not in found
    status, found = program("tests/rules/MODEL005_1.yaml")
    assert found["MODEL005"]["severity"] == "warning" and "VLLM009" in found["MODEL005"]["message"] and "MEM001" in found["MODEL005"]["message"]
