"""GPU check: context parallelism (runtime/context_parallel.py) against no CP, through the runtime's own code.

    source tests/gpu/setup_device.sh .gpuwheels
    torchrun --nproc-per-node N tests/gpu/check_context_parallel.py OUT_DIR            (N GPUs, NCCL; cp = N)
    torchrun --nproc-per-node 2 tests/gpu/check_context_parallel.py OUT_DIR --share-gpu  (one GPU, gloo)
    torchrun --nproc-per-node 4 tests/gpu/check_context_parallel.py OUT_DIR --tp 2 [--sp]  (cp 2 x tp 2, NCCL)

For a tiny dense Qwen3 and a tiny Qwen3-MoE (nemo-automodel's own implementations, fp32, sdpa: torch's efficient
kernel), built by `runtime.models.automodel` on its mesh with a cp axis of every rank (FSDP2 over the dp x cp ranks):
the log-probs and entropy of padded rows of uneven lengths under nemo-automodel's sharder and torch's ring attention
(`sharded_rows`, `token_top_logprobs(cp=...)`) against the same model without CP, and the gradients of the global
token mean (the trainer's scaling: dp = world / cp, the all-gather's backward, FSDP2's average) against the no-CP
gradients. With `--share-gpu` (a one-GPU machine) the ranks share cuda:0 over gloo and the model is not FSDP-sharded
(NCCL refuses two ranks on one GPU): each rank's gradients are summed and divided by the ranks, as FSDP2 would.
With `--tp T` (tp x cp, cp = N / T): the dense model only (nemo-automodel has no MoE TP plan), built with its TP plan
on the (dp_shard_cp, tp) mesh (`--sp`: its sequence-parallel styles), each cp rank's cut shared by its tp ranks, the
ring attention over each tp rank's heads; held against the same TP model without CP. Not run yet (no multi-GPU
machine lent). Writes OUT_DIR/context_parallel_gpu.json (rank 0) and prints it.

Seen on one H200 (torch 2.11, 2026-12-04), `--share-gpu` only (no multi-GPU machine lent): it does not get through.
In fp32 the dense model's ring attention found no SDPA kernel (CP allows flash and efficient attention only, and
the efficient kernel takes no GQA), which is why the check computes in bf16 as the trainer does on GPUs; in bf16
both ranks died (SIGSEGV) in the first CP forward, presumably gloo's collectives on CUDA tensors. Run it on N GPUs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _check(kind: str, path: str, share: bool, world: int, device, tp: int = 1, sp: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from runtime import context_parallel, fsdp
    from runtime.logprobs import attach, token_top_logprobs
    from runtime.models import automodel
    from schemas.plan import ModelPlan

    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="bfloat16", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch" if kind == "moe" else None)
    mesh_plan = type("Mesh", (), {"tp": tp, "cp": world // tp, "ep": 1, "pp": 1, "dp_replicate": 1})()
    if share:
        # nemo-automodel's mesh is a CPU mesh over gloo: the ring attention needs one of the tensors' device type
        from torch.distributed.device_mesh import init_device_mesh

        cp_mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
        torch.manual_seed(0)
        model = automodel.load(plan, path, device).to(torch.bfloat16)  # FSDP2's compute dtype, by hand
        attach(model)
        if hasattr(model, "get_decoder"):  # `context_parallel.prepare` without FSDP2 units to configure
            from nemo_automodel.components.distributed.context_parallel.utils import attach_context_parallel_hooks

            attach_context_parallel_hooks(model)
    else:
        meshes = automodel.device_mesh("cuda", world, mesh_plan)
        cp_mesh = meshes.cp
        model = automodel.build(plan, path, meshes, device, sequence_parallel=sp)
    tp_world = meshes.fsdp if tp > 1 else None  # nemo-automodel's world mesh, for its TP-replica sync
    g = torch.Generator().manual_seed(1)
    lengths = [300, 173, 97, 256]
    width = max(lengths)
    seq = torch.randint(5, 290, (len(lengths), width), generator=g)
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    seq = (seq * mask).to(device)
    mask = mask.to(device)
    tokens = float(mask[:, 1:].sum())

    def grads() -> dict:
        fsdp.sync_tp_replicas(model, tp_world)  # as the trainer, before the optimizer reads them
        out = {}
        for n, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            if share:  # FSDP2's average over the ranks, by hand
                dist.all_reduce(grad)
                grad /= world
            out[n] = grad
            p.grad = None
        return out

    lp, ent, _ = token_top_logprobs(model, seq, mask, 1.0, None, with_entropy=True)
    (-(lp * mask[:, 1:]).sum() / tokens).backward()
    plain = grads()
    result: dict = {"model": type(model).__name__}
    try:
        with context_parallel.sharded_rows(cp_mesh, seq, mask) as rows:
            lp_cp, ent_cp, _ = token_top_logprobs(model, seq, mask, 1.0, None, with_entropy=True, cp=rows)
            result["local_tokens"] = rows.input_ids.shape[1]
            m = mask[:, 1:]
            result["logprob_max_abs_diff"] = float(((lp_cp - lp.detach()) * m).abs().max())
            result["entropy_max_abs_diff"] = float(((ent_cp - ent.detach()) * m).abs().max())
            result["forward"] = "ran"
            (-(lp_cp * m).sum() / tokens * (world // (cp_mesh.size() * tp))).backward()  # dp_size = world / (cp x tp)
        cp_grads = grads()
        result["grad_max_rel_diff"] = max(float((cp_grads[n] - plain[n]).norm() / plain[n].norm().clamp(min=1e-12))
                                          for n in plain)
    except Exception:  # noqa: BLE001 - the report names what failed
        result["error"] = traceback.format_exc()[-2000:]
    return result


def main(out_dir: str, share: bool, tp: int = 1, sp: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from runtime.tiny_model import build_tiny_model

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if share and tp > 1:
        raise SystemExit("--tp needs one GPU per rank (NCCL), not --share-gpu")
    local = 0 if share else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("gloo" if share else "nccl")
    report: dict = {"world": world, "share_gpu": share, "tp": tp, "sequence_parallel": sp, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(local)}
    for kind, extra in (("dense", {}), ("moe", {"experts": 4}))[:1 if tp > 1 else 2]:
        # one checkpoint for every rank (nemo-automodel's load is a collective over the ranks' DCP plans)
        path = str(Path(tempfile.gettempdir()) / f"molt_cp_check_{kind}")
        if rank == 0:
            build_tiny_model(path, seed=0, vocab_size=300, tie_word_embeddings=False, **extra)
        dist.barrier()
        report[kind] = _check(kind, path, share, world, device, tp, sp)
        if rank == 0:
            print(kind, json.dumps(report[kind], indent=2), flush=True)
    if rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "context_parallel_gpu.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    flags = sys.argv[2:]
    main(sys.argv[1], "--share-gpu" in flags, int(flags[flags.index("--tp") + 1]) if "--tp" in flags else 1,
         "--sp" in flags)
