"""The trainer rank against the plain baseline, in one process on one GPU (issue 11's benchmark; not in `just test`).

    python3 tests/gpu/bench_trainer.py OUT_DIR [--baseline PATH/plain_baseline.py]
    MOLT_GPU_CHECK_DRY_RUN=1 python3 tests/gpu/bench_trainer.py OUT_DIR     (CPU, tiny: checks the script)

Same random Qwen3-1.7B-shaped model (bf16 compute) and the same 4 x 4096 tokens:
1. plain PyTorch + transformers (`shared/bench/plain_baseline.py`: full activation checkpointing, fused AdamW,
   cross-entropy over every token);
2. this project's `PolicyWorker` (FSDP2 world 1, fp32 master weights, the PPO loss over every token as actions,
   chunked lm_head log-probs): its optimizer step (`train`) over micro-batches of 4 rows, padded and packed, under
   each `model.gradient_checkpoint` and with/without `model.compile_layers` (with checkpointing, the checkpoint runs
   inside the compiled layer: runtime/models/hf.py).
Then a batch with skewed lengths (4 rows in 16 long, the rest short, the same 16 x 4096 padded shape): the baseline
computes the padding, the packed trainer does not. Tokens/s count real tokens; MFU uses 790 TFLOP/s (bf16 dense).
`--profile NAME` also writes the 40 costliest ops of one step of run NAME (profile_trainer.txt).
Variants whose attention is not what the compiler allows on GPUs for packing (sdpa, flex: Molt's rule H2 wants
flash_attention_2, te or tilelang) are measured as what the kernels would give, not as runnable recipes.

Measured 2026-12-01 on one H200 (tokens/s against the plain baseline measured in the same run, 23.4k tokens/s,
MFU 0.348): full checkpointing 0.83x (MFU 0.29), full + compiled layers 1.15x, no checkpointing 0.99x, no
checkpointing + compiled layers 1.36x (MFU 0.47, peak 71 GiB), selective 0.88x; skewed batch packed: full 1.51x,
full + compiled 2.02x, none + compiled 2.49x, none + compiled with flex attention 2.89x.
Measured 2026-12-02 on one H200 (same runs' plain baseline 23.7k tokens/s, MFU 0.353): full 0.84x, selective 0.89x;
skewed batch packed: sdpa full 1.68x, flash_attention_2 through torch's varlen kernel (no flash-attn package) full
1.90x, selective 1.33x, none + compiled 2.66x; flex none + compiled 3.34x. `-keep` (no resharding between forward and
backward): full 0.85x, selective 0.92x, varlen full 1.91x: resharding costs ~2 %, not the gap.
Measured 2026-12-03 on one H200 (plain 0.691 s/step, MFU 0.352, same run; every compile cold): full eager 0.93x;
full + compiled layers (the default on GPUs since issue 29) 1.37x (MFU 0.48), first step 10.0 s, a new batch shape
0.39 s; `-automatic` (the layers' shape not marked dynamic) 1.39x but a 9.4 s recompile at the new shape; selective
+ compiled 1.54x (MFU 0.54, peak 50 GiB); none + compiled 1.57x (MFU 0.55, 61 GiB); skewed batch packed
flash_attention_2 (torch varlen): full 1.63x, full + compiled 1.79x, none + compiled 3.04x; flex none + compiled
3.74x (its first step compiles for 73 s).
The `-automodel` runs (added 2026-12-05) train the same dense shape through the automodel backend (nemo-automodel's
model class, runtime/models/automodel.py): each reports its speed against the hf backend's run of the same name
without the suffix, and its first step's loss, log-ratio sum and gradient norm against that run's (the same weights
and rows: only kernels and rounding differ). The CPU dry run gives the hf numbers exactly (fp32).
Measured 2026-12-05, later, on one H100, then one H200 (`uniform/padded uniform/padded-automodel
uniform/padded-compiled uniform/padded-compiled-automodel`): on the H100 the automodel runs failed their first step
(full checkpointing through transformers' switch: torch 2.11's FSDP2 does not re-cast the layer inputs in the
recompute, nemo-automodel's rotary coefficients are fp32, CheckpointError), fixed in `hf.checkpoint_layers`. Then on
the H200 (plain 0.702 s/step in the same run): hf full 0.82x plain, full + compiled 1.37x (first step 13.8 s);
automodel full 0.88x = **1.08x the hf backend** (0.794 s against 0.858 s), full + compiled 1.35x = **0.98x the hf
backend** (0.519 s against 0.511 s; first step 9.5 s); first-step loss and gradient norm against the hf backend's
within 3.8e-4 and 2.7e-3 relative (bf16 kernels), token count equal; peak reserved 32-33 GiB for all four.
Writes OUT_DIR/trainer_gpu.json and prints it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = os.environ.get("MOLT_GPU_CHECK_DRY_RUN") == "1"
PEAK_FLOPS = 790e12
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))


def _baseline(path: Path):
    spec = importlib.util.spec_from_file_location("plain_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(lengths: list[int], vocab: int, width: int):
    import torch

    from runtime.experience import from_token_lists

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(5, vocab - 1, (n,), generator=g).tolist() for n in lengths]
    batch = from_token_lists(tokens, [[(1, n)] for n in lengths], [[] for _ in tokens], pad_id=0)
    if batch.sequences.shape[1] < width:  # the baseline's padded width, so both see the same shape
        pad = width - batch.sequences.shape[1]
        batch = replace(batch, **{f: torch.nn.functional.pad(getattr(batch, f), (0, pad))
                                  for f in ("sequences", "attention_mask", "action_mask", "rollout_log_probs")})
    return batch


def _trainer_run(rl, batch, steps, sync, cfg, n_params, seq, plain, port, profile, out, new_shape=None) -> dict:
    """Best of `steps` optimizer steps (after one warm-up, which also compiles) of a fresh `PolicyWorker` on
    `batch`; with `new_shape` (a batch of another length), also the first step on it (a recompile, if any) and the
    next one."""
    from runtime.trainer import PolicyWorker

    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, 0, "127.0.0.1", port)
    try:  # a failing run still leaves its process group: the next run initialises its own
        return _timed_steps(worker, batch, steps, sync, cfg, n_params, seq, plain, profile, out, new_shape)
    finally:
        worker.shutdown()


def _timed_steps(worker, batch, steps, sync, cfg, n_params, seq, plain, profile, out, new_shape) -> dict:
    import torch

    mask = batch.action_mask
    step_batch = replace(batch, old_log_probs=torch.zeros(mask.shape), advantages=mask.float(),
                         rollout_log_probs=torch.zeros(mask.shape))
    if not DRY_RUN:
        torch.cuda.reset_peak_memory_stats()
    times, times_all = [], []
    for i in range(steps + 1):
        sync()
        t0 = time.perf_counter()
        sums = worker.train(step_batch, 0.0)
        sync()
        times_all.append(time.perf_counter() - t0)
        if i == 0:  # the same weights and rows in every run: the first step's numbers compare backends and kernels
            first_metrics = {k: v for k, v in sums.items() if k in ("grad_norm", "tokens", "policy_loss_x_tokens", "policy_kl_x_tokens")}
        if i > 0 or DRY_RUN:
            times.append(times_all[-1])
    first_s = times_all[0]
    shape_change = {}
    if new_shape is not None:
        other = replace(new_shape, old_log_probs=torch.zeros(new_shape.action_mask.shape),
                        advantages=new_shape.action_mask.float(),
                        rollout_log_probs=torch.zeros(new_shape.action_mask.shape))
        for key in ("new_shape_first_step_s", "new_shape_next_step_s"):
            sync()
            t0 = time.perf_counter()
            worker.train(other, 0.0)
            sync()
            shape_change[key] = time.perf_counter() - t0
    if profile:
        train = worker.train
        (out / "profile_trainer.txt").write_text(_profiled(lambda: train(step_batch, 0.0), sync))
    best = min(times)
    real = int(batch.attention_mask.sum())
    run = {"step_s": best, "tokens_per_s": real / best, "real_tokens": real,
           "mfu": plain.model_flops_per_step(cfg, n_params, 1, seq) * real / seq / best / PEAK_FLOPS,
           "first_step_s": first_s, "first_step_metrics": first_metrics, **shape_change}
    if not DRY_RUN:
        run["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return run


@contextlib.contextmanager
def _kept_after_forward(on: bool):
    """While `on`: `fully_shard` with reshard_after_forward=False (the bench's `-keep` runs)."""
    import torch.distributed.fsdp as fsdp_module

    real = fsdp_module.fully_shard
    if on:
        fsdp_module.fully_shard = functools.partial(real, reshard_after_forward=False)
    try:
        yield
    finally:
        fsdp_module.fully_shard = real


@contextlib.contextmanager
def _automatic_dynamic(on: bool):
    """While `on`: compiled layers without their batch shape marked dynamic (the `-automatic` run: torch's
    automatic dynamic shapes alone, the runtime before issue 29's change)."""
    from runtime.models import hf

    real = hf._batch_shape_dynamic
    if on:
        hf._batch_shape_dynamic = lambda compiled: compiled
    try:
        yield
    finally:
        hf._batch_shape_dynamic = real


def _profiled(step, sync) -> str:
    """The 40 costliest ops of one `step` under the torch profiler (self device time), as a table."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if DRY_RUN else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        step()
        sync()
    key = "self_cpu_time_total" if DRY_RUN else "self_cuda_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70)


def main() -> int:
    # every compile cold, as on a fresh node: no inductor / autograd cache hit from an earlier run of this process
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
    import torch
    from loop_support import trainer_rl

    from runtime.trainer import free_port

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[2:]
    baseline_path = Path(args[args.index("--baseline") + 1]) if "--baseline" in args else \
        ROOT.parent / "shared" / "bench" / "plain_baseline.py"
    plain = _baseline(baseline_path)
    cfg = plain.qwen3_1p7b_config()
    rows, seq, steps = 4, 4096, 3
    if DRY_RUN:
        from transformers import Qwen3Config

        cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
        rows, seq, steps = 2, 64, 1
    from transformers import Qwen3ForCausalLM

    model_dir = Path(tempfile.gettempdir()) / "molt_gpu_bench_trainer_model"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    del model
    report: dict = {"device": "cpu (dry run)" if DRY_RUN else torch.cuda.get_device_name(0), "rows": rows,
                    "seq": seq, "layers": cfg.num_hidden_layers, "runs": {}}
    flops = plain.model_flops_per_step(cfg, n_params, rows, seq)
    if not DRY_RUN:
        t = plain.plain_train_step_seconds(cfg, batch=rows, seq=seq)
        report["runs"]["plain/uniform"] = {"step_s": t, "tokens_per_s": rows * seq / t, "mfu": flops / t / PEAK_FLOPS}
        torch.cuda.empty_cache()
        # The skewed batch padded is 16 x 4096: the baseline computes it as 4 of its 4 x 4096 steps (one 16 x 4096
        # step does not fit: its cross-entropy upcasts 16 x 4096 x vocab logits to fp32).
        real = seq * rows + (seq // 8) * rows * 3
        report["runs"]["plain/skewed"] = {"step_s": 4 * t, "tokens_per_s": real / (4 * t), "real_tokens": real,
                                          "how": "4 x the measured 4 x 4096 step"}
    device = "cpu" if DRY_RUN else "cuda"
    sync = (lambda: None) if DRY_RUN else torch.cuda.synchronize
    uniform = _batch([seq] * rows, cfg.vocab_size, seq)
    skewed_lengths = [seq if i % 4 == 0 else seq // 8 for i in range(rows * 4)]
    skewed = _batch(skewed_lengths, cfg.vocab_size, seq)
    shorter = _batch([seq - seq // 4] * rows, cfg.vocab_size, seq - seq // 4)  # a new batch shape mid-run
    def worker_args(batch, packing: bool, ckpt: str, attn: str, compiled: bool, backend: str):
        n = batch.batch_size
        return trainer_rl(1, ref=False, model={"path": str(model_dir), "attn": attn,
                                               "dtype": "float32" if DRY_RUN else "bfloat16",
                                               "gradient_checkpoint": ckpt, "compile_layers": compiled,
                                               "backend": backend},
                          trainer={"micro_batch_size": rows, "grad_accum": n // rows, "max_epochs": 1,
                                   "temperature": 1.0, "packing": packing, "dynamic_batch_max_tokens": None,
                                   "local_batch_size": None},
                          optimizer={"lr": 1e-6, "scheduler": "constant", "warmup_steps": 0, "total_steps": 100},
                          kl={"use_loss": False}, is_correction={"level": "off"}, device=device,
                          dist_backend="gloo" if DRY_RUN else "nccl")

    port = free_port()
    runs = [  # (name, batch, packing, activation checkpointing, attention, model.compile_layers)
        ("uniform/padded", uniform, False, "full", "sdpa", False),
        # torch's automatic dynamic shapes alone (the layers' batch shape not marked dynamic): static graph first,
        # a recompile at the first new shape
        ("uniform/padded-compiled-automatic", uniform, False, "full", "sdpa", True),
        ("uniform/padded-compiled", uniform, False, "full", "sdpa", True),
        ("uniform/padded-selective-compiled", uniform, False, "selective", "sdpa", True),
        ("uniform/padded-none-compiled", uniform, False, "none", "sdpa", True),
        ("uniform/padded-selective", uniform, False, "selective", "sdpa", False),
        ("uniform/padded-none", uniform, False, "none", "sdpa", False),
        ("uniform/packed", uniform, True, "full", "sdpa", False),
        ("skewed/packed", skewed, True, "full", "sdpa", False),
        ("skewed/packed-compiled", skewed, True, "full", "sdpa", True),
        ("skewed/packed-none-compiled", skewed, True, "none", "sdpa", True),
        ("skewed/packed-flex-none-compiled", skewed, True, "none", "flex_attention", True),
        ("skewed/packed-selective", skewed, True, "selective", "sdpa", False),
        ("skewed/packed-flex-selective", skewed, True, "selective", "flex_attention", False),
        # flash_attention_2 without the flash-attn package: torch's varlen kernel (runtime/packed_attention.py)
        ("uniform/packed-varlen", uniform, True, "full", "flash_attention_2", False),
        ("skewed/packed-varlen", skewed, True, "full", "flash_attention_2", False),
        ("skewed/packed-varlen-selective", skewed, True, "selective", "flash_attention_2", False),
        ("skewed/packed-varlen-none-compiled", skewed, True, "none", "flash_attention_2", True),
        ("skewed/packed-varlen-compiled", skewed, True, "full", "flash_attention_2", True),
        # an experiment, not a runtime setting: FSDP2 units keep their gathered bf16 parameters between the forward
        # and the backward (reshard_after_forward=False), so world 1 skips the cast-copies of the recomputation
        ("uniform/padded-keep", uniform, False, "full", "sdpa", False),
        ("uniform/padded-selective-keep", uniform, False, "selective", "sdpa", False),
        ("skewed/packed-varlen-keep", skewed, True, "full", "flash_attention_2", False),
        # the automodel backend (nemo-automodel's Qwen3 through runtime/models/automodel.py) on the same dense
        # shape: against the hf backend's run of the same name without the suffix, speed and first-step numbers
        ("uniform/padded-automodel", uniform, False, "full", "sdpa", False),
        ("uniform/padded-compiled-automodel", uniform, False, "full", "sdpa", True),
        ("uniform/padded-selective-compiled-automodel", uniform, False, "selective", "sdpa", True),
        ("uniform/padded-selective-automodel", uniform, False, "selective", "sdpa", False),
    ]
    profiled = args[args.index("--profile") + 1] if "--profile" in args else None
    only = [a for a in args if not a.startswith("--") and a != baseline_path.as_posix()]  # --profile NAME runs NAME
    for name, batch, packing, ckpt, attn, compiled in runs:
        if only and name not in only:
            continue
        torch._dynamo.reset()  # each run compiles cold (its own graphs; no cache-size limit carried over)
        try:
            with _kept_after_forward(name.endswith("-keep")), _automatic_dynamic(name.endswith("-automatic")):
                backend = "automodel" if name.endswith("-automodel") else "hf"
                run = _trainer_run(worker_args(batch, packing, ckpt, attn, compiled, backend), batch, steps, sync, cfg,
                                   n_params, seq, plain, port, name == profiled, out,
                                   new_shape=shorter if name.startswith("uniform/") else None)
        except Exception as exc:  # one variant failing (an attention kernel missing) does not lose the others
            run = {"error": repr(exc)[:2000]}
        port += 1
        run.update(gradient_checkpoint=ckpt, attn=attn, packing=packing, compile_layers=compiled)
        report["runs"][name] = run
        if not DRY_RUN:
            torch.cuda.empty_cache()
    for name, run in report["runs"].items():  # each against the plain baseline on the same batch
        base = report["runs"].get(f"plain/{name.split('/')[0]}")
        if base is not None and "tokens_per_s" in run:
            run["ratio_vs_plain"] = run["tokens_per_s"] / base["tokens_per_s"]
        hf_run = report["runs"].get(name.removesuffix("-automodel"))
        if name.endswith("-automodel") and hf_run and "tokens_per_s" in run and "tokens_per_s" in hf_run:
            run["ratio_vs_hf_backend"] = run["tokens_per_s"] / hf_run["tokens_per_s"]
            run["first_step_rel_diff_vs_hf_backend"] = {
                k: abs(v - hf_run["first_step_metrics"][k]) / max(abs(hf_run["first_step_metrics"][k]), 1e-12)
                for k, v in run["first_step_metrics"].items() if k in hf_run["first_step_metrics"]}
    text = json.dumps(report, indent=1)
    print(text)
    (out / "trainer_gpu.json").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
