"""`model.attn: tilelang` on the automodel backend: nemo-automodel's GLM-5.2 (`glm_moe_dsa`) DSA kernels, fed packed
rows in THD form (runtime/packed_thd.py). The kernels are TileLang CUDA programs and tilelang is installed on none
of our machines, so here the kernel entry points nemo-automodel's wrappers call are replaced by what they compute,
in torch, and the CUDA / bf16 gate in front of them is opened on CPU (tests/runtime/dsa_support.py). Everything
else is nemo-automodel's and Molt's own code: the plan's attention reaching the model's `BackendConfig`, the packed
row turned into THD with cu_seqlens, the indexer's per-document key windows and top-k, the absorbed latent
attention, log-probs unpacked.

A tiny GLM-5.2 (dsa_support's), computing in bf16 as FSDP2 gives it, on CPU. The reference is the same weights
under nemo-automodel's dense sdpa path (`backend.attn: sdpa`: the same top-k as an additive mask), padded rows:
log-probs and each parameter's gradient agree to bf16 precision.
"""
from __future__ import annotations

import copy

import dsa_support
import pytest
import torch

from runtime import logprobs, moe, packed_thd
from runtime.models import automodel


@pytest.fixture(scope="module")
def models():
    """(tilelang, sdpa) with the same weights, in FSDP2's compute dtype (model.param_dtype bf16): the kernels are
    bf16 only."""
    sparse, dense = dsa_support.tiny_glm("tilelang"), dsa_support.tiny_glm("sdpa")
    dense.load_state_dict(sparse.state_dict())
    return sparse.to(torch.bfloat16), dense.to(torch.bfloat16)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The TileLang kernels replaced by what they compute, and nemo-automodel's CUDA-bf16 gate opened on CPU."""
    dsa_support.use_cpu_kernels(monkeypatch.setattr)


def _rows() -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([90, 70, 75])
    ids = torch.randint(1, 96, (3, 90), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(90)[None] < lengths[:, None]
    return ids * mask, mask


def test_the_plans_tilelang_reaches_nemo_automodels_dsa_layers(models):
    sparse, dense = models
    attention = sparse.model.layers["0"].self_attn
    assert attention.backend.attn == "tilelang" and attention.indexer.backend.attn == "tilelang"
    assert attention.attn_func is None  # its sparse kernels run in forward, not a dense attention function
    assert packed_thd.takes_thd(sparse) and not packed_thd.takes_thd(dense)


def test_a_packed_row_becomes_nemo_automodels_thd_batch():
    ids, mask = _rows()
    flat, positions = logprobs.pack(ids, mask.sum(-1))
    batch = packed_thd.backbone_inputs({"input_ids": flat, "position_ids": positions,
                                        **packed_thd.thd_row(flat, positions)})
    assert batch["input_ids"].shape == (235,) and torch.equal(batch["position_ids"], positions[0])
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [0, 90, 160, 235]
    assert batch["max_seqlen"] == 90 and not batch["padding_mask"].any() and batch["qkv_format"] == "thd"


def test_packed_thd_log_probs_equal_the_dense_padded_rows(models, cpu_kernels):
    sparse, dense = models
    ids, mask = _rows()
    with torch.no_grad():
        got, _ = logprobs.token_logprobs(sparse, ids, mask, 1.0, packed=True)
        expected, _ = logprobs.token_logprobs(dense, ids, mask, 1.0)
        alone, _ = logprobs.token_logprobs(sparse, ids[1:2], mask[1:2], 1.0, packed=True)
    scored = mask[:, 1:]
    assert (got[~scored] == 0).all()
    # the kernels take latent q / kv in bf16, and so does the dense path its q / k / v: agreement to bf16's precision
    # (one document seen as the whole packed row, wrong cu_seqlens, is off by 0.24 at most and 0.035 on average)
    difference = (got - expected)[scored].abs()
    assert difference.max() < 0.05 and difference.mean() < 0.005, (difference.max(), difference.mean())
    # cu_seqlens keep the documents apart: a row packed with others scores as it does alone (to bf16 rounding)
    torch.testing.assert_close(got[1:2, :69], alone[:, :69], rtol=0, atol=0.02)


def test_packed_thd_gradients_point_as_the_dense_padded_rows(models, cpu_kernels):
    ids, mask = _rows()

    def gradients(model, packed: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        lp, _ = logprobs.token_logprobs(model, ids, mask, 1.0, packed=packed)
        (lp * mask[:, 1:]).sum().backward()  # the padded rows' log-probs past a row's end are not zero
        return {n: p.grad.float().flatten() for n, p in model.named_parameters() if p.grad is not None}

    got, expected = gradients(models[0], True), gradients(models[1], False)
    assert got.keys() == expected.keys() and len(got) == 30  # all but the indexers' (top-k carries no gradient)
    # bf16 gradients: each parameter's points the same way (cosine 0.999 at least here; wrong cu_seqlens: 0.32)
    cosine = {n: torch.nn.functional.cosine_similarity(got[n], expected[n], dim=0).item() for n in got}
    assert min(cosine.values()) > 0.995, sorted(cosine.items(), key=lambda kv: kv[1])[:3]


def test_the_critics_packed_thd_values_equal_the_dense_padded_rows(models, cpu_kernels):
    # the critic runs the whole model (nemo-automodel's forward squeezes the THD row itself) under a scalar head
    from runtime.critic import token_values

    critics = [copy.deepcopy(model) for model in models]
    head = automodel.value_head(critics[0].config).to(torch.bfloat16)
    for critic in critics:
        critic.lm_head = copy.deepcopy(head)
    ids, mask = _rows()
    with torch.no_grad():
        got = token_values(critics[0], ids, mask, packed=True)
        expected = token_values(critics[1], ids, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.01)  # values of about 0.1, in bf16


def test_routing_replay_reaches_the_thd_rows(models, cpu_kernels):
    # the rollout's routing of the padded rows, replayed on the packed THD row: nemo-automodel's routers see its
    # tokens in the packed order (`moe.flat_targets`), as on a (1, N) packed row
    sparse, dense = models
    ids, mask = _rows()
    with moe.record(dense) as captured, torch.no_grad():
        logprobs.token_logprobs(dense, ids, mask, 1.0)
    routed = torch.stack([c.to(torch.int16) for c in captured], dim=1).view(*ids.shape, len(captured), -1)
    targets = moe.flat_targets(routed, mask, packed=True)
    trained = copy.deepcopy(sparse)
    with torch.no_grad():  # its own top-k now disagrees with the rollout's
        for gate in moe.routers(trained):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(7)))
    with moe.replay(trained) as state:
        state.targets = targets
        logprobs.token_logprobs(trained, ids, mask, 1.0, packed=True)[0].sum().backward()
    assert state.known == targets.shape[0] == int(mask.sum()) and state.agreed < state.known
    for layer, chosen in enumerate(state.selected):
        assert torch.equal(chosen.sort(-1).values, targets[:, layer].long().sort(-1).values)
