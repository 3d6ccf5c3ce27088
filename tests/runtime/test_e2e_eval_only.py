"""An evaluation-only run (`eval.only`) on a real local Ray cluster: the plan has no trainer, so no FSDP rank and no
optimizer start; the engine loads HF weights (the distillation demo's teacher, recipes/data/demo_math/teacher),
every eval prompt gets 8 samples, and the run reports pass@k with the unbiased estimator, writes
`eval_results.json` under its run directory, and exits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from loop_support import run_recipe

from runtime.eval_only import RESULTS_FILE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def eval_only_run(local_ray):
    plan, result, records = run_recipe(
        "recipes/demo_math.yaml", "name=test-e2e-eval-only", "eval.only=true", "model.path=recipes/data/demo_math/teacher",
        "eval.n_samples_per_prompt=8", "ckpt.dir=../ckpt/test-e2e-eval-only/state",
        "ckpt.hf_dir=../ckpt/test-e2e-eval-only/hf", "logging.tensorboard_dir=null")
    return plan, result, records, json.loads((Path(plan.rl.logging.out_dir) / RESULTS_FILE).read_text())


def test_eval_only_reports_pass_at_k(eval_only_run):
    plan, result, records, results = eval_only_run
    assert plan.rl.trainer is None and not any(r.name in ("actor", "trainer") for r in plan.roles)
    assert result.status == "finished" and result.step == 0 and result.last_checkpoint is None
    assert [r["eval/pass@1"] for r in records] == [results["metrics"]["eval/pass@1"]]  # one record, step 0
    m, prompts = results["metrics"], results["prompts"]
    assert results["model"].endswith("teacher") and results["pass_k"] == [1, 2, 4, 8]
    assert len(prompts) == 9 and all(p["n"] == 8 and len(p["scores"]) == 8 for p in prompts)
    assert m["eval/num_samples"] == 72 and m["eval/pass@1"] == pytest.approx(m["eval/pass1"])
    assert m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@4"] <= m["eval/pass@8"]
    assert m["eval/pass@8"] == pytest.approx(sum(p["correct"] > 0 for p in prompts) / 9)
    assert m["eval/pass@1"] > 0.8  # the teacher knows the sums (sampled: 0.99 of 144 in a plain generate check)
