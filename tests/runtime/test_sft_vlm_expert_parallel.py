"""VLM SFT with expert parallelism on the automodel backend (`runtime/sft.py` building through
`runtime/models/automodel.py` `expert_parallel`): the tiny Qwen3.5-MoE VLM (nemo-automodel's own image-text-to-text
class) on 2 gloo ranks, fp32, on the VLM demo's data (a digit image and "<image>+1=", the vision tower frozen).

Plans compiled from the SFT demo by the real compiler: `actor.mesh.ep: 2` (each rank holds 2 of the 4 experts of
each language-model MoE layer, and its own rows) and `ep: 1` (FSDP2 over the same 2 ranks). Each rank runs the job's
own `setup` and two optimizer steps on the same windows: the losses agree to 1e-5 and the trained weights (under
transformers' names, experts gathered) to 1e-5; the experts moved and the tower did not.
"""

from __future__ import annotations

import os
import shutil
import signal

import torch
import torch.multiprocessing as mp
from loop_support import ROOT, compile_plan

STEPS = 2
NAME = "test-sft-vlm-ep"


def _plan(model: str, ep: int):
    return compile_plan(
        "recipes/demo_sft.yaml", f"model.path={model}", "model.backend=automodel", "model.attn=sdpa",
        "model.moe_dispatcher=torch", "cluster.gpus_per_node=2", "actor.gpus_per_node=2", f"actor.mesh.ep={ep}",
        f"data.dataset={ROOT}/recipes/data/demo_vlm/train.jsonl", "data.input_key=prompt", "data.output_key=answer",
        "data.image_key=image", "data.max_images_per_prompt=1", "data.max_samples=16", "train.batch_size=8",
        "train.micro_batch_size=2", "eval.dataset=null", "actor.freeze={visual_encoder: true}", f"name={NAME}-{ep}",
        "ignore={MOE001: two CPU ranks, MOE005: two CPU ranks}")


def _rank_main(rank: int, plans, ports, out: str) -> None:
    import torch.distributed as dist

    from runtime.sft import SftJob

    torch.set_num_threads(1)
    os.chdir(ROOT)  # plan paths are relative to the project root
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    runs = {}
    for plan, port in zip(plans, ports, strict=True):
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        job = SftJob(plan)
        job.setup()
        before = _full_weights(job)
        w = job.window
        losses = [job.train_step(job.data.examples[i * w:(i + 1) * w], 0)[0]["train/loss"] for i in range(STEPS)]
        runs[job.s.trainer.mesh.ep] = (losses, before, _full_weights(job))
        if rank == 0:
            job.sink.close()
        dist.destroy_process_group()
        for s, h in handlers.items():
            signal.signal(s, h)
    if rank == 0:
        torch.save(runs, out)


def _full_weights(job) -> dict[str, torch.Tensor]:
    """The whole model under transformers' names (expert shards gathered: a collective, every rank calls it)."""
    state = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
             for n, p in job.model.named_parameters()}
    return job.backend.hf_state_dict(state)


def test_vlm_sft_at_ep2_equals_ep1(tmp_path):
    from runtime.ranks import free_port
    from runtime.tiny_vlm import build_tiny_moe_vlm

    model = build_tiny_moe_vlm(tmp_path / "model", seed=0, vocab_size=300)
    out = str(tmp_path / "runs.pt")
    try:
        mp.spawn(_rank_main, args=([_plan(str(model), 2), _plan(str(model), 1)], [free_port(), free_port()], out),
                 nprocs=2, join=True)
    finally:
        for ep in (1, 2):
            shutil.rmtree(ROOT / "runs" / f"{NAME}-{ep}", ignore_errors=True)  # the metrics the jobs wrote
    runs = torch.load(out)
    (ep_losses, ep_start, ep_weights), (dp_losses, dp_start, dp_weights) = runs[2], runs[1]
    assert ep_weights.keys() == dp_weights.keys() == dp_start.keys()
    for name, w in dp_start.items():  # the same checkpoint, placed two ways
        torch.testing.assert_close(ep_start[name], w, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(torch.tensor(ep_losses), torch.tensor(dp_losses), rtol=0, atol=1e-5)
    for name, w in dp_weights.items():
        torch.testing.assert_close(ep_weights[name], w, rtol=0, atol=1e-5, msg=name)
    experts = [n for n in dp_weights if ".experts." in n]
    assert experts and max((dp_weights[n] - dp_start[n]).abs().max().item() for n in experts) > 1e-4  # trained
    tower = [n for n in dp_weights if ".visual." in n]
    assert tower and all(torch.equal(ep_weights[n], ep_start[n]) for n in tower)  # frozen
