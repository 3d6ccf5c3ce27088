"""GPU benchmark of the hf engine's generation core (run on one H200; not part of `just test`).

    python3 tests/gpu/bench_hf_engine.py OUT_DIR            # on the GPU machine
    python3 tests/gpu/bench_hf_engine.py OUT_DIR --dry-run  # CPU, tiny model: checks the script itself

Needs only torch and transformers (no Ray, no pydantic): `runtime/engines/hf_decode.py` is loaded by file path.
1. check: a small random Qwen3 in fp32 on the device, CUDA graphs on: greedy tokens equal `model.generate`'s and the
   returned logprobs equal a teacher-forced forward's log-softmax, on prompts of mixed lengths;
2. speed: a random Qwen3-1.7B-shaped model in bf16, 256 requests of 128-token prompts, 256 new tokens each
   (temperature 1): `model.generate` at batch 256 (the baseline), then the core (CUDA graphs; eager; top_p 0.9),
   each timed on a second run after a warm-up run (the first run's time, CUDA-graph capture included, is recorded),
   and the core with CUDA graphs as the engine builds it (`yield_to`: the host keeps at most two steps queued);
   then 512 requests of mixed prompt lengths and limits through the 256 slots (continuous batching);
   `--profile`: the kernel-time table of 8 eager decode steps; `--continuous-only`: only the mixed requests;
   `--check-only`: only 1.
Writes OUT_DIR/bench_hf_engine.json and prints it.

Measured on one H200 (torch 2.11+cu130, transformers 5.17), three runs on three machines of that kind:
core with CUDA graphs 22,916 / 23,030 / 22,591 tokens/s; `model.generate` at batch 256 3,710 / 2,993 / 2,200 (host-bound,
varies with the machine's CPU): 6.2x / 7.7x / 10.3x. Core eager 7,461 / 8,576 / 5,136; top_p 0.9 16,924 / 17,005 /
16,746 (the full-vocabulary sort); 512 requests of 32-128 prompt and 64-256 new tokens through 256 slots 14,770
(second run; the batch thins out at the end). KV cache 10.6 GiB, peak allocated 14.9 GiB. Check: greedy =
generate on 7/7 prompts, logprob error 1.9e-6 (fp32, graphs on).
One H100 (2026-12-06): core with CUDA graphs 19,912 tokens/s, as the engine builds it (`yield_to`: the host waits for
step k - 2 before launching step k) 19,917 (1.00x: the wait costs nothing measurable); `model.generate` 4,522.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
DRY_RUN = "--dry-run" in sys.argv
DEVICE = "cpu" if DRY_RUN else "cuda"


def load_core():
    spec = importlib.util.spec_from_file_location("hf_decode", ROOT / "runtime" / "engines" / "hf_decode.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_decode"] = module
    spec.loader.exec_module(module)
    return module


hf_decode = load_core()

QWEN3_1_7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True,
                  max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=1000, tie_word_embeddings=True, max_position_embeddings=1024)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             intermediate_size=512, vocab_size=4096, tie_word_embeddings=True, max_position_embeddings=1024)
BATCH, PROMPT, NEW = (8, 16, 16) if DRY_RUN else (256, 128, 256)


def build(shape: dict, dtype: torch.dtype, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(**shape, eos_token_id=None, pad_token_id=0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def run_core(core, prompts, max_tokens, temperature, top_p):
    reqs = [hf_decode.Request(p, max_tokens, temperature, top_p) for p in prompts]
    for r in reqs:
        core.submit(r)
    sync()
    t0 = time.perf_counter()
    while core.busy():
        core.run_chunk()
    sync()
    return reqs, time.perf_counter() - t0


def check(out: dict) -> None:
    """Correctness on the device (fp32): greedy vs generate, logprobs vs teacher forcing."""
    ref = build(TINY if DRY_RUN else SMALL, torch.float32, seed=1)
    model = build(TINY if DRY_RUN else SMALL, torch.float32, seed=1)
    gen = torch.Generator().manual_seed(0)
    vocab = ref.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (3, 17, 64, 5, 100, 1, 33)]
    new = 40
    core = hf_decode.DecodeCore(model, slots=8, max_model_len=256, eos_ids=[], pad_id=0, raw_logprobs=False,
                                cuda_graphs=True, chunk_steps=16)
    reqs, _ = run_core(core, prompts, new, 0.0, 1.0)
    sampled, _ = run_core(core, prompts, new, 1.0, 0.9)
    greedy_equal, lp_err = [], 0.0
    with torch.inference_mode():
        for r in reqs + sampled:
            ids = torch.tensor([r.prompt_ids + r.token_ids], device=DEVICE)
            logits = ref(input_ids=ids).logits[0, len(r.prompt_ids) - 1: -1].float()
            if r.temperature > 0:  # processed: tempered (T = 1) and top-p cut
                logits = hf_decode.top_p_filter(logits, torch.full((len(logits),), r.top_p, device=DEVICE))
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(r.prompt_ids):, None])[:, 0]
            lp_err = max(lp_err, (lp - torch.tensor(r.logprobs, device=DEVICE)).abs().max().item())
            if r.temperature == 0:
                g = ref.generate(torch.tensor([r.prompt_ids], device=DEVICE), max_new_tokens=new, do_sample=False)
                greedy_equal.append(g[0, len(r.prompt_ids):].tolist() == r.token_ids)
    probe = reqs[2].prompt_ids + reqs[2].token_ids
    with torch.inference_mode():
        logits = ref(input_ids=torch.tensor([probe], device=DEVICE)).logits[0, :-1].float()
    ref_score = torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe[1:], device=DEVICE)[:, None])[:, 0]
    score_err = (torch.tensor(core.score(probe), device=DEVICE) - ref_score).abs().max().item()
    out["check"] = {"greedy_equal_generate": greedy_equal, "max_abs_logprob_error_fp32": lp_err,
                    "max_abs_score_error_fp32": score_err,
                    "graphs_captured": len(core.graphs)}


def speed(out: dict) -> None:
    dtype = torch.float32 if DRY_RUN else torch.bfloat16
    model = build(TINY if DRY_RUN else QWEN3_1_7B, dtype)
    out["model_params"] = sum(p.numel() for p in model.parameters())
    if "--continuous-only" in sys.argv:
        continuous(model, out)
        return
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, model.config.vocab_size, (BATCH, PROMPT), generator=gen)
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    with torch.inference_mode():
        ids = prompts.to(DEVICE)
        model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, **sampling)  # warm-up
        sync()
        t0 = time.perf_counter()
        seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              min_new_tokens=NEW, **sampling)
        sync()
        base_s = time.perf_counter() - t0
    base_tokens = (seqs.shape[1] - PROMPT) * BATCH
    out["generate"] = {"batch": BATCH, "seconds": round(base_s, 3), "tokens": base_tokens,
                       "tokens_per_s": round(base_tokens / base_s, 1)}
    if DEVICE == "cuda":
        out["generate"]["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        torch.cuda.reset_peak_memory_stats()
    prompt_lists = prompts.tolist()
    # `engine_graphs_yield_to`: as the engine builds the core (`yield_to` = its gate's `wanted`, never true here):
    # what the host's wait for step k - 2 before each decode step costs the generation
    for name, graphs, top_p, yield_to in (("engine_graphs", True, 1.0, None), ("engine_eager", False, 1.0, None),
                                          ("engine_graphs_top_p_0.9", True, 0.9, None),
                                          ("engine_graphs_yield_to", True, 1.0, lambda: False)):
        try:
            core = hf_decode.DecodeCore(model, slots=BATCH, max_model_len=PROMPT + NEW, eos_ids=[], pad_id=0,
                                        raw_logprobs=False, cuda_graphs=graphs, yield_to=yield_to)
            _, first_s = run_core(core, prompt_lists, NEW, 1.0, top_p)
            reqs, s = run_core(core, prompt_lists, NEW, 1.0, top_p)
            tokens = sum(len(r.token_ids) for r in reqs)
            row = {"seconds": round(s, 3), "first_run_seconds": round(first_s, 3), "tokens": tokens,
                   "tokens_per_s": round(tokens / s, 1),
                   "speedup_vs_generate": round(tokens / s / out["generate"]["tokens_per_s"], 2),
                   "graphs_captured": len(core.graphs), "kv_cache_gib": round(core.memory_bytes() / 2**30, 2)}
            if DEVICE == "cuda":
                row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            out[name] = row
            del core
        except Exception:
            out[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, out[name], flush=True)
    continuous(model, out)
    if "--profile" in sys.argv:
        profile(model, prompt_lists, out)


def continuous(model, out: dict) -> None:
    """2 x BATCH requests of mixed prompt lengths and limits through BATCH slots: requests join as others finish;
    timed on the second run."""
    gen = torch.Generator().manual_seed(1)
    n = 2 * BATCH
    lengths = torch.randint(PROMPT // 4, PROMPT + 1, (n,), generator=gen).tolist()
    limits = torch.randint(NEW // 4, NEW + 1, (n,), generator=gen).tolist()
    prompts = [torch.randint(1, model.config.vocab_size, (k,), generator=gen).tolist() for k in lengths]
    try:
        core = hf_decode.DecodeCore(model, slots=BATCH, max_model_len=PROMPT + NEW, eos_ids=[], pad_id=0,
                                    raw_logprobs=False, cuda_graphs=True)
        for _ in range(2):
            reqs = [hf_decode.Request(p, m, 1.0, 1.0) for p, m in zip(prompts, limits, strict=True)]
            for r in reqs:
                core.submit(r)
            sync()
            t0 = time.perf_counter()
            while core.busy():
                core.run_chunk()
            sync()
            s = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for r in reqs)
        out["engine_continuous"] = {"requests": n, "slots": BATCH, "seconds": round(s, 3), "tokens": tokens,
                                    "tokens_per_s": round(tokens / s, 1), "graphs_captured": len(core.graphs)}
    except Exception:
        out["engine_continuous"] = {"error": traceback.format_exc()[-3000:]}
    print("engine_continuous", out["engine_continuous"], flush=True)


def profile(model, prompts, out: dict) -> None:
    """Kernel time of eager decode steps (the same kernels a CUDA graph replays)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    core = hf_decode.DecodeCore(model, slots=BATCH, max_model_len=PROMPT + NEW, eos_ids=[], pad_id=0,
                                raw_logprobs=False, cuda_graphs=False, chunk_steps=8)
    reqs = [hf_decode.Request(p, NEW, 1.0, 1.0) for p in prompts]
    for r in reqs:
        core.submit(r)
    core.run_chunk()  # prefill + 8 steps outside the profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        core.run_chunk()
        sync()
    key = "self_cuda_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)
    out["profile_8_steps"] = table.splitlines()
    print(table, flush=True)


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__,
                 "shape": f"{BATCH} requests x ({PROMPT} prompt + {NEW} new)"}
    parts = (speed,) if "--continuous-only" in sys.argv else (check,) if "--check-only" in sys.argv else (check, speed)
    for part in parts:
        try:
            part(out)
        except Exception:
            out[part.__name__ + "_error"] = traceback.format_exc()[-3000:]
        (out_dir / "bench_hf_engine.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
