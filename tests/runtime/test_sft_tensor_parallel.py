"""Tensor parallelism in SFT (`runtime/sft.py` building through the automodel backend: nemo-automodel's mesh, its
dense parallelizer and Qwen3 tensor-parallel plan), on 2 gloo ranks, fp32, the SFT demo's tiny dense Qwen3, packed
rows.

Plans compiled from the SFT demo by the real compiler: `actor.mesh.tp: 2` (one data-parallel rank: both ranks run
the whole window), the same with `actor.sequence_parallel` (the plan's sequence-parallel styles) and `tp: 1` (FSDP2
over the same 2 ranks, each running half of the same window), one after the other in the same 2 processes. Three
optimizer steps: the losses agree to 1e-5 and the trained weights (under transformers' names, gathered) to 1e-5, and
the weights moved (row `sft-trainer-tp-cuda`: CPU ranks only).
"""

from __future__ import annotations

import shutil

import torch
from loop_support import ROOT, compile_plan
from sft_mesh_support import assert_same_training, full_weights, join_ranks, run_two_ranks

STEPS = 3
NAME = "test-sft-tp"


def _plan(tp: int, sequence_parallel: bool = False):
    name = f"{NAME}-{tp}{'-sp' if sequence_parallel else ''}"
    return compile_plan(
        "recipes/demo_sft.yaml", "model.backend=automodel", "model.attn=sdpa", "cluster.gpus_per_node=2",
        "actor.gpus_per_node=2", f"actor.mesh.tp={tp}", f"actor.sequence_parallel={str(sequence_parallel).lower()}",
        "actor.packing=false", "data.max_samples=48", "train.batch_size=16", "eval.dataset=null", f"name={name}")


def _rank_main(rank: int, plans: list, port: int, out: str) -> None:
    """Each plan in turn in the same processes (a spawn costs more than a job), over one process group."""
    import torch.distributed as dist

    join_ranks(rank, port)
    init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: None if dist.is_initialized() else init(*a, **k)  # type: ignore
    runs = [_train(rank, plan) for plan in plans]
    if rank == 0:
        torch.save(runs, out)
    dist.destroy_process_group()


def _train(rank: int, plan) -> tuple:
    from runtime.sft import SftJob

    job = SftJob(plan)
    job.setup()
    before = full_weights(job)
    losses = []
    for w in range(STEPS):  # the same 16 rows a step: each data-parallel rank its part of them
        rows = job.data.examples[w * 16:(w + 1) * 16][job.dp_rank * job.window:(job.dp_rank + 1) * job.window]
        losses.append(job.train_step(rows, 0)[0]["train/loss"])
    after = full_weights(job)
    if rank == 0:
        job.sink.close()
    t = job.s.trainer
    # the plan's sequence-parallel styles make the norms tp modules (their weights replicated over tp)
    norm = dict(job.model.named_parameters())["model.layers.0.input_layernorm.weight"]
    return losses, before, after, (t.mesh.tp, t.sequence_parallel, "tp" in norm.device_mesh.mesh_dim_names)


def test_sft_at_tp2_equals_sft_at_tp1(tmp_path):
    plans = [_plan(2), _plan(2, sequence_parallel=True), _plan(1)]
    try:
        *mesh_runs, dp_run = run_two_ranks(_rank_main, plans, str(tmp_path / "runs.pt"))
    finally:
        for plan in plans:
            shutil.rmtree(ROOT / "runs" / plan.name, ignore_errors=True)  # the metrics the jobs wrote
    assert [run[-1] for run in (*mesh_runs, dp_run)] == [(2, False, False), (2, True, True), (1, False, False)]
    for *mesh_run, _ in mesh_runs:
        assert_same_training(tuple(mesh_run), tuple(dp_run[:-1]))
