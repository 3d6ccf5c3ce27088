"""The capability pass: a plan the runtime cannot run is a compile error, never a refusal after allocation.

Runs after lowering, on the plan (what the runtime reads), against the runtime's capability table
(`schemas/capabilities.py`). Each row the plan asks for and this build does not implement on the plan's device kind
becomes one CAP001 error at the recipe key that asks for it; `compile()` then drops the plan, so no plan file,
Slurm script or submission exists for it. A row written for the device kind but not run there (CUDA, which our
test machines lack) is a CAP002 warning naming what was not run; the plan stands.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.codes import CAPABILITY, CAPABILITY_UNVERIFIED
from molt_compile.diagnostics import Diagnostic
from molt_compile.source import SourceMap
from schemas.capabilities import DEVICES, Capability, device_of, unimplemented, unverified
from schemas.plan import Plan


def check_capabilities(plan: Plan, source: SourceMap | None) -> Iterator[Diagnostic]:
    """One CAP001 error per capability row that `plan` asks for and the runtime lacks on its device kind; one
    CAP002 warning per row whose code for that device kind is written but was not run."""
    source = source if source is not None else SourceMap()
    device = device_of(plan)
    for cap in unimplemented(plan):
        yield CAPABILITY.at(
            source,
            cap.key,
            f"{cap.what} is not implemented by this runtime {_where(cap, device)}",
            f"write {cap.instead}" + (f"; tracked in {cap.tracked}" if cap.tracked else ""),
        )
    for cap in unverified(plan):
        yield CAPABILITY_UNVERIFIED.at(
            source,
            cap.key,
            f"{cap.what} is written for {device} but not run there by this project's tests: {cap.not_run}",
            f"expect a first run on {device} to be its test, or write {cap.instead}"
            + (f"; tracked in {cap.tracked}" if cap.tracked else ""),
        )


def _where(cap: Capability, device: str) -> str:
    if not cap.devices and not cap.unverified:
        return "on any device"
    if not cap.devices:
        return f"on {device} (it is written, not run, for {', '.join(sorted(cap.unverified))})"
    others = [d for d in DEVICES if d in cap.devices]
    return f"on {device} (it is on {', '.join(others)}: cluster.gpu decides the device)"
