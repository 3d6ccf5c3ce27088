"""Weight sync through CUDA IPC on one GPU (issue 12's H200 benchmark; not part of `just test`).

    python3 tests/gpu/bench_ipc_sync.py OUT_DIR [--baseline PATH/plain_baseline.py]

The sender is this project's trainer rank (`PolicyWorker`, FSDP2 world 1, fp32 master weights) holding a random
Qwen3-1.7B-shaped model; the receiver is a second process on the same GPU holding the engine's copy in bf16, as a
colocated hf engine does. Both join a `cuda_ipc` weight-sync group (`runtime/weight_sync_ipc.py:IpcChannel`) and run
the same `send_weights` / `receive` as the RL loop. Measured in the same run:
- `ipc`: seconds per streamed sync (warm, best of N and median), GB/s of bf16 weights;
- `floor`: casting the same fp32 parameters into one preallocated bf16 buffer in-process (what any sync must do);
- `old`: the previous path's first half, `get_model_state_dict(full_state_dict, cpu_offload)` (one run).
Check: after a sync that follows an optimizer-like perturbation, every receiver tensor equals the trainer's
parameter cast to bf16 (a per-tensor checksum compared exactly).
Writes OUT_DIR/bench_ipc_sync.json and prints it.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
BUCKET_BYTES = 256 << 20
SYNCS = 6


def _checksums(named) -> list[float]:
    import torch

    return [float(t.detach().to(torch.bfloat16).float().sum()) for _, t in named]


def _receiver(port: int, metas_raw, model_dir: str, results) -> None:
    """The engine side: a bf16 model on the GPU, loading each bucket out of the sender's slot."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from runtime import weight_sync

    try:
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
        params = dict(model.named_parameters())
        metas = [weight_sync.TensorMeta(n, d, tuple(s)) for n, d, s in metas_raw]
        group = weight_sync.join_group("cuda_ipc", "127.0.0.1", port, 1, 2, 120.0)

        @torch.no_grad()
        def load(pairs):
            for name, tensor in pairs:
                params[name].copy_(tensor)

        for _ in range(SYNCS + 1):
            stats = weight_sync.receive(group, metas, BUCKET_BYTES, torch.device("cuda"), load, {})
            results.put(("stats", stats.as_dict()))
        results.put(("checksums", _checksums(model.named_parameters())))
    except BaseException as exc:  # report, not hang the sender
        import traceback

        results.put(("error", "".join(traceback.format_exception(exc))))


def main() -> int:
    import torch
    import torch.multiprocessing as mp
    from loop_support import trainer_rl
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen3ForCausalLM

    from runtime.trainer import PolicyWorker, free_port

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[2:]
    baseline = Path(args[args.index("--baseline") + 1]) if "--baseline" in args else \
        ROOT.parent / "shared" / "bench" / "plain_baseline.py"
    spec = importlib.util.spec_from_file_location("plain_baseline", baseline)
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    cfg = plain.qwen3_1p7b_config()
    model_dir = Path(tempfile.gettempdir()) / "molt_gpu_bench_ipc_model"
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(model_dir)

    rl = trainer_rl(1, ref=False, model={"path": str(model_dir), "attn": "sdpa", "dtype": "bfloat16",
                                         "gradient_checkpoint": "full"},
                    device="cuda", dist_backend="nccl")
    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, 0, "127.0.0.1",
                          free_port())
    metas = worker.weight_sync_metas("bfloat16")
    wire_bytes = sum(torch.empty(s, dtype=torch.bfloat16, device="meta").numel() * 2 for _, _, s in metas)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_receiver, args=(port, [[n, d, list(s)] for n, d, s in metas], str(model_dir),
                                               results))
    proc.start()
    worker.open_weight_sync("cuda_ipc", "127.0.0.1", port, 2, 120.0)
    report: dict = {"device": torch.cuda.get_device_name(0), "params": sum(p.numel() for p in worker.model.parameters()),
                    "wire_gb": wire_bytes / 1e9, "bucket_bytes": BUCKET_BYTES}
    sends, walls = [], []
    for i in range(SYNCS + 1):
        if i == SYNCS:  # the checked sync: weights changed since the last one, as after an optimizer step
            with torch.no_grad():
                for p in worker.model.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        sends.append(worker.send_weights("bfloat16", BUCKET_BYTES))
        walls.append(time.perf_counter() - t0)
    received = []
    while len(received) < SYNCS + 1:
        kind, value = results.get(timeout=600)
        if kind == "error":
            raise RuntimeError(f"receiver failed:\n{value}")
        received.append(value)
    kind, theirs = results.get(timeout=600)
    if kind == "error":
        raise RuntimeError(f"receiver failed:\n{theirs}")
    proc.join(timeout=60)
    ours = _checksums([(m[0], p) for m, (_, p) in zip(metas, worker.model.named_parameters(), strict=True)])
    mismatched = [m[0] for m, a, b in zip(metas, ours, theirs, strict=True) if a != b]
    # a tied lm_head is listed once by both sides; the receiver's own named_parameters order is the same model's
    warm = walls[1:SYNCS]
    report["ipc"] = {"best_s": min(warm), "median_s": statistics.median(warm), "first_s": walls[0],
                     "gb_per_s": wire_bytes / 1e9 / min(warm), "sender": sends[-2], "receiver": received[-2]}

    params = [p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in worker.model.parameters()]
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.bfloat16, device="cuda")
    floor = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        at = 0
        for p in params:
            flat[at:at + p.numel()].copy_(p.reshape(-1))
            at += p.numel()
        torch.cuda.synchronize()
        floor.append(time.perf_counter() - t0)
    report["floor"] = {"best_s": min(floor[1:]), "what": "in-process fp32 -> bf16 cast of every parameter"}
    del flat
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    full = get_model_state_dict(worker.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    report["old"] = {"gather_s": time.perf_counter() - t0, "what": "full_state_dict + cpu_offload (fp32)",
                     "gb": sum(t.numel() * t.element_size() for t in full.values()) / 1e9}
    report["ratio_ipc_vs_old"] = report["old"]["gather_s"] / report["ipc"]["best_s"]
    report["ratio_ipc_vs_floor"] = report["ipc"]["best_s"] / report["floor"]["best_s"]
    report["check"] = {"tensors": len(metas), "mismatched": mismatched[:5], "n_mismatched": len(mismatched)}
    worker.shutdown()
    text = json.dumps(report, indent=1)
    print(text)
    (out / "bench_ipc_sync.json").write_text(text)
    return 0 if not mismatched else 1


if __name__ == "__main__":
    raise SystemExit(main())
