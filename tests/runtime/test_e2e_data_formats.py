"""A real RL run (hf engine, 2 FSDP2 ranks, local Ray) whose prompts are a parquet file and whose eval set is a
`save_to_disk` directory, logging to W&B offline: the generator reads both through `datasets`, the compiler counted
both from their headers, and the W&B run holds the same per-step metrics as metrics.jsonl."""

from __future__ import annotations

import json
import os

import pytest
from loop_support import ROOT, run_recipe, step_records
from wandb_files import read_run

pytestmark = pytest.mark.slow

STEPS = 3


def _write_formats(out) -> tuple[str, str]:
    import datasets

    def rows(name):
        return [json.loads(line) for line in (ROOT / f"recipes/data/demo_math/{name}.jsonl").read_text().splitlines()]

    datasets.Dataset.from_list(rows("train")).to_parquet(str(out / "train.parquet"))
    datasets.Dataset.from_list(rows("eval")).save_to_disk(str(out / "eval"))
    return str(out / "train.parquet"), str(out / "eval")


@pytest.fixture(scope="module")
def formats_run(local_ray, tmp_path_factory):
    os.environ["WANDB_MODE"] = "offline"  # never the network, even where a key is set
    train, evals = _write_formats(tmp_path_factory.mktemp("formats"))
    plan, result, records = run_recipe(
        "recipes/demo_math.yaml", "name=test-e2e-formats", "rollout.engine=hf", f"data.prompts={train}",
        f"data.max_samples={STEPS * 8}", f"eval.dataset={evals}", "eval.every=-1", "ckpt.every=-1",
        "ckpt.final_save=false", "ckpt.dir=../ckpt/test-e2e-formats/state", "logging.tensorboard_dir=null",
        "logging.wandb={project: molt-test}")
    return plan, result, records


def test_parquet_prompts_and_a_save_to_disk_eval_set_train(formats_run):
    plan, result, records = formats_run
    assert plan.rl.data.prompt_count == STEPS * 8 and plan.rl.schedule.total_steps == STEPS
    assert result.status == "finished" and len(step_records(records)) == STEPS
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0], "the at-start eval ran on the save_to_disk rows"


def test_the_wandb_run_holds_the_step_metrics(formats_run):
    plan, _, records = formats_run
    (run_dir,) = [p for p in (ROOT / plan.rl.logging.out_dir / "wandb").glob("offline-run-*") if p.is_dir()]
    run = read_run(run_dir)
    assert (run["project"], run["name"]) == ("molt-test", "test-e2e-formats")
    logged = {h["_step"]: h["rollout/reward_mean"] for h in run["history"] if "rollout/reward_mean" in h}
    assert logged == {r["step"]: r["rollout/reward_mean"] for r in step_records(records)}
