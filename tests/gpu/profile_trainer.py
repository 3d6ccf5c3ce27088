"""Where the trainer rank's step loses time against the plain baseline, on one GPU (issue 29; not in `just test`).

    python3 tests/gpu/profile_trainer.py OUT_DIR [--baseline PATH/plain_baseline.py] [VARIANT ...]

The same random Qwen3-1.7B-shaped model and 4 x 4096 tokens as `bench_trainer.py`. One step of the plain baseline
and one of each trainer variant run under the torch profiler: self device time grouped into kernel families (matmul,
attention, NCCL copies of FSDP2 at world 1, casts and copies, optimizer, elementwise), the device-busy time against the
wall time (host-bound gaps), and each variant's best step time against the plain step measured in the same process.
Variants are experiments applied around the real `PolicyWorker` (patches of this script only, named below).
Writes OUT_DIR/profile_trainer.json and OUT_DIR/profile_<variant>.txt (the 40 costliest ops).

Found on one H200 (2026-12-03, torch 2.11; every figure a step-time ratio against the plain step of the same run):
- the GPU is busy for the whole step in every variant (device-busy time = step time): the gap is kernels, not
  host launch overhead;
- the eager lm_head log-prob chunks cost ~65 ms of 0.83 s: the fp32 cast, the temperature division, logsumexp,
  gather and their backward are a dozen passes over (chunk x 152k) fp32 logits (aten::div 22 ms, aten::sub 22 ms,
  exp 14 ms; plain's fused cross-entropy ~20 ms). Compiling the chunk (runtime/logprobs.py): full 0.86x -> 0.93x;
- resharding between the forward and the recompute (FSDP2 world 1): `reshard_after_forward=False` 0.93x -> 0.97x,
  at +9 GiB peak; the rest of FSDP2 at world 1 (fp32 master casts, world-1 NCCL copies, fp32 gradient
  accumulation and AdamW on fp32 states) ~55 ms more than plain's bf16 weights, inherent to fp32 master weights;
- the eager decoder layers' norms, rotary and SiLU (aten::mul 140 ms, copies 90 ms) are the rest, the same in plain:
  compiled layers remove them. With the checkpoint inside the compiled layer: full 1.37x, selective 1.62x, none
  1.69x (eager none 1.17x).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

FAMILIES = (  # (family, substrings of a kernel/op name), first match wins
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "varlen")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("matmul", ("gemm", "sm90_xmma", "cutlass", "nvjet", "::mm", "::addmm", "::bmm", "matmul")),
    ("copy_cast", ("copy", "cast", "convert", "to_copy", "fill", "cat", "chunk_cat", "split_with_sizes")),
)


def _family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def _profile(step, sync, out: Path, name: str) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    wall = time.perf_counter() - t0
    families: dict[str, float] = {}
    busy = 0.0
    for evt in prof.events():  # device kernels only
        if evt.device_type == DeviceType.CUDA:
            us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            families[_family(evt.name)] = families.get(_family(evt.name), 0.0) + us / 1e6
            busy += us / 1e6
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    (out / f"profile_{name.replace('/', '_')}.txt").write_text(table)
    return {"profiled_wall_s": wall, "device_busy_s": busy, "families_s": {k: round(v, 4) for k, v in
                                                                          sorted(families.items())}}


def main() -> int:
    import tempfile

    import torch
    from bench_trainer import _baseline, _batch
    from loop_support import trainer_rl

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    args = sys.argv[2:]
    baseline_path = Path(args[args.index("--baseline") + 1]) if "--baseline" in args else \
        ROOT.parent / "shared" / "bench" / "plain_baseline.py"
    only = [a for a in args if not a.startswith("--") and a != baseline_path.as_posix()]
    plain = _baseline(baseline_path)
    cfg = plain.qwen3_1p7b_config()
    rows, seq = 4, 4096
    from transformers import Qwen3ForCausalLM

    from runtime.trainer import PolicyWorker, free_port

    model_dir = Path(tempfile.gettempdir()) / "molt_gpu_bench_trainer_model"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(model_dir)
    del model
    sync = torch.cuda.synchronize
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": {}}

    # the plain baseline, timed and profiled in this process
    t_plain = plain.plain_train_step_seconds(cfg, batch=rows, seq=seq)
    report["runs"]["plain"] = {"step_s": t_plain}
    if not only or "plain" in only:
        torch.manual_seed(0)
        cfg._attn_implementation = "sdpa"
        pm = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16)
        pm.gradient_checkpointing_enable()
        pm.config.use_cache = False
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-6, fused=True)
        x = torch.randint(0, cfg.vocab_size, (rows, seq), device="cuda")

        def pstep():
            pm(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        pstep()
        report["runs"]["plain"].update(_profile(pstep, sync, out, "plain"))
        del pm, opt
        torch.cuda.empty_cache()

    uniform = _batch([seq] * rows, cfg.vocab_size, seq)
    port = free_port()

    def rl_for(ckpt: str, compiled: bool = False, attn: str = "sdpa", packing: bool = False):
        return trainer_rl(1, ref=False, model={"path": str(model_dir), "attn": attn, "dtype": "bfloat16",
                                               "gradient_checkpoint": ckpt, "compile_layers": compiled},
                          trainer={"micro_batch_size": rows, "grad_accum": 1, "max_epochs": 1,
                                   "temperature": 1.0, "packing": packing, "dynamic_batch_max_tokens": None,
                                   "local_batch_size": None},
                          optimizer={"lr": 1e-6, "scheduler": "constant", "warmup_steps": 0, "total_steps": 100},
                          kl={"use_loss": False}, is_correction={"level": "off"}, device="cuda",
                          dist_backend="nccl")

    @contextlib.contextmanager
    def keep():
        import torch.distributed.fsdp as fsdp_module
        real = fsdp_module.fully_shard
        fsdp_module.fully_shard = functools.partial(real, reshard_after_forward=False)
        try:
            yield
        finally:
            fsdp_module.fully_shard = real

    @contextlib.contextmanager
    def eager_chunk():  # the lm_head chunks as before issue 29 (uncompiled)
        import runtime.logprobs as lp
        real = lp._compiled_chunk
        lp._compiled_chunk = lambda: lp._chunk
        try:
            yield
        finally:
            lp._compiled_chunk = real

    variants = {  # name: (rl, context)
        "full": (lambda: rl_for("full"), contextlib.nullcontext),
        "selective": (lambda: rl_for("selective"), contextlib.nullcontext),
        "full-keep": (lambda: rl_for("full"), keep),
        "full-eager-chunk": (lambda: rl_for("full"), eager_chunk),
        "none": (lambda: rl_for("none"), contextlib.nullcontext),
        "full-compiled-layers": (lambda: rl_for("full", compiled=True), contextlib.nullcontext),
        "selective-compiled-layers": (lambda: rl_for("selective", compiled=True), contextlib.nullcontext),
        "none-compiled-layers": (lambda: rl_for("none", compiled=True), contextlib.nullcontext),
    }
    for name, (make_rl, ctx) in variants.items():
        if only and name not in only:
            continue
        try:
            with ctx():
                rl = make_rl()
                worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, 0,
                                      "127.0.0.1", port)
                mask = uniform.action_mask
                b = replace(uniform, old_log_probs=torch.zeros(mask.shape), advantages=mask.float(),
                            rollout_log_probs=torch.zeros(mask.shape))
                torch.cuda.reset_peak_memory_stats()
                times = []
                for i in range(4):
                    sync()
                    t0 = time.perf_counter()
                    worker.train(b, 0.0)
                    sync()
                    if i:
                        times.append(time.perf_counter() - t0)
                run = {"step_s": min(times), "ratio_vs_plain": t_plain / min(times),
                       "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
                run.update(_profile(functools.partial(worker.train, b, 0.0), sync, out, name))
                worker.shutdown()
                del worker
        except Exception as exc:
            import traceback
            run = {"error": repr(exc)[:1500], "trace": traceback.format_exc()[-3000:]}
        port += 1
        report["runs"][name] = run
        print(name, json.dumps(run), flush=True)
        torch.cuda.empty_cache()
    text = json.dumps(report, indent=1)
    print(text)
    (out / "profile_trainer.json").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
