"""The `automodel` backend: nemo-automodel's `NeMoAutoModelForCausalLM` builds the model, FSDP2 shards it.

nemo-automodel (pinned in the `automodel` extra) picks its own implementation of the architecture from its model
registry: for the MoE families the compiler sends here (`model.backend: automodel` on an architecture with an
AutoModel class, Molt H9), its MoE layers (`Gate` routers, grouped experts) built with the `BackendConfig` Molt uses
for custom models (B19): torch linear layers, `torch_mm` experts, fp32 RMSNorm, no rope fusion, the plan's router
dtype as the gate precision and the plan's token dispatcher. The model then goes through the same FSDP2 wrapping as
the `hf` backend (`hf.shard`: routers their own unit in the router dtype, one unit per decoder layer, the root), over
this rank's 1-D `dp` mesh: nemo-automodel's own parallelizer is for the EP/CP/TP meshes, which the capability
table refuses until multi-GPU runs land (issue 21), and its FSDP2 path is CUDA-only.

On CPU nemo-automodel runs too, its MoE layers included (they match transformers' Qwen3-MoE logits to 3e-7 here),
once three of its CUDA assumptions are answered for the build (`_built_on_cpu`): its build reads
`torch.cuda.current_device()` for a device index, its checkpoint load goes to that device, and the rotary embedding
keeps it for buffers it makes at the first forward. `reference/environment.md` §2 documents the first.

The engines and the HF export see transformers' names and layouts (`hf_weights`, `hf_state_dict`): nemo-automodel's
grouped experts hold (experts, in, out) matrices where transformers' fused experts hold (experts, out, in), so the
two expert parameters of each MoE layer travel transposed under transformers' names; every other parameter has the
same name and layout in both (checked against transformers' model of the same checkpoint in
tests/runtime/models/test_automodel.py).

Its gates' own load-balancing loss is switched off (`aux_loss_coeff = 0`): the trainer adds the recipe's
load-balancing and z-loss itself from the gates' logits (`runtime/moe.py`), once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from runtime import moe
from runtime.models import hf

if TYPE_CHECKING:
    from schemas.plan import LoraPlan, ModelPlan

device_mesh = hf.device_mesh

# nemo-automodel's grouped-experts parameters -> transformers' fused-experts names (both (experts, ., .), transposed)
_EXPERTS = {".experts.gate_and_up_projs": ".experts.gate_up_proj", ".experts.down_projs": ".experts.down_proj"}


def hf_name(name: str) -> tuple[str, bool]:
    """(transformers' name of a nemo-automodel parameter, whether its last two dims are swapped there)."""
    for nemo, transformers_name in _EXPERTS.items():
        if name.endswith(nemo):
            return name[: -len(nemo)] + transformers_name, True
    return name, False


@dataclass
class TransposedExperts:
    """A grouped-experts parameter as transformers lays it out: (experts, out, in). FSDP2 shards the experts dim,
    so each rank's rows stay its own."""

    base: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        e, a, b = self.base.shape
        return torch.Size((e, b, a))

    def is_floating_point(self) -> bool:
        return True

    def local(self) -> torch.Tensor:
        local = self.base.to_local() if hasattr(self.base, "to_local") else self.base
        return local.detach().transpose(1, 2)


def hf_weights(model) -> list[tuple[str, torch.Tensor | TransposedExperts]]:
    """(transformers' name, parameter or transposed view) of every floating parameter, in module order: what a
    weight sync streams to the engines."""
    out: list[tuple[str, torch.Tensor | TransposedExperts]] = []
    for name, p in model.named_parameters():
        if p.is_floating_point():
            name, swapped = hf_name(name)
            out.append((name, TransposedExperts(p) if swapped else p))
    return out


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full nemo-automodel state dict under transformers' names and layouts (the HF export)."""
    out = {}
    for name, t in state.items():
        name, swapped = hf_name(name)
        out[name] = t.transpose(1, 2).contiguous() if swapped else t
    return out


@contextlib.contextmanager
def _built_on_cpu():
    """Within the block nemo-automodel builds for the CPU: `torch.cuda.current_device()` answers 0, so its device
    objects can be made (nothing is allocated on them while building), and its checkpoint load into the built model
    (`apply_model_infrastructure`) goes to the CPU."""
    import nemo_automodel._transformers.auto_model as auto_model

    current, infrastructure = torch.cuda.current_device, auto_model.apply_model_infrastructure

    def on_cpu(*args, **kwargs):
        return infrastructure(*args, **{**kwargs, "device": torch.device("cpu")})

    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    auto_model.apply_model_infrastructure = on_cpu
    try:
        yield
    finally:
        torch.cuda.current_device = current  # type: ignore[assignment]
        auto_model.apply_model_infrastructure = infrastructure


def backend_config(model_plan: ModelPlan):
    """The `BackendConfig` of nemo-automodel's own implementations (Molt B19), from the plan."""
    from nemo_automodel.components.models.common.utils import BackendConfig

    # a dense model has no dispatcher (None in the plan): nemo-automodel's default stands, unused
    dispatcher = {"dispatcher": model_plan.moe_dispatcher} if model_plan.moe_dispatcher else {}
    return BackendConfig(attn="sdpa", linear="torch", experts="torch_mm", rms_norm="torch_fp32", rope_fusion=False,
                         gate_precision=getattr(torch, model_plan.router_dtype), **dispatcher)


def load(model_plan: ModelPlan, path: str, device: torch.device):
    """`path` as nemo-automodel builds it, fp32 master weights, unsharded, on `device`."""
    from nemo_automodel import NeMoAutoModelForCausalLM

    with _built_on_cpu() if device.type == "cpu" else contextlib.nullcontext():
        model = NeMoAutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa",
                                                         use_liger_kernel=False, backend=backend_config(model_plan))
    model.to(device)
    for module in model.modules():
        if isinstance(getattr(module, "device", None), torch.device) and module.device != device:
            module.device = device  # the rotary embedding's lazily built buffers
    for gate in moe.routers(model):
        gate.aux_loss_coeff = 0.0  # the trainer adds the recipe's aux losses itself, from the logits that
        gate.use_routing_core = True  # its routing_core child receives (the same routing: runtime/moe.py)
    return model


def decoder_layers(model) -> list:
    """nemo-automodel's decoder layers (a ModuleDict in its own implementations, a ModuleList in transformers')."""
    layers = model.model.layers
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def build(model_plan: ModelPlan, path: str, mesh, device: torch.device, trainable: bool = True,
          freeze_router: bool = False, lora: LoraPlan | None = None, freeze_visual_encoder: bool = False,
          offload: str = "none"):
    """`path` built by nemo-automodel, with `model_plan`'s checkpointing, FSDP2-sharded over `mesh` (`hf.shard`:
    routers in their own unit in the router dtype, frozen with `freeze_router`, matched by type as Molt F11 does;
    `offload: full` keeps the shards on the host).
    `lora` and `freeze_visual_encoder` are hf-backend settings (the capability table keeps them off this one)."""
    model = load(model_plan, path, device)
    model = hf.shard(model, decoder_layers(model), model_plan, mesh, trainable, freeze_router, lora, offload)
    model.molt_hf_weights = lambda: hf_weights(model)  # the weight sync's and the HF export's view
    model.molt_hf_state_dict = hf_state_dict
    return model
