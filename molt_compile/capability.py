"""The capability pass: a plan the runtime cannot run is a compile error, never a refusal after allocation.

Runs after lowering, on the plan (what the runtime reads), against the runtime's capability table
(`schemas/capabilities.py`). Each row the plan asks for and this build does not implement on the plan's device kind
becomes one CAP001 error at the recipe key that asks for it; `compile()` then drops the plan, so no plan file,
Slurm script or submission exists for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.capabilities import DEVICES, Capability, device_of, unimplemented
from schemas.plan import Plan

CODE = "CAP001"
NAME = "not-implemented-by-runtime"


def check_capabilities(plan: Plan, source: SourceMap | None) -> Iterator[Diagnostic]:
    """One CAP001 error per capability row that `plan` asks for and the runtime lacks on its device kind."""
    source = source if source is not None else SourceMap()
    device = device_of(plan)
    for cap in unimplemented(plan):
        d = diag(CODE, source, cap.key, f"{cap.what} is not implemented by this runtime {_where(cap, device)}",
                 f"write {cap.instead}" + (f"; tracked in {cap.tracked}" if cap.tracked else ""))
        yield replace(d, name=NAME)


def _where(cap: Capability, device: str) -> str:
    if not cap.devices:
        return "on any device"
    others = [d for d in DEVICES if d in cap.devices]
    return f"on {device} (it is on {', '.join(others)}: cluster.gpu decides the device)"


DOC = """## What it checks
A setting that this build of the runtime does not implement on the recipe's device kind (`cluster.gpu: cpu` runs
on CPUs, any GPU type on CUDA). The settings are the rows of the runtime's capability table,
`schemas/capabilities.py`; `molt-compile rules CAP001` lists them. The check runs on the lowered plan, after every
other rule, so it fires only for recipes that are otherwise valid.

## Why it matters
Molt supports these settings, so the other rules accept them; but a plan that asks for one would start, take its
allocation and Ray cluster, and then fail or silently train something else. The compiler says so before any GPU
is allocated, at the line that asks.

## Example
```yaml
actor: {packing: true}
```

## Use instead
What the row's `instead` says, here `actor.packing: false` — or a build of the runtime that implements it.

## References
schemas/capabilities.py; DESIGN.md §6 (capability table)
"""


def table_markdown() -> str:
    """The capability table as Markdown rows (for `molt-compile rules CAP001` and REFERENCE.md)."""
    from schemas.capabilities import CAPABILITIES

    rows = ["| id | kind | recipe key | what | implemented on | write instead |", "|---|---|---|---|---|---|"]
    rows += [f"| {c.id} | {c.kind} | `{c.key}` | {c.what} | {', '.join(sorted(c.devices)) or 'none'} | {c.instead} |"
             for c in CAPABILITIES]
    return "\n".join(rows)
