"""GPU check of the RL trainer ranks (run on a 2-GPU machine; not part of `just test`, which runs on CPUs).

    python3 tests/gpu/check_trainer.py OUT_DIR

Two `PolicyWorker` ranks, one per GPU as Ray would pin them (CUDA_VISIBLE_DEVICES), FSDP2 over NCCL with bf16
compute and fp32 master weights, started here without Ray:
1. correctness: the ranks' log-probs of a batch match a single-process fp32 CPU reference (bf16 tolerance), and a
   few policy steps with positive advantages raise the log-probs of the action tokens;
2. speed: forward and train step time of a ~0.1 B-parameter Qwen3 (random init) on 2 x 256 rows of 512 tokens.
Writes OUT_DIR/trainer_gpu.json and prints it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = os.environ.get("MOLT_GPU_CHECK_DRY_RUN") == "1"
"""Run the same code on CPUs (gloo, fp32, small sizes): checks the script itself before spending device time."""
sys.path.insert(0, str(ROOT))
SMALL = ROOT / "recipes" / "data" / "demo_math" / "model"


def spec(model_path: str, micro: int, accum: int, lr: float):
    """The plan sections the ranks take (the demo's compiled `rl` section with this check's settings)."""
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from loop_support import trainer_rl

    return trainer_rl(
        2, ref=False, model={"path": model_path, "dtype": "float32" if DRY_RUN else "bfloat16"},
        trainer={"micro_batch_size": micro, "grad_accum": accum, "max_epochs": 1, "temperature": 1.0, "seed": 0,
                 "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None},
        optimizer={"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "max_norm": 1.0,
                   "scheduler": "constant", "warmup_steps": 0, "total_steps": 100},
        loss={"mode": "ppo", "clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "entropy_coef": 0.0},
        kl={"estimator": "k1", "use_loss": False}, is_correction={"level": "off", "mode": "mask"},
        device="cpu" if DRY_RUN else "cuda", dist_backend="gloo" if DRY_RUN else "nccl")


def worker_of(rl, rank: int, port: int):
    from runtime.trainer import PolicyWorker

    return PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, rank, "127.0.0.1", port)


def batch(rows: int, length: int, vocab: int, seed: int):
    import torch

    from runtime.experience import from_token_lists

    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(5, vocab, (length - (i % 7),), generator=g).tolist() for i in range(rows)]
    ranges = [[(length // 4, len(t))] for t in tokens]
    return from_token_lists(tokens, ranges, [[] for _ in tokens], pad_id=0)


def for_training(exp, old):
    import torch

    mask = exp.action_mask
    return replace(exp, old_log_probs=old, ref_log_probs=None, advantages=mask.float(),
                   rollout_log_probs=old.clone(), returns=torch.zeros_like(old))


def rank_main(rank: int, port: int, out: Path, big_model: str) -> None:
    import torch

    from runtime.trainer import token_logprobs

    report: dict = {"rank": rank, "device": "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name(0)}
    sync = (lambda: None) if DRY_RUN else torch.cuda.synchronize
    # 1. correctness on the demo's tiny model
    worker = worker_of(spec(str(SMALL), micro=4, accum=2, lr=1e-3), rank, port)
    exp = batch(16, 24, 250, seed=0)
    _, old, _ = worker.forward_logprobs(exp)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        cpu = AutoModelForCausalLM.from_pretrained(SMALL, dtype=torch.float32, attn_implementation="sdpa")
        shard = exp.shard(0, 2)
        ref, _ = token_logprobs(cpu, shard.sequences, shard.attention_mask, 1.0)
        m = shard.action_mask
        report["bf16_vs_fp32_logprob_max_abs_diff"] = float(((old - ref.detach()).abs() * m).max())
        report["bf16_vs_fp32_logprob_mean_abs_diff"] = float(((old - ref.detach()).abs() * m).sum() / m.sum())
    full_old = torch.zeros(exp.sequences.shape[0], exp.sequences.shape[1] - 1)
    full_old[rank * 8:(rank + 1) * 8] = old  # each rank only needs its own shard's rows
    before = float((old * exp.shard(rank, 2).action_mask).sum() / exp.shard(rank, 2).action_mask.sum())
    for _ in range(5):
        stats = worker.train(for_training(exp, full_old), 0.0)
    _, after_old, _ = worker.forward_logprobs(exp)
    m = exp.shard(rank, 2).action_mask
    report["action_logprob_mean_before"] = before
    report["action_logprob_mean_after_5_steps"] = float((after_old * m).sum() / m.sum())
    report["train_stats_last"] = stats
    worker.shutdown()

    # 2. speed on a ~0.1 B model
    worker = worker_of(spec(big_model, micro=2 if DRY_RUN else 16, accum=2 if DRY_RUN else 8, lr=1e-5), rank,
                       port + 1)
    report["big_model_params"] = int(worker.ready())  # numel of the (sharded) DTensors is the global count
    exp = batch(8, 64, 250, seed=1) if DRY_RUN else batch(256, 512, 250, seed=1)
    rows = exp.sequences.shape[0]
    times_fwd, times_train = [], []
    for i in range(4):
        sync()
        t0 = time.perf_counter()
        _, old, _ = worker.forward_logprobs(exp)
        sync()
        t1 = time.perf_counter()
        full_old = torch.zeros(rows, exp.sequences.shape[1] - 1)
        full_old[rank * rows // 2:(rank + 1) * rows // 2] = old
        worker.train(for_training(exp, full_old), 0.0)
        sync()
        t2 = time.perf_counter()
        if i > 0:  # the first iteration warms up kernels and the allocator
            times_fwd.append(t1 - t0)
            times_train.append(t2 - t1)
    tokens = int(exp.attention_mask.sum())
    report["speed_rows_tokens"] = [rows, tokens]
    report["forward_s_median"] = sorted(times_fwd)[len(times_fwd) // 2]
    report["train_step_s_median"] = sorted(times_train)[len(times_train) // 2]
    report["train_tokens_per_s"] = tokens / report["train_step_s_median"]
    report["max_memory_gib"] = 0.0 if DRY_RUN else torch.cuda.max_memory_allocated() / 2**30
    worker.shutdown()
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2:  # a rank
        rank_main(int(sys.argv[2]), int(sys.argv[3]), out, sys.argv[4])
        return 0
    from runtime.tiny_model import build_tiny_model
    from runtime.trainer import free_port

    big = build_tiny_model(Path(tempfile.gettempdir()) / "molt_gpu_check_model", seed=0, vocab_size=260, hidden_size=1024, intermediate_size=4096,
                           num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=64)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, str(out), str(rank), str(port), str(big)],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)}) for rank in range(2)]
    codes = [p.wait() for p in procs]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2) if (out / f"rank{r}.json").exists()]
    print(json.dumps({"exit_codes": codes, "ranks": reports}, indent=1))
    (out / "trainer_gpu.json").write_text(json.dumps({"exit_codes": codes, "ranks": reports}, indent=1))
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
