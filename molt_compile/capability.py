"""The capability pass: a plan the runtime cannot run is a compile error, never a refusal after allocation.

Runs after lowering, on the plan (what the runtime reads), against the runtime's capability table
(`schemas/capabilities.py`). Each row the plan asks for and this build does not implement on the plan's device kind
becomes one CAP001 error at the recipe key that asks for it; `compile()` then drops the plan, so no plan file,
Slurm script or submission exists for it.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.codes import CAPABILITY
from molt_compile.diagnostics import Diagnostic
from molt_compile.source import SourceMap
from schemas.capabilities import DEVICES, Capability, device_of, unimplemented
from schemas.plan import Plan


def check_capabilities(plan: Plan, source: SourceMap | None) -> Iterator[Diagnostic]:
    """One CAP001 error per capability row that `plan` asks for and the runtime lacks on its device kind."""
    source = source if source is not None else SourceMap()
    device = device_of(plan)
    for cap in unimplemented(plan):
        yield CAPABILITY.at(
            source,
            cap.key,
            f"{cap.what} is not implemented by this runtime {_where(cap, device)}",
            f"write {cap.instead}" + (f"; tracked in {cap.tracked}" if cap.tracked else ""),
        )


def _where(cap: Capability, device: str) -> str:
    if not cap.devices:
        return "on any device"
    others = [d for d in DEVICES if d in cap.devices]
    return f"on {device} (it is on {', '.join(others)}: cluster.gpu decides the device)"
