"""Tensor parallelism in SFT (`runtime/sft.py` building through the automodel backend: nemo-automodel's mesh, its
dense parallelizer and Qwen3 tensor-parallel plan), on 2 gloo ranks, fp32, the SFT demo's tiny dense Qwen3, packed
rows.

Plans compiled from the SFT demo by the real compiler: `actor.mesh.tp: 2` (one data-parallel rank: both ranks run
the whole window) and `tp: 1` (FSDP2 over the same 2 ranks, each running half of the same window). Three optimizer
steps: the losses agree to 1e-5 and the trained weights (under transformers' names, gathered) to 1e-5, and the
weights moved (row `sft-trainer-tp-cuda`: CPU ranks only).
"""

from __future__ import annotations

import shutil

import torch
from loop_support import ROOT, compile_plan
from sft_mesh_support import assert_same_training, full_weights, join_ranks, run_two_ranks

STEPS = 3
NAME = "test-sft-tp"


def _plan(tp: int):
    return compile_plan(
        "recipes/demo_sft.yaml", "model.backend=automodel", "model.attn=sdpa", "cluster.gpus_per_node=2",
        "actor.gpus_per_node=2", f"actor.mesh.tp={tp}", "actor.packing=false", "data.max_samples=48",
        "train.batch_size=16", "eval.dataset=null", f"name={NAME}-{tp}")


def _rank_main(rank: int, plan, port: int, out: str) -> None:
    import torch.distributed as dist

    from runtime.sft import SftJob

    join_ranks(rank, port)
    job = SftJob(plan)
    job.setup()
    before = full_weights(job)
    losses = []
    for w in range(STEPS):  # the same 16 rows a step: each data-parallel rank its part of them
        rows = job.data.examples[w * 16:(w + 1) * 16][job.dp_rank * job.window:(job.dp_rank + 1) * job.window]
        losses.append(job.train_step(rows, 0)[0]["train/loss"])
    after = full_weights(job)
    if rank == 0:
        torch.save((losses, before, after, job.s.trainer.mesh.tp), out)
        job.sink.close()
    dist.destroy_process_group()




def test_sft_at_tp2_equals_sft_at_tp1(tmp_path):
    try:
        *mesh_run, tp = run_two_ranks(_rank_main, _plan(2), str(tmp_path / "tp2.pt"))
        *dp_run, _ = run_two_ranks(_rank_main, _plan(1), str(tmp_path / "tp1.pt"))
    finally:
        for size in (1, 2):
            shutil.rmtree(ROOT / "runs" / f"{NAME}-{size}", ignore_errors=True)  # the metrics the jobs wrote
    assert tp == 2
    assert_same_training(tuple(mesh_run), tuple(dp_run))
