"""The receiving end of the weight sync inside every vLLM worker, plugged into vLLM's own weight-transfer API.

vLLM (0.32, CPU and CUDA builds) drives a refit as `init_weight_transfer_engine` once, then per sync
`start_weight_update` / `update_weights` / `finish_weight_update`, each a `collective_rpc` to every worker, which
hands it to the worker's `WeightTransferEngine` (chosen by `weight_transfer_config.backend`). Its built-in `nccl`
backend needs CUDA (PyNccl) and its own trainer-side packing; `MoltBroadcastEngine` is registered next to it and
speaks `runtime.weight_sync`'s stream instead (gloo on CPU, NCCL on GPUs), so the trainer needs no vLLM.

Loading follows vLLM's layer-wise reload (what its own nccl backend does): `start_weight_update` moves every layer's
weights to meta, each bucket is fed to `model.load_weights` as it arrives, and a layer is materialised and
post-processed (the CPU backend's weight repacking included) once all its elements have arrived.

Why the demo logged `RotaryEmbedding: Failed to load weights` on every sync: the layer-wise reload counts every
parameter *and buffer* of a layer as loadable, and RotaryEmbedding owns one computed, non-persistent buffer
(`cos_sin_cache`) that no checkpoint carries. Nothing loads into it, so `finalize_layerwise_reload` warns and puts
the old cache back (which is correct: it depends on the config only). `_ignore_computed_buffers` marks such layers
as having nothing to load, which takes the same put-back path without the warning.

The same extension captures MoE routing for R3 where vLLM cannot return it (`vllm_routing`).

Importing it also lets a Qwen-VL processor load without torchvision in that process (`runtime.no_torchvision`).

Kept free of Ray: vLLM imports this module inside its own worker processes (`worker_extension_cls`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from runtime import no_torchvision, weight_sync
from runtime.engines.vllm_routing import RoutingCaptureExtension

BACKEND = "molt_broadcast"

no_torchvision.allow()


@dataclass
class MoltBroadcastUpdateInfo(WeightTransferUpdateInfo):
    version: int


class MoltBroadcastEngine(WeightTransferEngine[weight_sync.JoinMessage, MoltBroadcastUpdateInfo]):
    init_info_cls = weight_sync.JoinMessage  # the driver's join message (vLLM rebuilds it from its dict)
    update_info_cls = MoltBroadcastUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.info: weight_sync.JoinMessage | None = None
        self.metas: list[weight_sync.TensorMeta] = []
        self.last_stats: dict[str, Any] = {}
        self.assigned: set[str] = set()

    def init_transfer_engine(self, init_info: weight_sync.JoinMessage) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.info = init_info
        self.metas = init_info.tensor_metas()
        self.group = weight_sync.join_group(init_info.method, init_info.master_address, init_info.master_port,
                                            rank, init_info.world_size, init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        _ignore_computed_buffers(self.model)

    def receive_weights(self, update_info: MoltBroadcastUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.group is None or self.info is None:
            raise RuntimeError("weight sync: update_weights before init_weight_transfer_engine")
        self.assigned = set()
        self.fused_parts: dict[str, set[str]] = {}
        packed = [(f".{sub}.", f".{fused}.", sub) for fused, subs in
                  (getattr(self.model, "packed_modules_mapping", None) or {}).items() for sub in subs]

        def load(pairs):  # vLLM's load_weights returns the (vLLM-named, fused) parameters it assigned
            loaded = self.model.load_weights(pairs)
            if self.info.check_unassigned:
                self.assigned |= set(loaded or ())
                for name, _ in pairs:  # which parts of a fused parameter (q/k/v of qkv_proj) arrived
                    for sub, fused, part in packed:
                        if sub in name:
                            self.fused_parts.setdefault(name.replace(sub, fused), set()).add(part)

        with disable_mtp_completeness_check():
            stats = weight_sync.receive(self.group, self.metas, self.info.bucket_bytes, self.device, load,
                                        self.info.aliases)
        self.last_stats = {**stats.as_dict(), "version": float(update_info.version)}

    def finish_weight_update(self) -> None:
        import time

        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        _prepack_cpu_experts(self.model)
        self.last_stats["load_s"] = self.last_stats.get("load_s", 0.0) + time.perf_counter() - t0
        if self.info is not None and self.info.check_unassigned:
            # what vLLM's own loader checks after a load from disk ("weights not initialized from checkpoint"),
            # plus fused parameters only some of whose parts arrived (load_weights names them as assigned)
            params = {n for n, _ in self.model.named_parameters()}
            mapping = getattr(self.model, "packed_modules_mapping", None) or {}
            partial = {name for name, parts in self.fused_parts.items() if name in params
                       and parts != set(mapping.get(name.rsplit(".", 2)[-2], parts))}
            self.last_stats["unassigned"] = sorted((params - self.assigned) | partial)

    def shutdown(self) -> None:
        self.group = None


def _ignore_computed_buffers(model: torch.nn.Module) -> None:
    """Layers whose only tensors are non-persistent buffers (RotaryEmbedding's cos/sin cache) load nothing."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if (info.can_load() and not any(True for _ in layer.parameters(recurse=False))
                and info.kernel_tensors is not None
                and set(info.kernel_tensors[1]) <= info.kernel_non_persistent_buffers):
            info.load_numel_total = 0


def _prepack_cpu_experts(model: torch.nn.Module) -> None:
    """vLLM 0.32's CPU MoE experts keep their weights prepacked for their grouped GEMM, a step of the experts'
    `process_weights_after_loading` that an unquantized MoE layer runs only when its kernel is first built
    (`UnquantizedFusedMoEMethod._setup_kernel`), not on a weight update: after a reload the kernel read the weights
    unpacked (every logprob off by ~0.1 on the tiny MoE, measured). Prepack the reloaded weights in place, as that
    step does; its zero-padding of the intermediate size is not redone (checked only on sizes that need none)."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
            continue
        experts = method.moe_kernel.fused_experts
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            for weight in (layer.w13_weight, layer.w2_weight):
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


if BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(BACKEND, MoltBroadcastEngine)


class WeightSyncExtension(RoutingCaptureExtension):
    """Mixed into every vLLM worker (`worker_extension_cls`); importing it registers the backend above. It also
    carries the routing capture of R3 on engines without vLLM's own (`vllm_routing`)."""

    def molt_weight_sync_stats(self) -> dict[str, Any]:
        """The last sync's receive-side numbers on this worker (transfer, load seconds, bytes; with the check, the
        names of the parameters the sync did not assign under `unassigned`)."""
        return dict(self.weight_transfer_engine.last_stats)
