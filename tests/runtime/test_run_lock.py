"""Issue 32, item 5: one run per directory. A second `python -m runtime` of the same plan is refused at start, before
Ray, naming the holder's pid; the lock goes with its holder however it ends (SIGKILL leaves no stale lock)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
from loop_support import ROOT, compile_plan

from runtime.run_lock import DirectoryInUse, RunLock


def test_a_second_run_of_a_plan_is_refused_with_the_holders_pid(tmp_path):
    state = tmp_path / "ckpt"
    plan = compile_plan("recipes/demo_math.yaml", "name=test-run-lock", f"ckpt.dir={state}")
    out = ROOT / plan.rl.logging.out_dir  # runs/test-run-lock
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    holder = subprocess.Popen(  # the first run, as a real other process holding the run's lock
        [sys.executable, "-c", "import sys, time; from runtime.run_lock import RunLock\n"
         f"lock = RunLock([{str(out)!r}, {str(state)!r}]).acquire(); print('held', flush=True); time.sleep(120)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        second = subprocess.run([sys.executable, "-m", "runtime", str(plan_file)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"{plan.rl.logging.out_dir} is in use by another run (pid {holder.pid} on" in second.stderr
        with pytest.raises(DirectoryInUse, match=f"pid {holder.pid}"):
            RunLock([state]).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock = RunLock([out, state]).acquire()  # the killed holder left no stale lock
    assert f"pid {os.getpid()}" in (out / ".molt-run.lock").read_text()
    lock.release()
    shutil.rmtree(out)


def test_a_read_only_checkpoint_dir_is_named_before_ray_not_a_traceback_of_the_lock(tmp_path):
    """The run lock is the first write into ckpt.dir: on a read-only mount it raised a bare OSError (a traceback of
    `python -m runtime`, found by `just faults`); now exit 2 with the directory and why."""
    from test_ckpt_disk import small_tmpfs

    with small_tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        plan = compile_plan("recipes/demo_math.yaml", "name=test-run-lock-ro", f"ckpt.dir={ro}")
        plan_file = tmp_path / "plan.json"
        plan_file.write_text(plan.to_json())
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        run = subprocess.run([sys.executable, "-m", "runtime", str(plan_file)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    shutil.rmtree(ROOT / plan.rl.logging.out_dir, ignore_errors=True)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert f"cannot write the run directory {ro}: it is on a read-only file system" in run.stderr, run.stderr
