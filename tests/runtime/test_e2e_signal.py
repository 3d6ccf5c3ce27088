"""`python -m runtime PLAN.json` as a user runs it: SIGTERM mid-run stops cleanly (the generator is cancelled, the
cluster it started is shut down), saves the step it stopped at (issue 32.8: a save fits in the stop bound; the
plan's own cadence has not saved anything yet) and the last lines say where things stand; exit status 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from loop_support import ROOT, compile_plan, fresh_out_dirs

pytestmark = pytest.mark.slow


def test_sigterm_stops_cleanly_and_reports_where_it_stands(tmp_path):
    plan = compile_plan("recipes/demo_math.yaml", "name=test-e2e-signal", "rollout.engine=hf", "eval.dataset=null",
                        "ckpt.every=1000", "ckpt.final_save=false", "ckpt.dir=../ckpt/test-e2e-signal/state",
                        "logging.tensorboard_dir=null")
    fresh_out_dirs(plan)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"HF_HUB_OFFLINE": "1"}
    # Its own session: the signal goes to the driver only, as `ray job stop` or a scheduler would send it.
    proc = subprocess.Popen([sys.executable, "-m", "runtime", str(plan_file)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = ROOT / plan.rl.logging.out_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count('"rollout/reward_mean"') >= 3:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    tail = out.strip().splitlines()[-6:]
    stopped = next(line for line in tail if line.startswith("stopped at step"))
    assert "prompts consumed" in stopped and "trained" in stopped
    step = int(stopped.split()[3].rstrip(":"))
    # (an engine's progress bar may share the line: its text, not the line, is what counts)
    saved = [line for line in out.splitlines() if "checkpoint" in line]
    assert f"test-e2e-signal/state/step_{step:06d}\n" in out and "last checkpoint: " in out, saved
    assert f"checkpointed step {step} before stopping" in out, saved
    assert tail[-1].startswith("plot: ")
