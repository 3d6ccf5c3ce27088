"""The compiler's memory estimate against the trainer rank's real peak, on one GPU (issues 11 and 28; not in
`just test`).

    python3 tests/gpu/check_memory.py OUT_DIR [MODE ...]     MODE: full selective none (the checkpointing modes'
                                                             configurations), offload (CPU offload's) or resume
                                                             (only the offloaded checkpoint resume); a shape
                                                             name (qwen3-8b) keeps only that shape's runs

The caching allocator runs as the process environment sets it (`PYTORCH_CUDA_ALLOC_CONF`; the launch recipes set
`expandable_segments:True` through recipes/base/rl.yaml's `env`, demo_gpu.yaml does not); the report records it.

For each configuration (model shape, micro-batch rows x sequence length, activation checkpointing, `actor.offload`):
a random Qwen3 of that shape, this project's `PolicyWorker` (FSDP2 world 1, fp32 master weights, bf16 compute,
AdamW) trains two optimizer steps of two micro-batches each, and `torch.cuda.max_memory_reserved()` is the measured
GPU peak; the host memory the rank holds after the steps is its resident set minus the one after the worker was
built, before its first step (the optimizer states and the host step's buffers under `offload: optimizer`; what
model loading leaves resident is recorded apart). The estimate is the compiler's (`molt_compile/memory.py`, through the MEM rules' own entry point) for `recipes/demo_gpu.yaml` with the
same settings. Writes OUT_DIR/check_memory.json: per configuration the measured peaks (reserved, allocated), the
host memory, the step time, the estimate with its terms, and estimate / measured (GPU and host).

The offload configurations are issue 28's: a Qwen3-8B shape (8.2 B parameters: fp32 weights, gradients and AdamW
states are 131 GB, more than the GPU's 140 GiB minus activations) trains only with `offload: optimizer`; the 4B
shape runs with and without it, for the step time the offload costs; on the 0.6B shape a DCP checkpoint of the
offloaded rank must resume exactly (`_resume`).
Measured 2026-12-04 on one H200 (2 x 4096 tokens per micro-batch, full checkpointing; second step), under the
launch recipes' allocator setting (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`):
- Qwen3-8B shape, `offload: optimizer`: 5.28 s per step against 2.53 s without offload in the same run (2.08x);
  GPU peak 78.3 GiB reserved (estimate 76.1: 0.971), host 73.0 GiB (estimate 70.3: 0.963). Without offload the 8B
  still fits at this batch: 138.0 GiB of the GPU's 139.8 (estimate 143.2: 1.037; the compiler refuses it, MEM001).
- Qwen3-4B shape: 2.92 s with `offload: optimizer` against 1.84 s without (1.59x); GPU estimate 1.094 (1.097
  without offload), host 1.000.
- With the default allocator (no `PYTORCH_CUDA_ALLOC_CONF`, as demo_gpu.yaml runs) the 8B's reserved peak is 80.3
  GiB (estimate 0.947: 10 GiB reserved beyond allocated against the estimate's 6.2 GiB of slack); 4.99 s per step.
- 2026-12-03: the host step before it was fused and overlapped (single-tensor AdamW, synchronous copies) took 17.4 s
  for the 8B (6.5x its no-offload step), 8.3 s for the 4B; a checkpoint resume of the 0.6B shape: the resumed update
  equals the kept-going one to 0.4 % (relative norm).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

SHAPES = {  # Qwen3 dense shapes (vocabulary 151,936, tied embeddings as the small Qwen3s)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
OFFLOAD_CONFIGS = [  # (shape, rows, sequence length, gradient_checkpoint, actor.offload)
    ("qwen3-0.6b", 2, 2048, "full", "optimizer"),  # and a checkpoint resume (`_resume`)
    ("qwen3-4b", 2, 4096, "full", "none"),
    ("qwen3-4b", 2, 4096, "full", "optimizer"),
    ("qwen3-8b", 2, 4096, "full", "optimizer"),
    ("qwen3-8b", 2, 4096, "full", "none"),  # expected: out of memory (and the compiler's MEM001 refuses it)
]
CONFIGS = [  # (shape, rows per micro-batch, sequence length, gradient_checkpoint)
    ("qwen3-1.7b", 4, 4096, "full"),
    ("qwen3-1.7b", 2, 4096, "full"),
    ("qwen3-1.7b", 1, 8192, "full"),
    ("qwen3-1.7b", 2, 2048, "none"),
    ("qwen3-0.6b", 8, 2048, "full"),
    ("qwen3-0.6b", 2, 2048, "none"),
    ("qwen3-4b", 2, 4096, "full"),
    ("qwen3-1.7b", 4, 4096, "selective"),
    ("qwen3-1.7b", 2, 2048, "selective"),
    ("qwen3-0.6b", 8, 2048, "selective"),
    ("qwen3-4b", 2, 4096, "selective"),
]


def _batch(rows: int, seq: int, vocab: int):
    import torch

    from runtime.experience import from_token_lists

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(5, vocab - 1, (seq,), generator=g).tolist() for _ in range(rows)]
    batch = from_token_lists(tokens, [[(1, seq)] for _ in range(rows)], [[] for _ in tokens], pad_id=0)
    mask = batch.action_mask
    return replace(batch, old_log_probs=torch.zeros(mask.shape), advantages=mask.float(),
                   rollout_log_probs=torch.zeros(mask.shape))


def _estimate(model_dir: Path, rows: int, seq: int, ckpt: str, offload: str) -> dict:
    from molt_compile.compile import compile_recipe
    from molt_compile.memory import memory_report

    sets = [f"model.path={model_dir}", f"train.micro_batch_size={rows}", f"data.max_len={seq}",
            f"model.gradient_checkpoint={ckpt}", "rollout.max_new_tokens=16", f"actor.offload={offload}",
            "actor.packing=false", "model.attn=sdpa"]  # rows x sequence padded, the layout the script feeds
    res = compile_recipe(ROOT / "recipes/demo_gpu.yaml", sets, lower=False, capabilities=False)
    report = memory_report(res.recipe, res.derived, res.loaded.source)
    group = report.fsdp_groups[0]
    actor = group.roles[0]
    return {"total_gib": group.total / 2**30, "host_gib": actor.host / 2**30, "terms_gib": {
        "params": actor.params / 2**30, "grads": actor.grads / 2**30, "optimizer": actor.optimizer / 2**30,
        "activations": actor.activations / 2**30}, "breakdown": group.breakdown()}


def _resident_gib() -> float:
    """This process's resident host memory (VmRSS), pinned pages included."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


