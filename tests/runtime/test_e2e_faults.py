"""Faults on a real local Ray cluster (hf engine, 2 FSDP2 ranks): an `Env.step` that raises drops that rollout with
reason `agent_error`; a runner process killed mid-run is restarted by Ray and its in-flight groups are re-sent; no
prompt is lost (consumed = trained + dropped with a reason)."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import pytest
from loop_support import ROOT, compile_plan, fresh_out_dirs, read_metrics

pytestmark = pytest.mark.slow

STEPS = 16  # long enough after the kill for Ray to restart the runner on a loaded 2-core machine
SETS = (
    "name=test-e2e-faults",
    "rollout.engine=hf",
    f"agent.path={ROOT / 'tests/runtime/agents/faulty_math.py'}",
    f"data.max_samples={STEPS * 8}",
    "eval.dataset=null",
    "ckpt.every=-1",
    "ckpt.final_save=false",
    "ckpt.dir=../ckpt/test-e2e-faults/state",
    "logging.tensorboard_dir=null",
)


def kill_runner_after_first_step(plan, killed: dict) -> None:
    """Wait for the first logged step, SIGKILL runner 0's process, then wait for Ray to bring it back."""
    import ray

    from runtime.roles import runner_name

    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and not (metrics.is_file() and '"rollout/reward_mean"' in metrics.read_text()):
        time.sleep(0.2)
    runner = ray.get_actor(runner_name(plan, 0))
    killed["pid"] = ray.get(runner.pid.remote())
    os.kill(killed["pid"], signal.SIGKILL)
    killed["at"] = time.time()
    while time.time() < deadline and "new_pid" not in killed:   # answered by the restarted actor
        try:
            killed["new_pid"] = ray.get(runner.pid.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.5)  # a call racing the death notice fails; the restarted actor answers later ones


@pytest.fixture(scope="module")
def faulty_run(local_ray):
    from runtime.loop import run

    plan = compile_plan("recipes/demo_math.yaml", *SETS)
    fresh_out_dirs(plan)
    killed: dict = {}
    killer = threading.Thread(target=kill_runner_after_first_step, args=(plan, killed), daemon=True)
    killer.start()
    result = run(plan, live=False)
    killer.join(timeout=60)
    return plan, result, read_metrics(result.metrics_path), killed


def test_env_exception_drops_only_that_rollout(faulty_run):
    _, result, records, _ = faulty_run
    # Dropped groups are backfilled until the 64 prompts run out; the last batch holds what is left.
    assert result.status == "finished" and result.step == math.ceil(result.accounting["prompts/trained"] / 8)
    agent_errors = sum(r.get("rollout/dropped/agent_error", 0) for r in records)
    assert agent_errors > 0
    # Groups survive a failing rollout: batches carry every group the step asked for (the last batch may be short:
    # the dataset runs out, because the groups of "2+2=" were dropped).
    groups = [r["rollout/num_prompt_groups"] for r in records if "rollout/num_prompt_groups" in r]
    assert all(g == 8 for g in groups[:-1]) and 0 < groups[-1] <= 8


def test_killed_runner_is_restarted_and_its_groups_resent(faulty_run):
    _, result, records, killed = faulty_run
    assert killed.get("new_pid") and killed["new_pid"] != killed["pid"], killed
    assert records[-1]["rollout/runner_failures"] >= 1
    assert records[-1]["rollout/runner_restarts"] >= 1  # the generator saw it come back and used it again
    assert result.accounting.get("prompts/dropped/agent_crash", 0) == 0


def test_no_prompt_lost(faulty_run):
    _, result, _, _ = faulty_run
    acc = result.accounting
    dropped = {k: v for k, v in acc.items() if k.startswith("prompts/dropped/")}
    assert acc["prompts/consumed"] == acc["prompts/trained"] + sum(dropped.values()) == STEPS * 8
    # "2+2=" fails in every rollout: each such group is dropped with a reason (and backfilled)
    assert dropped.get("prompts/dropped/all_rollouts_dropped", 0) >= 1
