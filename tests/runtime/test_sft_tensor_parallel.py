"""Tensor parallelism in SFT (`runtime/sft.py` building through the automodel backend: nemo-automodel's mesh, its
dense parallelizer and Qwen3 tensor-parallel plan), on gloo ranks, fp32, the SFT demo's tiny dense Qwen3, unpacked
rows.

Plans compiled from the SFT demo by the real compiler: `actor.mesh.tp: 2` on 2 ranks (one data-parallel rank: both
ranks run the whole window), the same with `actor.sequence_parallel` (the plan's sequence-parallel styles), HSDP with tp 2 on 8 ranks (nemo-automodel's (dp_replicate 2, dp_shard 2, tp 2) mesh:
4 data-parallel ranks, each pair of tp ranks a quarter of the window), and `tp: 1` (FSDP2 over 2 ranks, each half of
the window), the run the others are held against; tp 2 with CPU offload at both levels (`actor.offload`:
`optimizer` steps on host copies of the tp shards, `full` is FSDP2's CPUOffloadPolicy under the parallelizer).
Three optimizer steps of the same 16 rows each: the losses and
gradient norms agree to 1e-5 and the trained weights (under transformers' names, gathered) to 1e-5, and the weights
moved (row `sft-trainer-tp-cuda`: CPU ranks only). The HSDP run also saves a DCP checkpoint before its last step
and resumes from it (the step run again gives the same loss and weights) and exports the HF checkpoint, which holds
the trained weights.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from loop_support import ROOT, compile_plan
from sft_mesh_support import assert_same_training, full_weights, join_ranks, run_ranks

STEPS = 3
ROWS = 16
"""Rows of one optimizer step (`train.batch_size`)."""
NAME = "test-sft-tp"


def _plan(tp: int, dp_replicate: int = 1, out_dir=None, sequence_parallel: bool = False, offload: str = "none"):
    world = 8 if dp_replicate > 1 else 2
    name = f"{NAME}-{tp}-{dp_replicate}{'-sp' if sequence_parallel else ''}-{offload}"
    return compile_plan(
        "recipes/demo_sft.yaml", "model.backend=automodel", "model.attn=sdpa", f"cluster.gpus_per_node={world}",
        f"actor.gpus_per_node={world}", f"actor.mesh.tp={tp}", f"actor.mesh.dp_replicate={dp_replicate}",
        f"actor.sequence_parallel={str(sequence_parallel).lower()}", f"actor.offload={offload}",
        "actor.packing=false", "data.max_samples=48", f"train.batch_size={ROWS}",
        f"train.micro_batch_size={8 if world == 2 else 4}", "eval.dataset=null", f"name={name}",
        *([f"ckpt.dir={out_dir}/state", f"ckpt.hf_dir={out_dir}/hf"] if out_dir else []))


def _rank_main(rank: int, plan, port: int, out: str) -> None:
    import torch.distributed as dist

    from runtime import ckpt
    from runtime.sft import SftJob

    join_ranks(rank, port, plan.sft.trainer.world)
    job = SftJob(plan)
    job.setup()
    hsdp = job.s.trainer.mesh.dp_replicate > 1

    def step(w: int) -> dict:  # the same 16 rows a step: each data-parallel rank its part of them
        rows = job.data.examples[w * ROWS:(w + 1) * ROWS][job.dp_rank * job.window:(job.dp_rank + 1) * job.window]
        return job.train_step(rows, 0)[0]

    before = full_weights(job)
    records, saved = [], None
    for w in range(STEPS):
        if hsdp and w == STEPS - 1:
            saved = job.save(job.step, 0)
        records.append(step(w))
    after = full_weights(job)
    # the plan's sequence-parallel styles make the norms tp modules (their weights replicated over tp)
    norm = dict(job.model.named_parameters())["model.layers.0.input_layernorm.weight"]
    checks = {"norm_on_tp": "tp" in norm.device_mesh.mesh_dim_names}
    if job.s.trainer.offload != "none":  # what the level changed in the built rank
        from test_offload import offload_checks

        checks["offload"] = offload_checks(job, job.s.trainer.offload)
    if hsdp:
        q = dict(job.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
        checks["placement"] = f"{q.device_mesh} {q.placements}".lower()
        ckpt.load_sharded(saved, job.model, job.optimizer, job.scheduler)  # back to before the last step
        checks["resumed_loss"] = step(STEPS - 1)["train/loss"]
        checks["resumed"] = full_weights(job)
        job.export()
        checks["hf_dir"] = job.hf_dir
    if rank == 0:
        torch.save(([r["train/loss"] for r in records], before, after, [r["train/grad_norm"] for r in records],
                    checks), out)
        job.sink.close()
    dist.destroy_process_group()


def _run(plan, out: str) -> tuple:
    try:
        return run_ranks(_rank_main, plan, out)
    finally:
        shutil.rmtree(ROOT / "runs" / plan.name, ignore_errors=True)  # the metrics the job wrote


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory) -> tuple:
    """FSDP2 over 2 ranks, every run here is held against."""
    return _run(_plan(1), str(tmp_path_factory.mktemp("tp1") / "run.pt"))


def _assert_same(mesh_run: tuple, dp_run: tuple) -> None:
    assert_same_training(mesh_run[:3], dp_run[:3])
    torch.testing.assert_close(torch.tensor(mesh_run[3]), torch.tensor(dp_run[3]), rtol=0, atol=1e-5)  # norms


def test_sft_at_tp2_equals_sft_at_tp1(tp1_run, tmp_path):
    tp_run = _run(_plan(2), str(tmp_path / "tp2.pt"))
    assert not tp_run[4]["norm_on_tp"]
    _assert_same(tp_run, tp1_run)


def test_sft_at_tp2_with_sequence_parallelism_equals_sft_at_tp1(tp1_run, tmp_path):
    plan = _plan(2, sequence_parallel=True)
    assert plan.sft.trainer.sequence_parallel
    sp_run = _run(plan, str(tmp_path / "tp2-sp.pt"))
    assert sp_run[4]["norm_on_tp"]
    _assert_same(sp_run, tp1_run)


@pytest.mark.parametrize("level", ["optimizer", "full"])
def test_sft_at_tp2_with_offload_equals_sft_at_tp1(tp1_run, tmp_path, level):
    plan = _plan(2, offload=level)
    assert plan.sft.trainer.offload == level and plan.sft.trainer.mesh.tp == 2
    run = _run(plan, str(tmp_path / f"tp2-{level}.pt"))
    checks = run[4]["offload"]
    assert set(checks["offload_to_cpu"]) == {level == "full"}  # FSDP2's CPUOffloadPolicy on every parameter
    assert checks["host_steps"] == (level == "optimizer")  # HostAdamW: the states and the step on the host
    if level == "optimizer":
        assert checks["stepped"] and checks["states_on_host"] and checks["restored"] and checks["fused"], checks
    _assert_same(run, tp1_run)


def test_sft_hsdp_at_tp2_equals_sft_at_tp1(tp1_run, tmp_path):
    from safetensors.torch import load_file

    hsdp_run = _run(_plan(2, dp_replicate=2, out_dir=tmp_path), str(tmp_path / "hsdp.pt"))
    losses, _, after, _, checks = hsdp_run
    # FSDP2 shards each tp shard over the dp_shard pair and replicates it over the dp_replicate pair
    assert "(dp_replicate=2, " in checks["placement"] and "dp_shard=2, tp=2)" in checks["placement"], checks["placement"]
    assert "(replicate(), _stridedshard(dim=0, sf=2), shard(dim=0))" in checks["placement"], checks["placement"]
    _assert_same(hsdp_run, tp1_run)
    # the DCP checkpoint before the last step, resumed: that step again (its optimizer state and schedule too)
    assert checks["resumed_loss"] == pytest.approx(losses[-1], abs=1e-6)
    for name, w in after.items():
        torch.testing.assert_close(checks["resumed"][name], w, rtol=0, atol=1e-6, msg=name)
    # the HF export holds the trained weights under the checkpoint's names
    exported = load_file(f"{checks['hf_dir']}/model.safetensors")
    assert exported.keys() == after.keys()
    for name, w in tp1_run[2].items():
        torch.testing.assert_close(exported[name], w, rtol=0, atol=1e-5, msg=name)
