"""SFT through the real sbatch script on the test Slurm (.ci/slurm_up.sh: two simulated nodes on this host).

`molt-compile recipes/demo_sft.yaml --set ... --slurm job.sbatch && sbatch job.sbatch`: the demo reshaped to two
nodes x one rank, so the script's one srun step starts torchrun on each node with its node rank and the head's
address; the two ranks rendezvous, train 32 optimizer steps with FSDP2 over gloo and export the model.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loop_support import ROOT, compile_plan, read_metrics

from molt_compile.slurm import render_sbatch

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
NAME = "test-sft-slurm"
CKPT = ROOT / "ckpt" / NAME


@pytest.fixture(scope="module")
def slurm_env():
    """The test Slurm, shared with other sessions through .ci/slurm_up.sh's holder list (this process holds it)."""
    holder = str(os.getpid())
    up = subprocess.run([str(ROOT / ".ci" / "slurm_up.sh"), "--holder", holder], capture_output=True, text=True,
                        timeout=600)
    assert up.returncode == 0, f"slurm_up.sh failed:\n{up.stdout}\n{up.stderr}"
    conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout)
    assert conf, up.stdout
    try:
        yield {**os.environ, "SLURM_CONF": conf.group(1), "HF_HUB_OFFLINE": "1",
               "PATH": f"{Path(sys.executable).parent}:/usr/sbin:{os.environ['PATH']}"}
    finally:
        subprocess.run([str(ROOT / ".ci" / "slurm_down.sh"), "--holder", holder], capture_output=True, timeout=120)


def test_sbatch_runs_two_node_sft(slurm_env, tmp_path: Path) -> None:
    plan = compile_plan("recipes/demo_sft.yaml", f"name={NAME}", "cluster.nodes=2", "cluster.gpus_per_node=1",
                        "actor.nodes=2", "actor.gpus_per_node=1", "train.max_epochs=1", "ckpt.every=-1",
                        f"ckpt.dir={CKPT / 'state'}", f"ckpt.hf_dir={CKPT / 'hf'}")
    assert (plan.sft.nnodes, plan.sft.nproc_per_node, plan.sft.trainer.grad_accum) == (2, 1, 2)
    out_dir = ROOT / plan.sft.logging.out_dir
    for d in (out_dir, CKPT):
        shutil.rmtree(d, ignore_errors=True)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(plan))
    sub = subprocess.run(["sbatch", "--parsable", "--wait", "-o", str(tmp_path / "job-%j.out"), str(script)],
                         env=slurm_env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    job_id = sub.stdout.strip().split(";")[0]
    assert job_id.isdigit(), sub.stderr
    try:
        output = (tmp_path / f"job-{job_id}.out").read_text()
        assert sub.returncode == 0, output[-6000:]
        assert "FSDP2 over 2 ranks" in output
        assert "sft finished at step 32" in output
        train = [r for r in read_metrics(out_dir / "metrics.jsonl") if "train/loss" in r]
        assert [r["step"] for r in train] == list(range(1, 33))
        assert train[-1]["train/loss"] < 0.5 * train[0]["train/loss"]
        assert (CKPT / "hf" / "model.safetensors").is_file()
    finally:
        shutil.rmtree(ROOT / ".molt" / "slurm" / f"{plan.name}-{job_id}", ignore_errors=True)
        for d in (out_dir, CKPT):
            shutil.rmtree(d, ignore_errors=True)
