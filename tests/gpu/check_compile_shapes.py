"""Compiled layers keep one graph over the RL loop's micro-batch shapes on one GPU (issue 29; not in `just test`).

    python3 tests/gpu/check_compile_shapes.py OUT_DIR [--packed-only]
    MOLT_GPU_CHECK_DRY_RUN=1 python3 tests/gpu/check_compile_shapes.py OUT_DIR     (CPU, tiny: checks the script)

A random Qwen3-1.7B-shaped model (28 layers, bf16) under `runtime.models.hf.compile_layers` with full
checkpointing, fed the shapes one RL run meets (16-row micro-batches of 64 to 424 positions, one of them without
padding, 8 and 3 rows, one row), each width padded to the plan's `width_multiple` (8 on GPUs) as the runtime pads it,
through the runtime's padded path (`runtime.logprobs.token_logprobs`: decoder, chunked lm_head log-probs) and
backward, after a no-grad pass (the old-log-prob pass), twice per shape. Passes when the decoder layers compiled one graph per grad mode for every multi-row shape
with no graph break (a one-row micro-batch compiles one more, once: torch specializes a size of 1), the lm_head
chunk one per grad mode, and no multi-row shape compiled anything at its first step; records each shape's first and steady step against the same model
eager (transformers' own checkpointing). Writes OUT_DIR/compile_shapes.json.
Before the width padding and the inductor option (2026-12-04, one H200): 10 graphs for
these shapes, each new one 10-14 s in the middle of the run (a 39 s training step at the loop's last, short batch).
Added 2026-12-05: the no-grad pass, the lm_head chunk's graph count (at most 2: no-grad and grad) and
`recompiled_shapes` (each shape whose first step took a second longer than its steady step: none may), and
`chunk_ab`: the chunk alone, compiled static and padded (the runtime's since then) against dynamic and unpadded.
Run 2026-12-05 (one H200, 330 s): layer graphs 4, chunk graphs 2, no graph break; the one-row shape's first step
16.9 s (its graphs compiling; steady 0.11 s), no other shape over its steady step by a second; compiled steady
2.19x eager. The chunk alone: dynamic and unpadded compiled at two shapes mid-run (2.4 s and 0.8 s); static and
padded at none (0.18 s at its first shape, compiled already by the run before it), its steady time 11 % over the
dynamic one's (0.217 s against 0.195 s over the 11 shapes: the last chunk's padding, up to 1,023 rows of a
1024-row chunk at 6 ms; under 1 % of a training step at these shapes). In the RL loop that day a step whose responses fell to
3 tokens trained for 15.8 s; in an earlier call's log the chunk (`runtime.logprobs._chunk`) recompiled on inductor's
matmul-padding guard `301 <= hidden.size()[0] <= 2047` (its `shape_padding` pass), and on `2 <= storage_offset()`.
Packed pass (`--packed-only`), first GPU run 2026-12-05 (one H100, after runtime/models/hf.py `_PACKED_ROW_SOURCES`):
passed; layer graphs 2, chunk graphs 2, no graph break, no shape recompiled mid-run (12 micro-batches of 1-16 packed
rows, first step 19.9 s compiling, every later first step within 0.03 s of its steady step: 0.08-0.20 s).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
DRY_RUN = os.environ.get("MOLT_GPU_CHECK_DRY_RUN") == "1"
SHAPES = [(16, 420), (16, 388), (16, 300), (16, 232), (16, 256), (16, 200), (16, 141), (16, 100), (16, 64), (8, 333),
          (3, 150), (1, 100)]
UNPADDED = (16, 256)
"""Every row at full width: transformers drops an all-ones padding mask, so before the runtime stopped passing
the mask of a dense decoder (2026-12-05, `runtime.logprobs.key_padding_mask`) this shape compiled the layers again."""
WIDTH_MULTIPLE = 8  # the compiler's fsdp.width_multiple on GPUs (molt_compile/derive/cluster.py)


def _model(compiled: bool, packed: bool = False):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from runtime import packed_attention
    from runtime.models.hf import compile_layers

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=1000) if DRY_RUN else dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(max_position_embeddings=4096, tie_word_embeddings=True, **size))
    if packed:  # the packed GPU demo's attention (torch's varlen kernel; its CPU reference in the dry run)
        if DRY_RUN:
            packed_attention.register("molt_varlen_reference", packed_attention.reference_kernel)
        name = "molt_varlen_reference" if DRY_RUN else packed_attention.implementation("flash_attention_2",
                                                                                      torch.device("cuda"))
        model.config._attn_implementation = name
    model = model.to("cpu" if DRY_RUN else "cuda", torch.float32 if DRY_RUN else torch.bfloat16)
    if compiled:
        compile_layers(model.model.layers, "full")
    else:
        model.gradient_checkpointing_enable()
    return model


def _steps(model, packed: bool = False) -> list[dict]:
    import torch

    from runtime.logprobs import token_logprobs

    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for rows, length in SHAPES:
        width = -(-length // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        g = torch.Generator().manual_seed(rows * 1000 + length)
        ids = torch.randint(5, 1000, (rows, width), generator=g).to(dev)
        mask = (torch.arange(width, device=dev)[None, :] < length).long().expand(rows, width).clone()
        if packed:  # rows of random lengths: each micro-batch a new document count and longest document
            lengths = torch.randint(max(1, length // 3), length + 1, (rows,), generator=g).to(dev)
            mask = (torch.arange(width, device=dev)[None, :] < lengths[:, None]).long()
        elif (rows, length) != UNPADDED:
            mask[0, length - 5:] = 0  # rows of unequal length
        times = []
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():  # the old-log-prob pass first, as the loop runs it
                token_logprobs(model, ids, mask.bool(), 1.0, packed=packed)
            lp, _ = token_logprobs(model, ids, mask.bool(), 1.0, packed=packed)
            (lp * mask[:, 1:]).sum().backward()
            sync()
            times.append(time.perf_counter() - t0)
        out.append({"rows": rows, "length": length, "width": width, "first_s": times[0], "steady_s": times[1]})
        print(json.dumps(out[-1]), flush=True)
    return out


def _chunk_ab(model) -> dict:
    """The lm_head chunk alone at each shape's positions (no-grad pass, then forward and backward): compiled with
    static shapes and its last chunk padded (the runtime's), against compiled with dynamic sizes, unpadded (before
    2026-12-05), in that order on the same head. Each variant's first pass at a shape includes what it compiles."""
    import torch

    from runtime import logprobs

    head, dev = model.lm_head, next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    real_chunk, real_padded = logprobs._compiled_chunk, logprobs._padded
    dynamic = torch.compile(logprobs._chunk)
    result = {}
    for variant in ("dynamic_unpadded", "static_padded"):
        torch._dynamo.reset()
        if variant == "dynamic_unpadded":
            logprobs._compiled_chunk, logprobs._padded = (lambda: dynamic), (lambda t, rows: t)
        else:
            logprobs._compiled_chunk, logprobs._padded = real_chunk, real_padded
        per_shape = []
        for rows, length in SHAPES:
            n = rows * (-(-length // WIDTH_MULTIPLE) * WIDTH_MULTIPLE - 1)
            g = torch.Generator().manual_seed(n)
            hidden = torch.randn(n, head.in_features, generator=g).to(dev, head.weight.dtype).requires_grad_()
            targets = torch.randint(0, head.out_features, (n,), generator=g).to(dev)
            times = []
            for _ in range(2):
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    logprobs.head_logprobs(head, hidden.detach(), targets, 1.0, False)
                lp, _, _ = logprobs.head_logprobs(head, hidden, targets, 1.0, False)
                lp.sum().backward()
                sync()
                times.append(time.perf_counter() - t0)
            per_shape.append({"positions": n, "first_s": times[0], "steady_s": times[1]})
        result[variant] = {"first_s": sum(p["first_s"] for p in per_shape),
                           "steady_s": sum(p["steady_s"] for p in per_shape), "shapes": per_shape}
    logprobs._compiled_chunk, logprobs._padded = real_chunk, real_padded
    torch._dynamo.reset()
    result["steady_static_vs_dynamic"] = result["dynamic_unpadded"]["steady_s"] / result["static_padded"]["steady_s"]
    print(json.dumps({k: v if not isinstance(v, dict) else {"first_s": v["first_s"], "steady_s": v["steady_s"]}
                      for k, v in result.items()}), flush=True)
    return result


def _compiled_report(counters, steps: list[dict]) -> dict:
    """What the compiled run of `steps` compiled: the decoder layers' graphs (all but the lm_head chunk's own: GPUs
    compile it apart, small graphs), the chunk's, the graph breaks, and each shape whose first step took a second
    more than its steady one (it compiled something mid-run)."""
    import torch

    from runtime import logprobs

    chunk_graphs = len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(logprobs._chunk.__code__))
    return {"layer_graphs": counters["stats"]["unique_graphs"] - chunk_graphs, "chunk_graphs": chunk_graphs,
            "graph_breaks": sum(counters["graph_break"].values()),
            "recompiled_shapes": [(c["rows"], c["length"]) for c in steps[1:] if c["first_s"] > c["steady_s"] + 1.0]}


def _packed(counters) -> dict:
    """The same shapes packed (one row per micro-batch, `runtime.logprobs.pack`) through varlen attention: the
    layers compile one graph per grad mode for every document count and longest document (`hf._PACKED_ROW_SOURCES`),
    none mid-run."""
    import torch

    torch._dynamo.reset()
    counters.clear()
    steps = _steps(_model(compiled=True, packed=True), packed=True)
    return {**_compiled_report(counters, steps), "steps": steps}


def _packed_ok(packed: dict) -> bool:
    """One layer graph per grad mode, no break, nothing compiled mid-run."""
    return packed["graph_breaks"] == 0 and packed["layer_graphs"] <= 2 and not packed["recompiled_shapes"]


def main() -> int:
    import torch
    from torch._dynamo.utils import counters

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if "--packed-only" in sys.argv:  # the packed pass alone (a short device call)
        packed = _packed(counters)
        (out / "compile_shapes.json").write_text(json.dumps({"packed": packed}, indent=1))
        ok = _packed_ok(packed)
        print(json.dumps({k: v for k, v in packed.items() if k != "steps"}), "\ncompile_shapes:",
              "ok" if ok or DRY_RUN else "FAILED")
        return 0 if ok or DRY_RUN else 1
    eager = _steps(_model(compiled=False))
    torch._dynamo.reset()
    counters.clear()
    compiled = _steps(_model(compiled=True))
    report = _compiled_report(counters, compiled)  # before the packed pass clears the counters
    packed = _packed(counters)
    chunk_ab = _chunk_ab(_model(compiled=False)) if not DRY_RUN or os.environ.get("MOLT_CHUNK_AB") else None
    report = {
        "packed": packed, "chunk_ab": chunk_ab, **report, "eager": eager, "compiled": compiled,
        "steady_vs_eager": sum(e["steady_s"] for e in eager) / sum(c["steady_s"] for c in compiled),
    }
    (out / "compile_shapes.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("eager", "compiled")}, indent=1))
    # the CPU dry run checks the script only: the CPU inductor guards on other shapes (its C++ accumulators)
    # the layers: a graph per grad mode (the no-grad old-log-prob pass, training), and at one row one more each
    # (torch specializes a size of 1); the chunk: one per grad mode; only the one-row shape may compile mid-run
    ok = DRY_RUN or (report["graph_breaks"] == 0 and report["layer_graphs"] <= 4 and report["chunk_graphs"] <= 2
                     and all(rows == 1 for rows, _ in report["recompiled_shapes"])
                     and _packed_ok(packed))
    print("compile_shapes:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
