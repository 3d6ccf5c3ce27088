"""The RL runtime under the rendered sbatch script on the real two-node test Slurm, with `launch.slurm.requeue`:
the tiny RL recipe (hf engine) trains on the cluster the script boots; the time-limit signal (sent here with
`scancel --signal=USR1 --batch`, exactly what `#SBATCH --signal=B:USR1@N` makes Slurm send) reaches the run, which
checkpoints after its current step and exits 75; the job requeues itself, the requeued job resumes from that
checkpoint and ends with status 0, and nothing of the job's Ray is left. The agent (data/held_math.py) holds its steps
while the test's hold file exists, so the signal lands before the last step, while the generator holds the engine lock
on a batch that never finishes: the stop must not wait for that lock (it would outlast the stop bound and lose the
checkpoint)."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from molt_compile.slurm import render_sbatch

from .conftest import DATA, ROOT, compile_plan
from .test_slurm_e2e import _ray_processes_of

HOLD = Path("/tmp/molt-requeue-test.hold")  # data/held_math.py's

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm, tmp_path: Path) -> None:
    plan = compile_plan(DATA / "cpu_two_nodes.yaml", (
        "name=launch-requeue", "rollout.engine=hf", "data.max_samples=96", f"agent.path={DATA / 'held_math.py'}",
        "eval.dataset=null", "ckpt.every=-1", "ckpt.final_save=false", "ckpt.resume=true", "ckpt.dir=ckpt/launch-requeue/state",
        "logging.tensorboard_dir=null", "launch.slurm.requeue=true"))
    assert plan.rl.schedule.total_steps == 12
    out_dir, ckpt_dir = ROOT / plan.rl.logging.out_dir, ROOT / plan.rl.ckpt.dir
    for d in (out_dir, ckpt_dir):
        shutil.rmtree(d, ignore_errors=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(plan))
    log = tmp_path / "job.out"
    sub = slurm.run("sbatch", "--parsable", "--open-mode=append", "-o", str(log), str(script), cwd=ROOT)
    job_id = sub.stdout.strip().split(";")[0]
    assert job_id.isdigit(), sub.stderr
    job_dir = ROOT / ".molt" / "slurm" / f"{plan.name}-{job_id}"
    metrics = out_dir / "metrics.jsonl"
    HOLD.unlink(missing_ok=True)
    try:
        deadline = time.time() + 900
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.2)
        HOLD.touch()  # from here no batch finishes: the queue's (2) are trained, then the trainer waits
        assert slurm.run("scancel", "--signal=USR1", "--batch", job_id).returncode == 0
        state = ""
        while time.time() < deadline:
            if HOLD.exists() and log.is_file() and "for the requeue" in log.read_text():
                HOLD.unlink()
            shown = slurm.run("scontrol", "show", "job", job_id).stdout
            state = re.search(r"JobState=(\w+)", shown).group(1)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and "Restarts=1" in shown:
                break
            time.sleep(2)
        output = log.read_text()
        assert state == "COMPLETED", output
        saved = int(re.search(r"checkpointed step (\d+) for the requeue", output).group(1))
        assert 2 <= saved < 12
        assert f"requeueing job {job_id}" in output
        assert re.search(rf"resumed from \S+step_0*{saved} at step {saved}", output), output
        assert output.count("2/2 nodes, CPU 6/5, device_slot 4/3") == 2  # both runs' barriers saw both nodes
        # The checkpoint counts the prompts dispatched by then (in flight included), so the resumed run may run out
        # of prompts before step 12; every step is trained exactly once across the two runs.
        last = int(re.search(r"finished at step (\d+)", output).group(1))
        assert saved < last <= 12 and output.rstrip().endswith("molt: job exits with status 0")
        steps = [int(m) for m in re.findall(r'"step": (\d+)', metrics.read_text())]
        assert steps == list(range(1, last + 1)), steps
        assert _ray_processes_of(job_id) == []
    finally:
        HOLD.unlink(missing_ok=True)
        slurm.run("scancel", job_id)
        for d in (job_dir, out_dir, ckpt_dir):
            shutil.rmtree(d, ignore_errors=True)
        for tmp in Path("/tmp").glob(f"molt-ray-{job_id}-*"):
            shutil.rmtree(tmp, ignore_errors=True)
