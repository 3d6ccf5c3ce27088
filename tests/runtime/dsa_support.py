"""A tiny GLM-5.2 (nemo-automodel's `glm_moe_dsa`) and its TileLang DSA kernels on CPU, for the tilelang tests
(tests/runtime/models/test_automodel_dsa.py, and its context parallelism in tests/runtime/test_context_parallel.py).

The kernels are TileLang CUDA programs and tilelang is installed on none of our machines, so the kernel entry points
nemo-automodel's wrappers call (`indexer_fwd_interface`: the lighting indexer's logits; `sparse_mla_fwd_interface`
and `sparse_mla_bwd`: sparse MLA over the selected keys and its gradients) are replaced by what they compute, in
torch, and the CUDA / bf16 gate in front of them is opened on CPU (`use_cpu_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from runtime import moe
from runtime.models import automodel
from schemas.plan import ModelPlan

TOPK = 64  # the sparse-MLA kernel takes top-k in blocks of 64


def model_plan(attn: str) -> ModelPlan:
    return ModelPlan(path="unused", arch="glm-5.2", backend="automodel", dtype="float32", attn=attn,
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")


def tiny_glm(attn: str):
    """GLM-5.2 (2 layers, MoE in the second, the kernels' own latent width 512 + rope 64, top-k 64 keys so that rows
    of up to 90 tokens are really sparse) with `attn` as its `BackendConfig.attn`, fp32, in eval mode."""
    from nemo_automodel.components.models.glm_moe_dsa.model import GlmMoeDsaForCausalLM
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    config = GlmMoeDsaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
        v_head_dim=16, index_n_heads=2, index_head_dim=128, index_topk=TOPK, first_k_dense_replace=1,
        max_position_embeddings=128, dtype="float32")
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(config, backend=automodel.backend_config(model_plan(attn)))
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():  # attention that matters: nemo-automodel's init (std 0.02) leaves it near uniform
        for name, weight in model.named_parameters():
            if ".self_attn." in name and weight.dim() == 2:
                weight.mul_(2.0)
    for gate in moe.routers(model):  # as the automodel backend loads them (runtime/models/automodel.py `load`)
        gate.aux_loss_coeff, gate.use_routing_core = 0.0, True
    return model.eval()


def indexer_logits(q, kv, weights, starts, ends, clean_logits=True):
    """The lighting indexer's logits: sum over heads of relu(q . k) x the head's weight, -inf outside each query's
    key window [start, end)."""
    logits = torch.einsum("thd,sd->tsh", q.float(), kv.float()).relu().mul(weights.float()[:, None]).sum(-1)
    keys = torch.arange(kv.shape[0])
    outside = (keys[None] < starts[:, None]) | (keys[None] >= ends[:, None])
    return logits.masked_fill(outside, float("-inf"))


def sparse_mla_forward(q, kv, indices, sm_scale=None, d_v=512, **_):
    """Sparse MLA: each query attends to its selected latent keys (-1: none), values are their first d_v dims; the
    output in bf16 as the kernel gives it, and the log-sum-exp."""
    assert q.shape[-1] == 576 and kv.shape[-1] == 576 and indices.shape[-1] % 64 == 0  # the kernel's contract
    keys = kv[:, 0].float()
    valid = indices[:, 0] >= 0
    scores = torch.einsum("thd,tkd->thk", q.float(), keys[indices[:, 0].clamp(min=0)]) * sm_scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    out = torch.einsum("thk,tkd->thd", scores.softmax(-1), keys[indices[:, 0].clamp(min=0)][..., :d_v])
    return out.to(torch.bfloat16), scores.logsumexp(-1)


def sparse_mla_backward(q, kv, out, grad_out, indices, lse, sm_scale=None, **_):
    """The sparse-MLA kernel's backward: the gradients of `sparse_mla_forward` (the indexer's top-k carries none)."""
    with torch.enable_grad():
        q, kv = q.detach().requires_grad_(), kv.detach().requires_grad_()
        return torch.autograd.grad(sparse_mla_forward(q, kv, indices, sm_scale)[0], (q, kv), grad_out)


def cpu_gate(backend, *, available, kernel_name, tensors, require_bf16=False) -> bool:
    """nemo-automodel's `should_use_tilelang` without its CUDA bf16 tensor requirement."""
    assert available, kernel_name
    return backend == "tilelang"


def use_cpu_kernels(setattr_: Callable = setattr) -> None:
    """The TileLang kernels replaced by what they compute, and nemo-automodel's CUDA-bf16 gate opened on CPU, each
    set by `setattr_` (pytest's `monkeypatch.setattr` to undo them after a test)."""
    from nemo_automodel.components.models.glm_moe_dsa import layers, optimized_kernels
    from nemo_automodel.components.models.glm_moe_dsa.kernels import indexer, sparse_mla

    setattr_(indexer, "indexer_fwd_interface", indexer_logits)
    setattr_(sparse_mla, "sparse_mla_fwd_interface", sparse_mla_forward)
    setattr_(sparse_mla, "sparse_mla_bwd", sparse_mla_backward)
    setattr_(optimized_kernels, "HAS_TILELANG", True)
    setattr_(layers, "should_use_tilelang", cpu_gate)
