"""Helpers of the runtime's end-to-end tests (imported as a sibling module, like agents_fakes)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[2]


def compile_plan(recipe: str, *sets: str):
    """Compile `recipe` (relative to the project root) with --set overrides; the plan or a failed assertion."""
    from molt_compile.compile import compile_recipe

    result = compile_recipe(ROOT / recipe, sets=list(sets))
    assert result.plan is not None, "\n".join(f"{d.code} {d.path}: {d.message}" for d in result.diagnostics)
    return result.plan


def fresh_out_dirs(plan) -> None:
    """Remove what an earlier run of the same test left (metrics, checkpoints, exports)."""
    rl = plan.rl
    for d in (rl.logging.out_dir, rl.ckpt.dir, rl.ckpt.hf_dir, rl.logging.tensorboard_dir):
        if d:
            shutil.rmtree(ROOT / d, ignore_errors=True)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_recipe(recipe: str, *sets: str):
    """Compile, clear what an earlier run left, run on the current Ray instance: (plan, result, metric records)."""
    from runtime.loop import run

    plan = compile_plan(recipe, *sets)
    fresh_out_dirs(plan)
    result = run(plan, live=False)
    return plan, result, read_metrics(result.metrics_path)


def step_records(records: list[dict]) -> list[dict]:
    """The per-step records (eval and run-summary records left out)."""
    return [r for r in records if "rollout/reward_mean" in r]


def trainer_rl(world: int, *, ref: bool = True, model: dict | None = None, trainer: dict | None = None,
               optimizer: dict | None = None, loss: dict | None = None, kl: dict | None = None,
               is_correction: dict | None = None, device: str = "cpu", dist_backend: str = "gloo"):
    """The demo recipe's compiled `rl` section with a test's trainer settings: what `start_trainer_group` takes
    (a `PolicyWorker` takes its trainer/model/ref/algo/device/dist_backend sections). Paths are absolute, so it works
    from any directory; the model is the demo's tiny Qwen3 in fp32 with sdpa attention unless `model` says otherwise.
    """
    from schemas.plan import RefPlan

    rl = compile_plan("recipes/demo_math.yaml").rl
    path = str(ROOT / "recipes/data/demo_math/model")
    t, a = rl.trainer, rl.algo
    isc = dict(is_correction or {})
    if "level" in isc:  # as the compiler lowers a level (`algo.is_correction.enabled`)
        isc.setdefault("enabled", isc["level"] != "off")
    return rl.model_copy(update={
        "device": device, "dist_backend": dist_backend,
        "model": rl.model.model_copy(update={"path": path, "dtype": "float32", "attn": "sdpa",
                                             "gradient_checkpoint": "none", **(model or {})}),
        "trainer": t.model_copy(update={"world": world, "dp": world, **(trainer or {}),
                                        "optimizer": t.optimizer.model_copy(update=optimizer or {}),
                                        "loss": t.loss.model_copy(update=loss or {})}),
        "ref": RefPlan.model_construct(path=path, colocated=True, world=world, dp=world, grad_accum=1) if ref else None,
        "algo": a.model_copy(update={"kl": a.kl.model_copy(update=kl or {}),
                                     "is_correction": a.is_correction.model_copy(update=isc)}),
    })
