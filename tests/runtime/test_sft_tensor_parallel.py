"""Tensor parallelism in SFT (`runtime/sft.py` building through the automodel backend: nemo-automodel's mesh, its
dense parallelizer and Qwen3 tensor-parallel plan), on 2 gloo ranks, fp32, the SFT demo's tiny dense Qwen3, packed
rows.

Plans compiled from the SFT demo by the real compiler: `actor.mesh.tp: 2` (one data-parallel rank: both ranks run
the whole window) and `tp: 1` (FSDP2 over the same 2 ranks, each running half of the same window). Three optimizer
steps: the losses agree to 1e-5 and the trained weights (under transformers' names, gathered) to 1e-5, and the
weights moved (row `sft-trainer-tp-cuda`: CPU ranks only).
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.multiprocessing as mp
from loop_support import ROOT, compile_plan

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

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.chdir(ROOT)  # plan paths are relative to the project root
    job = SftJob(plan)
    job.setup()
    before = _full_weights(job)
    losses = []
    for w in range(STEPS):  # the same 16 rows a step: each data-parallel rank its part of them
        rows = job.data.examples[w * 16:(w + 1) * 16][job.dp_rank * job.window:(job.dp_rank + 1) * job.window]
        losses.append(job.train_step(rows, 0)[0]["train/loss"])
    after = _full_weights(job)
    if rank == 0:
        torch.save((losses, before, after, job.s.trainer.mesh.tp), out)
        job.sink.close()
    dist.destroy_process_group()


def _full_weights(job) -> dict[str, torch.Tensor]:
    """The whole model under transformers' names (shards gathered: a collective, every rank calls it)."""
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in job.model.named_parameters()}
    return job.backend.hf_state_dict(state)


def _run(tp: int, tmp_path) -> tuple:
    from runtime.ranks import free_port

    out = str(tmp_path / f"tp{tp}.pt")
    mp.spawn(_rank_main, args=(_plan(tp), free_port(), out), nprocs=2, join=True)
    return torch.load(out)


def test_sft_at_tp2_equals_sft_at_tp1(tmp_path):
    try:
        (tp_losses, tp_start, tp_weights, tp), (dp_losses, dp_start, dp_weights, _) = _run(2, tmp_path), _run(1, tmp_path)
    finally:
        for tp_size in (1, 2):
            shutil.rmtree(ROOT / "runs" / f"{NAME}-{tp_size}", ignore_errors=True)  # the metrics the jobs wrote
    assert tp == 2
    assert tp_weights.keys() == dp_weights.keys() == dp_start.keys()
    for name, w in dp_start.items():  # the same checkpoint, placed two ways
        torch.testing.assert_close(tp_start[name], w, rtol=0, atol=0, msg=name)
    assert dp_losses[-1] < dp_losses[0]  # it learns
    torch.testing.assert_close(torch.tensor(tp_losses), torch.tensor(dp_losses), rtol=0, atol=1e-5)
    assert max((dp_weights[n] - dp_start[n]).abs().max().item() for n in dp_weights) > 1e-4  # trained
    for name, w in dp_weights.items():
        torch.testing.assert_close(tp_weights[name], w, rtol=0, atol=1e-5, msg=name)
