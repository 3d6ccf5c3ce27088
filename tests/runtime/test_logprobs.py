"""runtime/logprobs.py: the chunked lm_head log-probs."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from runtime import logprobs


def test_the_compiled_chunk_keeps_one_graph_over_every_batch_length(monkeypatch):
    """On GPUs the chunk is compiled with static shapes and the last chunk padded to the chunk size: batches of any
    length (a short one arriving mid-run) reuse the graph of each grad mode, and the padding changes no number."""
    torch._dynamo.reset()
    graphs = CompileCounter()
    monkeypatch.setattr(logprobs, "_compiles", lambda hidden: True)
    monkeypatch.setattr(logprobs, "_compiled_chunk", lambda: torch.compile(logprobs._chunk, backend=graphs,
                                                                           dynamic=False))
    torch.manual_seed(0)
    head = torch.nn.Linear(12, 40, bias=False)
    for n in (70, 33, 5, 64, 1):
        hidden = torch.randn(n, 12, requires_grad=True)
        targets = torch.randint(0, 40, (n,))
        top = torch.randint(0, 40, (n, 3))
        with torch.no_grad():  # the old-log-prob pass: states from a no-grad forward
            old, _, _ = logprobs.head_logprobs(head, hidden.detach(), targets, 0.7, False, chunk_tokens=16)
        lp, ent, top_lp = logprobs.head_logprobs(head, hidden, targets, 0.7, True, chunk_tokens=16, top_ids=top)
        (lp.sum() + ent.sum() + top_lp.sum()).backward()
        grad, hidden.grad = hidden.grad, None
        head.zero_grad()

        want = logprobs._chunk(head, hidden, targets, 0.7, True, top)  # eager, unchunked, unpadded
        (want[0].sum() + want[1].sum() + want[2].sum()).backward()
        assert lp.shape == (n,) and top_lp.shape == (n, 3)
        torch.testing.assert_close(old, want[0].detach(), rtol=1e-6, atol=1e-6)
        for got, ref in zip((lp, ent, top_lp, grad), (*want, hidden.grad), strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        head.zero_grad()
    # no-grad without entropy, and grad with entropy and top ids: one graph each, whatever the lengths
    assert graphs.frame_count == 2


def test_padded_rows_reach_a_causal_decoder_without_their_mask(monkeypatch):
    """Right-padded rows of a dense text decoder run without their key-padding mask: the same log-probs at every
    position that scores a real token as the masked forward, and compiled layers keep one graph for micro-batches
    with and without padding (with the mask, transformers drops an all-ones one and the layers compiled again)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from runtime.models.hf import compile_layers

    recipes = Path(__file__).resolve().parents[2] / "recipes/data"
    torch._dynamo.reset()
    graphs = CompileCounter()
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, options=None: compile_with(fn, backend=graphs))
    model, eager = (AutoModelForCausalLM.from_pretrained(recipes / "demo_math/model", dtype=torch.float32,
                                                         attn_implementation="sdpa") for _ in range(2))
    compile_layers(model.model.layers, "full")
    g = torch.Generator().manual_seed(3)
    for rows, width, pads in [(3, 40, (5, 0, 12)), (2, 24, (0, 0)), (2, 32, (0, 9))]:
        ids = torch.randint(5, model.config.vocab_size, (rows, width), generator=g)
        mask = torch.ones(rows, width, dtype=torch.bool)
        for r, p in enumerate(pads):
            mask[r, width - p:] = False
        lp, _ = logprobs.token_logprobs(model, ids, mask, 0.7)
        lp.sum().backward()
        with torch.no_grad():  # the masked forward
            want, _, _ = logprobs._decoder_logprobs(eager, ids, mask.long(), None, 0.7, False, 1024)
        scored = mask[:, 1:]
        torch.testing.assert_close(lp.detach()[scored], want.view(rows, width - 1)[scored], rtol=1e-5, atol=1e-6)
    assert graphs.frame_count == 1

    moe_model = AutoModelForCausalLM.from_pretrained(recipes / "demo_moe/model", dtype=torch.float32)
    assert logprobs.key_padding_mask(moe_model, mask, None) is not None  # routers take it as their token mask
    assert logprobs.key_padding_mask(model, mask, {"pixel_values": ids}) is not None  # M-RoPE reads it
