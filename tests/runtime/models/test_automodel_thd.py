"""Packed rows with te attention on the automodel backend (runtime/packed_thd.py `thd_row`): the packed row goes to
nemo-automodel's model as THD (its `process_input_for_thd`: `qkv_format="thd"`, the documents' `cu_seqlens`,
`max_seqlen`), the batch dim squeezed as its causal LMs squeeze it (`squeeze_input_for_thd`).

transformer_engine is installed on none of our machines, so its DotProductAttention is stood in for by what it
computes on THD input (`_te_thd`: causal attention within each `cu_seqlens` document); everything else is
nemo-automodel's Qwen3-MoE (GQA, MoE layers) on CPU in fp32, its attention set to te after the build (its te
build imports transformer_engine). The log-probs, entropies and top-k log-probs of the packed THD row must equal
the padded rows' through nemo-automodel's sdpa, and so must the critic's values (`critic.token_values`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from runtime import critic, logprobs, packed_thd
from runtime.models import automodel
from runtime.tiny_model import build_tiny_model
from schemas.plan import ModelPlan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", seed=0, vocab_size=300, experts=4,
                                experts_per_token=2, tie_word_embeddings=False))


def _te_thd(q, k, v, *, qkv_format, attn_mask_type, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
            window_size, **rest):
    """transformer_engine's DotProductAttention on THD input (T, heads, dim): causal within each document."""
    assert (qkv_format, attn_mask_type, window_size, rest) == ("thd", "padding_causal", (-1, 0), {})
    assert torch.equal(cu_seqlens_q, cu_seqlens_kv) and max_seqlen_q == max_seqlen_kv
    assert max_seqlen_q == int(cu_seqlens_q.diff().max())
    out = []
    for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(out)


def _as_te(model):
    """`model` with nemo-automodel's te attention path (its THD kwargs), `_te_thd` in place of the kernel."""
    model = copy.deepcopy(model)
    model.backend = copy.copy(model.backend)
    model.backend.attn = "te"
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.backend = model.backend
            module.attn_func = _te_thd
    return model


def _load(path: str):
    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="float32", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")
    return automodel.load(plan, path, torch.device("cpu"))


def test_thd_row_is_nemo_automodels_packed_layout():
    ids = torch.tensor([[11, 12, 13, 21, 22, 31, 32, 33, 34]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    thd = packed_thd.thd_row(ids, positions)
    assert thd["qkv_format"] == "thd" and thd["attention_mask"] is None
    assert thd["cu_seqlens"].tolist() == [[0, 3, 5, 9]] and thd["max_seqlen"].tolist() == [4]
    assert not thd["padding_mask"].any() and thd["padding_mask"].shape == ids.shape
    squeezed = packed_thd.backbone_inputs({"input_ids": ids, "position_ids": positions, **thd})
    assert squeezed["input_ids"].tolist() == ids[0].tolist() and squeezed["position_ids"].shape == (9,)
    assert squeezed["cu_seqlens"].tolist() == [0, 3, 5, 9] and squeezed["max_seqlen"] == 4


def test_packed_thd_rows_equal_padded_rows(checkpoint):
    sdpa = _load(checkpoint)
    te = _as_te(sdpa)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 290, (3, 10), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2, 3:] = False
    ids = ids * mask
    top = torch.randint(0, 300, (3, 9, 2), generator=g)
    with torch.no_grad():
        want = logprobs.token_top_logprobs(sdpa, ids, mask, 0.7, top, with_entropy=True)
        got = logprobs.token_top_logprobs(te, ids, mask, 0.7, top, with_entropy=True, packed=True)
    scored = mask[:, 1:]
    for w, x in zip(want, got, strict=True):
        sel = scored if w.dim() == 2 else scored[..., None].expand_as(w)
        torch.testing.assert_close(x[sel], w[sel], rtol=1e-5, atol=1e-5)
        assert not x[~sel].any()
    # the critic's packed values go the same way (its value head on nemo-automodel's causal LM)
    head = automodel.value_head(sdpa.config)
    sdpa.lm_head = te.lm_head = head
    with torch.no_grad():
        want_v = critic.token_values(sdpa, ids, mask)
        got_v = critic.token_values(te, ids, mask, packed=True)
    torch.testing.assert_close(got_v * scored, want_v * scored, rtol=1e-5, atol=1e-5)


def test_te_under_cp_joins_transformer_engines_cp_group(checkpoint, monkeypatch):
    """`context_parallel.prepare` of a te model hands the cp mesh to nemo-automodel's `apply_cp`, which puts every
    transformer_engine attention of the built model in the cp group (a 1-rank gloo cp mesh here; te's module stood
    in for by a recorder: transformer_engine is not installed); an sdpa model's attention is left to torch's ring,
    its other layers set up as `apply_cp` sets them."""
    import os
    import sys
    import types

    import torch.distributed as dist
    from nemo_automodel.components.moe import parallelizer
    from torch.distributed.device_mesh import init_device_mesh

    from runtime import context_parallel

    class DotProductAttention:  # transformer_engine.pytorch.attention's, as a recorder
        def set_context_parallel_group(self, group, ranks, stream, cp_comm_type):
            self.cp = (group, ranks, stream, cp_comm_type)

    sdpa = _load(checkpoint)  # built before transformer_engine's stand-in exists (the build probes for it)
    te = _as_te(sdpa)
    te_attention = types.ModuleType("transformer_engine.pytorch.attention")
    te_attention.DotProductAttention = DotProductAttention  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.attention", te_attention)
    monkeypatch.setattr(parallelizer, "_get_cp_stream", lambda: "cp-stream")  # a CUDA stream on GPUs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + os.getpid() % 100))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        cp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        attentions = [m for n, m in te.named_modules() if n.endswith("self_attn")]
        for module in attentions:
            module.attn_module = DotProductAttention()
        context_parallel.prepare(te, cp_mesh)
        context_parallel.prepare(sdpa, cp_mesh)
        assert attentions and all(m.attn_module.cp == (cp_mesh.get_group(), [0], "cp-stream", "p2p")
                                  for m in attentions)
        # both get the rest of apply_cp's setup; an sdpa model's attention has no te module (torch's ring)
        assert te.cp_mesh is cp_mesh and sdpa.cp_mesh is cp_mesh
        assert all(m.attn_module is None for n, m in sdpa.named_modules() if n.endswith("self_attn"))
    finally:
        dist.destroy_process_group()
