"""A real RL run (hf engine, 2 FSDP2 ranks, local Ray) whose prompts are a parquet file and whose eval set is a
`save_to_disk` directory, logging to W&B offline: the generator reads both through `datasets`, and the W&B run holds
the same per-step metrics as metrics.jsonl. The parquet file is written only after compiling (data staged on the
cluster after the plan was made, issue 30): the plan defers the step count (DATA010), and the job counts the file
from its header at start, derives the steps and LR schedule with the compiler's function, prints them, and trains."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest
from loop_support import ROOT, compile_plan, fresh_out_dirs, read_metrics, step_records
from wandb_files import read_run

pytestmark = pytest.mark.slow

STEPS = 3


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / f"recipes/data/demo_math/{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def formats_run(local_ray, tmp_path_factory):
    import datasets

    from runtime.loop import run

    os.environ["WANDB_MODE"] = "offline"  # never the network, even where a key is set
    out = tmp_path_factory.mktemp("formats")
    train, evals = out / "train.parquet", out / "eval"
    datasets.Dataset.from_list(_rows("eval")).save_to_disk(str(evals))
    plan = compile_plan(
        "recipes/demo_math.yaml", "name=test-e2e-formats", "rollout.engine=hf", f"data.prompts={train}",
        f"data.max_samples={STEPS * 8}", f"eval.dataset={evals}", "eval.every=-1", "ckpt.every=-1",
        "ckpt.final_save=false", "ckpt.dir=../ckpt/test-e2e-formats/state", "logging.tensorboard_dir=null",
        "logging.wandb={project: molt-test}")
    datasets.Dataset.from_list(_rows("train")).to_parquet(str(train))  # the data appears after compiling
    fresh_out_dirs(plan)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        result = run(plan, live=False)
    return plan, result, read_metrics(result.metrics_path), printed.getvalue()


def test_parquet_prompts_staged_after_compiling_and_a_save_to_disk_eval_set_train(formats_run):
    plan, result, records, printed = formats_run
    assert plan.rl.data.prompt_count is None and plan.rl.schedule.total_steps is None, "deferred to the job's start"
    assert f"data.prompt_count = {STEPS * 8}" in printed and re.search(rf"train.total_steps += {STEPS} ", printed)
    assert result.status == "finished" and len(step_records(records)) == STEPS
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0], "the at-start eval ran on the save_to_disk rows"


def test_the_wandb_run_holds_the_step_metrics(formats_run):
    plan, _, records, _ = formats_run
    (run_dir,) = [p for p in (ROOT / plan.rl.logging.out_dir / "wandb").glob("offline-run-*") if p.is_dir()]
    run = read_run(run_dir)
    assert (run["project"], run["name"]) == ("molt-test", "test-e2e-formats")
    logged = {h["_step"]: h["rollout/reward_mean"] for h in run["history"] if "rollout/reward_mean" in h}
    assert logged == {r["step"]: r["rollout/reward_mean"] for r in step_records(records)}
