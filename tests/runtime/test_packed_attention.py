"""The varlen attention `model.attn: flash_attention_2` runs on CUDA without the flash-attn package
(`runtime/packed_attention.py`), and the rule that a packed row never carries a 2-D attention mask.

The kernel (torch's `varlen_attn`) is CUDA-only, so here the registered attention runs over `reference_kernel`
(per-sequence causal sdpa); what is tested is everything around it: offsets from packed position ids and from
padding masks, the head layout, GQA, padding dropped and restored, and the transformers registration. The kernel
itself is checked on the H200 (`tests/gpu/check_packing.py`: log-probs and gradients against the padded layout).
"""

from __future__ import annotations

import pytest
import torch
from loop_support import ROOT
from test_trainer_packing import skewed_batch

from runtime import packed_attention
from runtime.logprobs import _decoder_logprobs, pack, token_logprobs

MODEL = str(ROOT / "recipes/data/demo_math/model")
CPU_NAME = "molt_varlen_reference"


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    packed_attention.register(CPU_NAME, packed_attention.reference_kernel)
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    varlen = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation=CPU_NAME)
    assert varlen.config._attn_implementation == CPU_NAME
    return sdpa, varlen


def _grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def test_varlen_attention_matches_padded_sdpa_packed_and_padded(models, monkeypatch):
    sdpa, varlen = models
    batch = skewed_batch()
    mask = batch.action_mask
    seqs, attn = batch.sequences, batch.attention_mask
    want, _ = token_logprobs(sdpa, seqs, attn, 0.7)
    (want * mask).sum().backward()
    want_grads = _grads(sdpa)
    offsets = packed_attention._offsets
    calls = []
    monkeypatch.setattr(packed_attention, "_offsets", lambda *a: calls.append(1) or offsets(*a))
    for packed in (False, True):
        calls.clear()
        got, _ = token_logprobs(varlen, seqs, attn, 0.7, packed=packed)
        # packed: the offsets computed once, outside the layers (their `nonzero` inside a compiled layer broke its
        # graph), reaching every layer's attention as transformers' varlen keyword arguments; padded: per layer
        assert len(calls) == (1 if packed else varlen.config.num_hidden_layers), packed
        assert ((got - want).abs() * mask).max() < 1e-5, packed
        (got * mask).sum().backward()
        for a, b in zip(_grads(varlen), want_grads, strict=True):
            assert (a - b).norm() <= 1e-5 * b.norm(), (packed, (a - b).norm() / b.norm())


def test_a_packed_row_never_carries_a_2d_mask(models):
    sdpa, varlen = models
    batch = skewed_batch()
    lengths = batch.attention_mask.sum(-1)
    flat, positions = pack(batch.sequences, lengths)
    ones = torch.ones_like(flat)
    for model in (sdpa, varlen):
        with pytest.raises(ValueError, match="never carries a 2-D attention mask"):
            _decoder_logprobs(model, flat, ones, positions, 1.0, False, 1024)
    # The attention's own guard (an all-ones mask reaches it as None, through transformers' flash mask function;
    # one with padding reaches it).
    padded = torch.cat([ones[:, :-1], torch.zeros_like(ones[:, :1])], 1)
    with pytest.raises(ValueError, match="documents would attend to each other"):
        varlen.model(input_ids=flat, attention_mask=padded, position_ids=positions, use_cache=False)
    # Why: with the all-ones mask, sdpa attends across the documents (transformers builds the per-document mask only
    # without one), so the second document's log-probs change.
    with torch.no_grad():
        right = sdpa.model(input_ids=flat, position_ids=positions, use_cache=False).last_hidden_state
        wrong = sdpa.model(input_ids=flat, attention_mask=ones, position_ids=positions,
                           use_cache=False).last_hidden_state
    first = int(lengths[0])
    assert torch.allclose(right[:, :first], wrong[:, :first], atol=1e-5)
    assert (right[:, first:] - wrong[:, first:]).abs().max() > 1e-3


def test_plan_names_map_to_transformers_names():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert packed_attention.implementation("flex", cpu) == "flex_attention"
    assert packed_attention.implementation("sdpa", cuda) == "sdpa"
    assert packed_attention.implementation("flash_attention_2", cpu) == "flash_attention_2"
    try:
        import flash_attn  # noqa: F401

        expected = "flash_attention_2"
    except ImportError:
        expected = packed_attention.NAME
    assert packed_attention.implementation("flash_attention_2", cuda) == expected


def test_packed_rows_through_compiled_layers_compile_once(monkeypatch):
    """A packed row's offsets (`cu_seq_lens_*`, `max_length_*`) are generic from the first compile: micro-batches
    with another document count or another longest document run the same graph (before, each compiled once more
    under automatic dynamic shapes: an 8.7 s step mid-run on the H200), with the eager model's numbers."""
    from torch._dynamo.testing import CompileCounter
    from transformers import AutoModelForCausalLM

    from runtime.models.hf import compile_layers

    packed_attention.register(CPU_NAME, packed_attention.reference_kernel)
    torch._dynamo.reset()
    graphs = CompileCounter()
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, options=None: compile_with(fn, backend=graphs))
    model, eager = (AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation=CPU_NAME)
                    for _ in range(2))
    compile_layers(model.model.layers, "full")
    g = torch.Generator().manual_seed(0)
    for lengths in ([40, 30, 20, 10], [41, 33, 22, 9], [42, 33, 22, 9, 7, 5], [30, 33]):
        width = max(lengths)
        ids = torch.randint(5, model.config.vocab_size, (len(lengths), width), generator=g)
        mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
        got, _ = token_logprobs(model, ids, mask, 1.0, packed=True)
        want, _ = token_logprobs(eager, ids, mask, 1.0, packed=True)
        (got * mask[:, 1:]).sum().backward()
        (want * mask[:, 1:]).sum().backward()
        assert ((got - want).abs() * mask[:, 1:]).max() < 1e-5, lengths
        for a, b in zip(_grads(model), _grads(eager), strict=True):
            assert (a - b).norm() <= 1e-5 * b.norm(), lengths
        assert graphs.frame_count == 1, (lengths, graphs.frame_count)
    torch._dynamo.reset()
