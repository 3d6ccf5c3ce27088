"""The compiler's passes, in order. Each is a pure function in its own module.

    load      (load.py)      YAML -> plain data + SourceMap; `extends` and `--set` resolved with provenance
    validate  (validate.py)  pydantic Recipe v1; schema errors become positioned diagnostics (blockers)
    derive    (derive.py)    every derived number with its inputs and a one-line reason
    rules     (rules/)       the catalog: every illegal combination, as diagnostics
    lower     (lower.py)     the Plan: placement groups, actors, GPU map, fingerprint

Load and validate errors are blockers (exit 2): nothing after them can run. Rule errors (exit 1) still let
`explain` show the derived values, but no plan is produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.diagnostics import Diagnostic, Diagnostics
from molt_compile.source import SourceMap


@dataclass
class CompileResult:
    recipe: Any = None          # schemas.recipe.RlRecipe | SftRecipe
    source: SourceMap | None = None
    derived: Any = None         # molt_compile.derive.Derived
    plan: Any = None            # schemas.plan.Plan
    diagnostics: list[Diagnostic] = field(default_factory=list)
    exit_status: int = 0