def _resume(worker, rl, batch) -> dict:
    """A DCP checkpoint of the offloaded rank resumes on the GPU: save, take a step, load into a fresh rank, take
    the same step; the two updates must agree (5 % relative, over all weights) and the restored states be on the
    host."""
    import torch

    from runtime.trainer import PolicyWorker, free_port

    path = tempfile.mkdtemp(prefix="molt_offload_ckpt_")
    worker.save_checkpoint(path)
    before = {n: p.detach().full_tensor().float().cpu() for n, p in worker.model.named_parameters()}
    worker.train(batch, 0.0)
    kept = {n: p.detach().full_tensor().float().cpu() for n, p in worker.model.named_parameters()}
    worker.shutdown()
    fresh = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, 0, "127.0.0.1",
                         free_port())
    fresh.load_checkpoint(path)
    fresh.train(batch, 0.0)
    resumed = {n: p.detach().full_tensor().float().cpu() for n, p in fresh.model.named_parameters()}
    worst = max((resumed[n] - kept[n]).abs().max().item() for n in kept)
    on_host = all(v._local_tensor.device.type == "cpu" for s in fresh.optimizer.state.values() for v in s.values()
                  if hasattr(v, "_local_tensor"))
    fresh.shutdown()
    torch.cuda.synchronize()
    moved = max((kept[n] - before[n]).abs().max().item() for n in kept)  # what the step itself changed
    # The two updates, resumed against kept going, over all weights: two runs of one bf16 step on the GPU differ in
    # their last bits (Adam normalizes tiny gradients, so those differences reach the update), while a lost
    # optimizer state changes Adam's update by its own order
    update = torch.cat([(kept[n] - before[n]).flatten() for n in kept])
    resumed_update = torch.cat([(resumed[n] - before[n]).flatten() for n in kept])
    relative = ((resumed_update - update).norm() / update.norm()).item()
    return {"max_abs_diff": worst, "step_moved": moved, "update_relative_diff": relative,
            "states_on_host": on_host, "passed": relative <= 0.05 and on_host}


