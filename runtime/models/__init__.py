"""Model backends: what builds the trained (and reference) models and their device meshes, per `ModelPlan.backend`.

A backend is one module satisfying `ModelBackend`, listed in `BACKENDS` (selected by the plan's `model.backend`).
The trainer, the reference, the critic and the SFT job build through it and know nothing else of the model's make;
the weight sync and the HF export ask it for the engine's view of the weights (names and layouts), the optimizer
step for the gradient norm over its mesh.

- `hf` (`runtime/models/hf.py`): transformers models under FSDP2 over a 1-D `dp` mesh (dense and MoE: routers in
  their own fp32 unit).
- `automodel` (`runtime/models/automodel.py`): nemo-automodel's `NeMoAutoModelForCausalLM` (a VLM:
  `NeMoAutoModelForImageTextToText`) builds the model (its own MoE layers); at `mesh.ep` 1 the same FSDP2 wrapping as `hf` shards it, at `mesh.ep` > 1 nemo-automodel's own
  device mesh and parallelizer (experts sharded over `ep`, FSDP2 over the data-parallel ranks). What it does not do
  yet is in the capability table (rows rl-automodel-*, sft-automodel-*).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.plan import ModelPlan

from runtime.models import automodel, hf
from runtime.models.base import Meshes, ModelBackend

__all__ = ["BACKENDS", "Meshes", "ModelBackend", "backend"]

BACKENDS: dict[str, ModelBackend] = {"hf": hf, "automodel": automodel}  # type: ignore[dict-item]


def backend(model_plan: ModelPlan) -> ModelBackend:
    """The backend the plan names (`ModelPlan.backend`)."""
    return BACKENDS[model_plan.backend]
