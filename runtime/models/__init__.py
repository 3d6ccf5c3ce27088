"""Model backends: what builds the trained (and reference) models and their device mesh, per `ModelPlan.backend`.

Each backend module has `device_mesh(device, world)` and `build(model_plan, path, mesh, device, trainable=True,
freeze_router=False)`; the trainer and the SFT job call only these two and know nothing else of the model's make.

- `hf` (`runtime/models/hf.py`): transformers models under FSDP2 (dense and MoE: routers in their own fp32 unit).
- `automodel` (`runtime/models/automodel.py`): nemo-automodel's `NeMoAutoModelForCausalLM` builds the model (its own
  MoE layers) and the same FSDP2 wrapping shards it; what it does not do yet is in the capability table
  (rows rl-automodel-*, and sft-automodel for SFT).
"""

from __future__ import annotations

import importlib
from types import ModuleType


def backend(name: str) -> ModuleType:
    """The backend module named by the plan (`ModelPlan.backend`)."""
    return importlib.import_module(f"runtime.models.{name}")
