"""The generated sbatch script on a real Slurm with two simulated nodes: Ray comes up on both, the barrier passes,
the entrypoint runs on the head with the plan, its exit status is the job's, and nothing of the job is left."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from molt_compile.slurm import render_sbatch
from schemas.plan import Plan

from .conftest import ROOT, with_entrypoint

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _ray_processes_of(job_id: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"/tmp/molt-ray-{job_id}-" in line]


def test_sbatch_boots_two_node_ray_and_propagates_the_exit_status(slurm, cpu_plan: Plan, tmp_path: Path) -> None:
    # The entrypoint checks, from the head, that Ray sees both nodes with the plan's resources, then exits 3:
    # the job must report exactly that status.
    plan = with_entrypoint(cpu_plan, ["bash", "-c", 'python -m runtime.preflight "$0" --timeout 60 && exit 3',
                                      "{plan_file}"])
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(plan))
    sub = slurm.run("sbatch", "--parsable", "--wait", "-o", str(tmp_path / "job-%j.out"), str(script),
                    cwd=ROOT, timeout=900)
    job_id = sub.stdout.strip().split(";")[0]
    assert job_id.isdigit(), sub.stderr
    job_dir = ROOT / ".molt" / "slurm" / f"{plan.name}-{job_id}"
    try:
        output = (tmp_path / f"job-{job_id}.out").read_text()
        logs = "".join(f"\n--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(job_dir.glob("ray-*.log")))
        assert sub.returncode == 3, output + logs
        assert "molt: job exits with status 3" in output
        assert "on 2 node(s): n1 n2; head n1" in output
        # The barrier and the entrypoint both saw two nodes and the plan's resources (CPU 3 + 3, 2 + 2 slots).
        assert output.count("ready after") == 2, output
        assert "2/2 nodes, CPU 6/5, device_slot 4/3" in output
        # One Ray node per Slurm node: the head on n1, the worker on n2.
        assert "(head, node 0, n1)" in (job_dir / "ray-head.log").read_text()
        assert "(worker, node 1, n2)" in (job_dir / "ray-workers.log").read_text()
        # The plan written by the job is the plan, byte for byte.
        assert (job_dir / "plan.json").read_text() == plan.to_json()
        assert Plan.from_json((job_dir / "plan.json").read_text()).fingerprint == plan.fingerprint
        # Cleanup stopped both Ray nodes.
        assert _ray_processes_of(job_id) == []
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
        for tmp in Path("/tmp").glob(f"molt-ray-{job_id}-*"):
            shutil.rmtree(tmp, ignore_errors=True)


def test_sbatch_reads_hostile_option_values_as_data(slurm, cpu_plan: Plan, tmp_path: Path) -> None:
    """sbatch itself parses the quoted #SBATCH values: the account arrives verbatim and nothing runs."""
    marker = tmp_path / "injected"  # lowercase: Slurm stores account names lowercased
    account = f"""a'; touch {marker}; echo '$(touch {marker})`touch {marker}`"""
    recipe = dict(cpu_plan.recipe)
    recipe["launch"] = {**recipe["launch"], "slurm": {**recipe["launch"]["slurm"], "account": account}}
    plan = cpu_plan.model_copy(update={"recipe": recipe}).with_fingerprint()
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(plan))
    sub = slurm.run("sbatch", "--parsable", "--hold", str(script), cwd=ROOT)
    job_id = sub.stdout.strip().split(";")[0]
    assert job_id.isdigit(), sub.stderr
    try:
        shown = slurm.run("scontrol", "show", "job", job_id).stdout
        assert f"Account={account}" in shown.replace("\n   ", " ")
        assert not marker.exists()
    finally:
        slurm.run("scancel", job_id)


# The RL runtime on the two-node Slurm (train, time-limit signal, requeue, resume): test_slurm_requeue.py.
