"""Expert parallelism in SFT (`runtime/sft.py` building through the automodel backend: nemo-automodel's own device
mesh and MoE parallelizer, its `torch` token dispatcher), on 2 gloo ranks, fp32, the MoE demo's tiny Qwen3-MoE.

Plans compiled from the SFT demo by the real compiler: `actor.mesh.ep: 2` (each rank holds 2 of the 4 experts of
each layer, and its own rows) with compiled decoder layers and full checkpointing (`model.compile_layers`: the
attention and norms compiled, each MoE block eager, the checkpoint around the layer: runtime/models/hf.py
`compile_layers`; the packed rows' layer graph-breaks only at its MoE block), and `ep: 1` eager (FSDP2 over the same 2
ranks). Each rank runs the job's own `setup` and three optimizer steps on the same windows: the losses agree to 1e-5
and the trained weights (under transformers' names, experts gathered) to 1e-5, and the weights moved (row
`sft-trainer-ep-cuda`: CPU ranks only). The eager build at ep 2 is RL's (tests/runtime/models/test_expert_parallel.py).
"""

from __future__ import annotations

import shutil

import torch
from loop_support import ROOT, compile_plan
from sft_mesh_support import assert_same_training, full_weights, join_ranks, run_ranks

STEPS = 3
NAME = "test-sft-ep"


def _plan(ep: int):
    return compile_plan(
        "recipes/demo_sft.yaml", f"model.path={ROOT}/recipes/data/demo_moe/model", "model.backend=automodel",
        "model.attn=sdpa", "model.moe_dispatcher=torch", "cluster.gpus_per_node=2", "actor.gpus_per_node=2",
        f"actor.mesh.ep={ep}", "actor.packing=true", "data.max_samples=48", "train.batch_size=16",
        "eval.dataset=null", "actor.aux_loss_coef=0.01", f"name={NAME}-{ep}",
        *(["ignore={MOE001: the ep 1 baseline}"] if ep == 1 else
          ["model.compile_layers=true", "model.gradient_checkpoint=full"]))


def _rank_main(rank: int, plan, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from runtime.sft import SftJob

    join_ranks(rank, port, plan.sft.trainer.world)
    job = SftJob(plan)
    job.setup()
    before = full_weights(job)
    losses = [job.train_step(job.data.examples[w * job.window:(w + 1) * job.window], 0)[0]["train/loss"]
              for w in range(STEPS)]
    after = full_weights(job)
    if rank == 0:
        torch.save((losses, before, after, (job.s.trainer.mesh.ep, sum(counters["graph_break"].values()))), out)
        job.sink.close()
    dist.destroy_process_group()


def test_sft_at_ep2_equals_sft_at_ep1(tmp_path):
    try:
        *mesh_run, ep = run_ranks(_rank_main, _plan(2), str(tmp_path / "ep2.pt"))
        *dp_run, _ = run_ranks(_rank_main, _plan(1), str(tmp_path / "ep1.pt"))
    finally:
        for size in (1, 2):
            shutil.rmtree(ROOT / "runs" / f"{NAME}-{size}", ignore_errors=True)  # the metrics the jobs wrote
    (ep, breaks) = ep
    assert ep == 2 and breaks > 0  # dynamo compiled the layers (breaking at their eager MoE blocks)
    assert_same_training(tuple(mesh_run), tuple(dp_run), trained=[n for n in dp_run[2] if ".experts." in n])
