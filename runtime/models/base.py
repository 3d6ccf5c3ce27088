"""The backend interface (`ModelBackend`) and the meshes a backend makes (`Meshes`): a module of its own so that the
backends import it without importing `runtime.models`, which lists them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from schemas.plan import LoraPlan, MeshPlan, ModelPlan


@dataclass(frozen=True)
class Meshes:
    """A model group's device meshes, as its backend made them from the plan's mesh.

    `fsdp`: the mesh the FSDP2 units shard over (the `hf` backend's 1-D `dp`, or HSDP's 2-D (dp_replicate,
    dp_shard); nemo-automodel's 5-D world mesh (pp, dp_replicate, dp_shard, cp, tp) under expert parallelism);
    `moe`: nemo-automodel's (ep_shard, ep) mesh of the experts, None without expert parallelism. How many
    data-parallel ranks split each batch is the plan's number (its role's `dp`), not the meshes'."""

    fsdp: DeviceMesh
    moe: DeviceMesh | None
    cp: DeviceMesh | None = None
    """nemo-automodel's 1-D context-parallel axis, None at cp 1 (`runtime/context_parallel.py`): the batch splits
    over dp / cp data-parallel ranks (the plan's `dp`), each split again over its cp ranks' sequences."""
    tp: DeviceMesh | None = None
    """nemo-automodel's 1-D tensor-parallel axis, None at tp 1: its ranks (consecutive, inside dp) run the same
    rows (`runtime/models/automodel.py` `tensor_parallel`)."""


class ModelBackend(Protocol):
    """What every backend module provides (`hf`, `automodel`)."""

    def device_mesh(self, device: str, world: int, mesh: MeshPlan | None) -> Meshes:
        """The group's meshes for the plan's `mesh` (None: a group the plan gives no mesh, the reference and the
        critic: data parallelism over every rank). The process group must be initialised."""
        ...

    def build(self, model_plan: ModelPlan, path: str, meshes: Meshes, device: torch.device, trainable: bool = True,
              freeze_router: bool = False, lora: LoraPlan | None = None,
              freeze_visual_encoder: bool = False, offload: str = "none",
              sequence_parallel: bool = False) -> torch.nn.Module:
        """`path` as this backend builds it, sharded over `meshes` (frozen and in eval mode unless `trainable`;
        `offload: full` keeps the shards on the host; `sequence_parallel`: with tensor parallelism, its plan's
        sequence-parallel styles)."""
        ...

    def build_value_model(self, model_plan: ModelPlan, path: str, meshes: Meshes,
                          device: torch.device, offload: str = "none") -> torch.nn.Module:
        """The critic: `path`'s architecture with a scalar head, sharded and offloaded like the policy."""
        ...

    def hf_weights(self, model: torch.nn.Module) -> list[tuple[str, Any]]:
        """(engine name, local parameter or view with `.local()`/`.base`) of every floating weight, in the order a
        weight sync and the HF export stream them: transformers' names and layouts, as the engines load them."""
        ...

    def hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full state dict of the model under transformers' names and layouts (`hf_weights`' names, for a
        whole state dict at hand)."""
        ...