def main() -> int:
    import torch
    from loop_support import trainer_rl
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from runtime.trainer import PolicyWorker, free_port

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(0), "runs": []}
    dirs: dict[str, Path] = {}
    shapes = {a for a in sys.argv[2:] if a in SHAPES}
    modes = set(sys.argv[2:]) - shapes or {c[3] for c in CONFIGS} | {"offload"}
    configs = [(*c, "none") for c in CONFIGS if c[3] in modes] + (OFFLOAD_CONFIGS if "offload" in modes else [])
    if "resume" in modes:
        configs += OFFLOAD_CONFIGS[:1]
    configs = [c for c in configs if not shapes or c[0] in shapes]
    report["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    for shape, rows, seq, ckpt, offload in configs:
        if shape not in dirs:
            d = Path(tempfile.gettempdir()) / f"molt_gpu_mem_{shape}"
            if not (d / "config.json").exists():
                torch.manual_seed(0)
                cfg = Qwen3Config(vocab_size=151936, max_position_embeddings=32768, **SHAPES[shape])
                with torch.device("cuda"):  # random init on the GPU: minutes faster for the 8B
                    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
                torch.cuda.empty_cache()
            dirs[shape] = d
        run: dict = {"shape": shape, "rows": rows, "seq": seq, "gradient_checkpoint": ckpt, "offload": offload}
        try:
            run["estimate"] = _estimate(dirs[shape], rows, seq, ckpt, offload)
        except Exception as exc:  # record, measure anyway
            run["estimate_error"] = repr(exc)
        rl = trainer_rl(1, ref=False, model={"path": str(dirs[shape]), "attn": "sdpa", "dtype": "bfloat16",
                                             "gradient_checkpoint": ckpt},
                        trainer={"micro_batch_size": rows, "grad_accum": 2, "max_epochs": 1, "temperature": 1.0,
                                 "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
                                 "offload": offload},
                        optimizer={"lr": 1e-6, "scheduler": "constant", "warmup_steps": 0, "total_steps": 100},
                        kl={"use_loss": False}, is_correction={"level": "off"}, device="cuda", dist_backend="nccl")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_reserved()
        host_base = _resident_gib()
        try:
            worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, 0,
                                  "127.0.0.1", free_port())
            run["host_after_build_gib"] = _resident_gib() - host_base
            batch = _batch(2 * rows, seq, 151936)
            worker.train(batch, 0.0)  # the first step: the states are created (on the host under offload)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            worker.train(batch, 0.0)
            torch.cuda.synchronize()
            run["step_s"] = time.perf_counter() - t0
            run["host_gib"] = _resident_gib() - host_base - run["host_after_build_gib"]
            run["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            run["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            run["reserved_before_gib"] = base / 2**30
            if offload != "none" and shape == "qwen3-0.6b":
                run["resume"] = _resume(worker, rl, batch)
            worker.shutdown()
            del worker
        except torch.OutOfMemoryError as exc:
            run["oom"] = str(exc)[:300]
        gc.collect()
        torch.cuda.empty_cache()
        if "estimate" in run and "peak_reserved_gib" in run:
            run["estimate_over_measured"] = run["estimate"]["total_gib"] / run["peak_reserved_gib"]
            if offload != "none":
                run["host_estimate_over_measured"] = run["estimate"]["host_gib"] / run["host_gib"]
        report["runs"].append(run)
        print(json.dumps(run), flush=True)
    text = json.dumps(report, indent=1)
    (out / "check_memory.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
