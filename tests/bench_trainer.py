"""Trainer benchmark on CPU: tokens/s of one RL train step, padded (contiguous or grouped by length) vs packed vs
token-budget micro-batches.

    python -m tests.bench trainer

One `PolicyWorker` rank (FSDP2 world 1, gloo, fp32) on a small random Qwen3 (2 layers, hidden 256, vocabulary 2048),
and a batch with skewed response lengths: 32 rows, most 24-64 tokens, one in eight 256-320 tokens. Each layout
runs the step the loop runs (old log-probs forward, then `train`: 2 optimizer steps of micro 8 x accum 2 rows);
best of `REPEAT` wall times, the layouts taking turns. tokens/s counts real (non-padding) tokens, so a layout that
computes padding pays for it. The layouts:
- padded: micro-batches of 8 contiguous rows, right-padded to their longest row;
- padded_by_length ("padded, by length"): the same windows and micro-batch sizes, each window's rows grouped by
  length (`TrainerPlan.micro_batches_by_length`), so the long rows share micro-batches and the rest pad less;
- packed: the same micro-batches, each one packed row (position ids; transformers' block-diagonal sdpa mask);
- dynamic: packed micro-batches of at most `MAX_TOKENS` tokens (first-fit decreasing), same optimizer steps.
Also: the largest (positions x vocabulary) fp32 logits block the lm_head produced per layout (measured with a hook),
against the block the full-logits formula needs for one padded micro-batch (computed).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROWS, MICRO, ACCUM, MAX_TOKENS, REPEAT = 32, 8, 2, 512, 2


def _batch():
    import torch

    from runtime.experience import from_token_lists

    g = torch.Generator().manual_seed(0)
    lengths = [int(torch.randint(256, 321, (1,), generator=g)) if i % 8 == 3 else
               int(torch.randint(24, 65, (1,), generator=g)) for i in range(ROWS)]
    tokens = [torch.randint(5, 2000, (n,), generator=g).tolist() for n in lengths]
    return from_token_lists(tokens, [[(16, n)] for n in lengths], [[] for _ in tokens], pad_id=0)


def run() -> dict:
    import sys

    import torch

    from runtime import microbatch
    from runtime.tiny_model import build_tiny_model
    from runtime.trainer import PolicyWorker, free_port

    sys.path.insert(0, str(Path(__file__).resolve().parent / "runtime"))
    from loop_support import trainer_rl

    model_dir = build_tiny_model(Path(tempfile.gettempdir()) / "molt_bench_trainer_model", seed=0, vocab_size=2048,
                                 hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64)
    base = {"micro_batch_size": MICRO, "grad_accum": ACCUM, "max_epochs": 1, "temperature": 1.0, "seed": 0,
            "packing": False, "dynamic_batch_max_tokens": None, "local_batch_size": None,
            "micro_batches_by_length": False}
    layouts = {
        "padded": base,
        "padded_by_length": {**base, "micro_batches_by_length": True},
        "packed": {**base, "packing": True},
        "dynamic": {**base, "packing": True, "dynamic_batch_max_tokens": MAX_TOKENS, "local_batch_size": MICRO * ACCUM},
    }
    rls = {name: trainer_rl(1, ref=False, model={"path": str(model_dir)}, trainer=t,
                            optimizer={"lr": 1e-5, "scheduler": "constant", "warmup_steps": 0, "total_steps": 100},
                            kl={"use_loss": False}, is_correction={"level": "off"})
           for name, t in layouts.items()}
    rl = rls["padded"]
    worker = PolicyWorker(rl.trainer, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, 0, "127.0.0.1",
                          free_port())
    batch = _batch()
    mask = batch.action_mask
    tokens = int(batch.attention_mask.sum())
    out: dict = {"rows": ROWS, "real_tokens": tokens, "padded_batch_tokens": int(batch.sequences.numel()),
                 "torch_threads": torch.get_num_threads()}
    head_rows: list[int] = []
    hook = worker.model.get_output_embeddings().register_forward_hook(
        lambda m, i, o: head_rows.append(o.numel() // o.shape[-1]))
    times: dict[str, list[float]] = {name: [] for name in rls}
    blocks: dict[str, list[int]] = {name: [] for name in rls}
    try:
        for _ in range(REPEAT):  # the layouts take turns, so a busy spell of a shared machine hits them alike
            for name, layout in rls.items():
                worker.t = layout.trainer
                head_rows.clear()
                t0 = time.perf_counter()
                _, old, _ = worker.forward_logprobs(batch)
                worker.train(replace(batch, old_log_probs=old, advantages=mask.float(), rollout_log_probs=old * mask),
                             0.0)
                times[name].append(time.perf_counter() - t0)
                blocks[name].extend(head_rows)
        for name in rls:
            out[f"{name}_step_s"] = min(times[name])
            out[f"{name}_tokens_per_s"] = tokens / min(times[name])
            out[f"{name}_largest_logits_block_mb"] = max(blocks[name]) * worker.model.config.vocab_size * 4 / 2**20
        # positions the padded layouts compute (rows x the longest row of each micro-batch)
        lengths = batch.attention_mask.sum(-1)
        for name, by_length in (("padded", False), ("padded_by_length", True)):
            out[f"{name}_positions"] = sum(len(mb) * int(lengths[mb].max())
                                           for w in microbatch.windows(ROWS, MICRO * ACCUM)
                                           for mb in microbatch.micro_batches(w, lengths, MICRO, None, by_length))
        for name in ("padded_by_length", "packed", "dynamic"):
            out[f"{name}_vs_padded"] = out["padded_step_s"] / out[f"{name}_step_s"]
        # The full-logits formula (before the chunking) held one (micro x width x vocab) fp32 block, and its softmax.
        vocab = worker.model.config.vocab_size
        out["full_logits_formula_block_mb"] = MICRO * (batch.sequences.shape[1] - 1) * vocab * 4 / 2**20
    finally:
        hook.remove()
        worker.shutdown()
    return out
