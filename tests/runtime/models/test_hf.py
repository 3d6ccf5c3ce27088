"""The hf backend's activation checkpointing modes: same gradients, different recomputation (runtime/models/hf.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.models.hf import compile_layers, enable_checkpointing

MODEL = Path(__file__).resolve().parents[3] / "recipes/data/demo_math/model"


class _CountMatmuls(TorchDispatchMode):
    """How many matmuls and RMSNorm rsqrts run while active (the backward's own plus any recomputed forward's)."""

    def __init__(self):
        super().__init__()
        self.matmuls = self.rsqrts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.matmuls += 1
        self.rsqrts += func is torch.ops.aten.rsqrt.default
        return func(*args, **(kwargs or {}))


def _grads_and_backward_counts(mode: str, compiled: bool = False) -> tuple[dict[str, torch.Tensor], _CountMatmuls]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    if mode != "none" and not compiled:
        enable_checkpointing(model, mode)
    if compiled:  # the runtime's order: the checkpoint inside the compiled layer (runtime/models/hf.py `shard`)
        compile_layers(model.model.layers, mode)
    ids = torch.randint(5, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    counter = _CountMatmuls()
    with counter if not compiled else contextlib.nullcontext():  # a compiled backward runs HOPs it cannot see
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, counter


@pytest.fixture(scope="module")
def runs():
    return {mode: _grads_and_backward_counts(mode) for mode in ("none", "full", "selective")}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_leaves_gradients_unchanged(runs, mode):
    plain, _ = runs["none"]
    grads, _ = runs[mode]
    assert grads.keys() == plain.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_selective_recomputes_norms_but_no_matmul_full_recomputes_both(runs):
    layers = 2  # the demo model's decoder layers
    plain, full, selective = (runs[m][1] for m in ("none", "full", "selective"))
    assert selective.matmuls == plain.matmuls  # every projection and MLP matmul was kept from the forward
    # q, k, v, o, gate and up ran again (down's output feeds no backward, so the recompute stops before it)
    assert full.matmuls >= plain.matmuls + 6 * layers
    assert plain.rsqrts == 0
    assert selective.rsqrts >= 4 * layers and full.rsqrts >= 4 * layers  # the layer and q/k norms were recomputed


@pytest.mark.slow  # inductor compiles the layer once per mode (~30 s each on two cores): the layers share one graph
@pytest.mark.parametrize("mode", ["none", "full"])
def test_compiled_layers_leave_gradients_unchanged(runs, mode):
    """Compiled layers, unchecked and checkpointed: the checkpointed ones fail torch's recompute check (pytorch issue
    166926) when an eager checkpoint re-enters a compiled forward instead."""
    plain, _ = runs["none"]
    grads, _ = _grads_and_backward_counts(mode, compiled=True)
    assert grads.keys() == plain.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # one inductor compile (~10-40 s on two cores)
def test_compiled_layers_compile_once_for_every_batch_shape():
    """Batches of other lengths and row counts run the first graph: no recompile in the middle of a run (torch's
    automatic dynamic shapes alone compile three graphs for these shapes), and the log-probs are the eager ones."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    counters.clear()
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    eager = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    compile_layers(model.model.layers, "full")
    g = torch.Generator().manual_seed(2)
    for rows, length in [(2, 30), (2, 47), (3, 61), (4, 20)]:
        ids = torch.randint(5, model.config.vocab_size, (rows, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -3:] = 0  # a right-padded row: the 4-D mask has the sequence in two dimensions
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logits.sum().backward()
        with torch.no_grad():
            expected = eager(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(logits.detach(), expected, rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1  # the forward; its backward is part of the same graph
