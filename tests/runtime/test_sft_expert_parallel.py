"""Expert parallelism in SFT (`runtime/sft.py` building through the automodel backend: nemo-automodel's own device
mesh and MoE parallelizer, its `torch` token dispatcher), on 2 gloo ranks, fp32, the MoE demo's tiny Qwen3-MoE.

Plans compiled from the SFT demo by the real compiler: `actor.mesh.ep: 2` (each rank holds 2 of the 4 experts of
each layer, and its own rows) and `ep: 1` (FSDP2 over the same 2 ranks). Each rank runs the job's own `setup` and
three optimizer steps on the same windows: the losses agree to 1e-5 and the trained weights (under transformers'
names, experts gathered) to 1e-5, and the weights moved (row `sft-trainer-ep-cuda`: CPU ranks only).
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.multiprocessing as mp
from loop_support import ROOT, compile_plan

STEPS = 3
NAME = "test-sft-ep"


def _plan(ep: int):
    return compile_plan(
        "recipes/demo_sft.yaml", f"model.path={ROOT}/recipes/data/demo_moe/model", "model.backend=automodel",
        "model.attn=sdpa", "model.moe_dispatcher=torch", "cluster.gpus_per_node=2", "actor.gpus_per_node=2",
        f"actor.mesh.ep={ep}", "actor.packing=true", "data.max_samples=48", "train.batch_size=16",
        "eval.dataset=null", "actor.aux_loss_coef=0.01", f"name={NAME}-{ep}",
        *(["ignore={MOE001: the ep 1 baseline}"] if ep == 1 else []))


def _rank_main(rank: int, plan, port: int, out: str) -> None:
    import torch.distributed as dist

    from runtime.sft import SftJob

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.chdir(ROOT)  # plan paths are relative to the project root
    job = SftJob(plan)
    job.setup()
    before = _full_weights(job)
    losses = [job.train_step(job.data.examples[w * job.window:(w + 1) * job.window], 0)[0]["train/loss"]
              for w in range(STEPS)]
    after = _full_weights(job)
    if rank == 0:
        torch.save((losses, before, after, job.s.trainer.mesh.ep), out)
        job.sink.close()
    dist.destroy_process_group()


def _full_weights(job) -> dict[str, torch.Tensor]:
    """The whole model under transformers' names (expert shards gathered: a collective, every rank calls it)."""
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in job.model.named_parameters()}
    return job.backend.hf_state_dict(state)


def _run(ep: int, tmp_path) -> tuple:
    from runtime.ranks import free_port

    out = str(tmp_path / f"ep{ep}.pt")
    mp.spawn(_rank_main, args=(_plan(ep), free_port(), out), nprocs=2, join=True)
    return torch.load(out)


def test_sft_at_ep2_equals_sft_at_ep1(tmp_path):
    try:
        (ep_losses, ep_start, ep_weights, ep), (dp_losses, dp_start, dp_weights, _) = _run(2, tmp_path), _run(1, tmp_path)
    finally:
        for ep_size in (1, 2):
            shutil.rmtree(ROOT / "runs" / f"{NAME}-{ep_size}", ignore_errors=True)  # the metrics the jobs wrote
    assert ep == 2
    assert ep_weights.keys() == dp_weights.keys() == dp_start.keys()
    for name, w in dp_start.items():  # the same checkpoint, placed two ways
        torch.testing.assert_close(ep_start[name], w, rtol=0, atol=0, msg=name)
    assert dp_losses[-1] < dp_losses[0]  # it learns
    torch.testing.assert_close(torch.tensor(ep_losses), torch.tensor(dp_losses), rtol=0, atol=1e-5)
    experts = [n for n in dp_weights if ".experts." in n]
    assert experts and max((dp_weights[n] - dp_start[n]).abs().max().item() for n in experts) > 1e-4  # trained
    for name, w in dp_weights.items():
        torch.testing.assert_close(ep_weights[name], w, rtol=0, atol=1e-5, msg=name)
