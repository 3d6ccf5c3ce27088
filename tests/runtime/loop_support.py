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
