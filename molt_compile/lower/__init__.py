"""Lower: a validated recipe and its derived values -> the Plan (placement, GPU map, runtime slices).

    binpack.py    a deterministic model of Ray's PACK (first-fit per node, in creation order); PLACE101-103
    placement.py  RL placement groups, roles, instances and the GPU map, in Molt's creation order; PLACE104
    rl.py         the RL plan: placement, then the runtime slice built per plan section
    sft.py        the SFT plan: one torchrun per node; PLACE105
    common.py     shared: plan records built without re-validation, paths, model/optimizer/ckpt/logging sections

What cannot be placed is a PLACE1xx diagnostic with the numbers and a fix, never a hang. `cluster.gpu: cpu` uses
the custom Ray resource `device_slot` for devices (see `schemas/plan.py`).
"""

from __future__ import annotations

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.lower.binpack import placement_unit
from molt_compile.lower.rl import lower_rl
from molt_compile.lower.sft import lower_sft
from molt_compile.source import SourceMap
from schemas.plan import Plan
from schemas.recipe import RlRecipe, SftRecipe

__all__ = ["lower", "placement_unit"]


def lower(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap | None = None
) -> tuple[Plan | None, list[Diagnostic]]:
    """The plan of a validated recipe, or None and the diagnostics that say why it cannot be placed."""
    if isinstance(recipe, SftRecipe):
        return lower_sft(recipe, derived, source)
    return lower_rl(recipe, derived, source)
