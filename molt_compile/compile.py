"""The compiler's passes, in order. Each is a pure function in its own module.

    load      (load.py)      YAML -> plain data + SourceMap; `extends` and `--set` resolved with provenance
    validate  (validate.py)  pydantic Recipe v1; schema errors become positioned diagnostics, their keys dropped
    derive    (derive/)      every derived number with its inputs and a one-line reason
    rules     (rules/)       the catalog: every illegal combination, as diagnostics
    lower     (lower/)       the Plan: placement groups, actors, GPU map, fingerprint
    capability (capability.py) the plan against what this runtime implements on its device (CAP001)

Load errors are blockers (exit 2): nothing after them can run. Schema errors are recipe errors (exit 1): validate
drops the offending keys and the derive and rules passes run on the rest, so that one round reports every mistake
(a rule finding on a dropped key is left out: it would judge the default, not what was written). Any error means
no plan is produced; `explain` still shows the derived values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.capability import check_capabilities
from molt_compile.codes import BUILTIN
from molt_compile.derive import derive
from molt_compile.diagnostics import Diagnostic, Diagnostics
from molt_compile.load import Loaded, load_recipe
from molt_compile.lower import lower as lower_plan
from molt_compile.rules import run_rules
from molt_compile.source import Pos, SourceMap
from molt_compile.validate import validate


@dataclass
class CompileResult:
    recipe: Any = None  # schemas.recipe.RlRecipe | SftRecipe
    source: SourceMap | None = None
    derived: Any = None  # molt_compile.derive.Derived
    plan: Any = None  # schemas.plan.Plan
    diagnostics: list[Diagnostic] = field(default_factory=list)
    exit_status: int = 0
    loaded: Loaded | None = None
    """The loader's output: key positions, overridden values, files read (for `explain` and `lint`)."""


def _internal_error(pass_name: str, error: Exception, root_file: str | None) -> Diagnostic:
    """A crash of a later pass as a diagnostic, so that the user sees what broke instead of a traceback."""
    import os
    import traceback

    if os.environ.get("MOLT_COMPILE_DEBUG"):
        raise error
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    return BUILTIN["INTERNAL001"].diagnostic(
        f"the {pass_name} pass failed: {type(error).__name__}: {error}{where}",
        pos=Pos(root_file, None, None),
        help="a bug in molt-compile, not in the recipe; MOLT_COMPILE_DEBUG=1 shows the traceback",
    )


def compile_recipe(
    path: Path | str,
    sets: Sequence[str] = (),
    *,
    lower: bool = True,
    capabilities: bool = True,
    roots: Sequence[Path | str] = (),
) -> CompileResult:
    """Run the passes in order; stop after a blocker (load) or a schema error that leaves no recipe, and skip
    lowering after any error.

    `capabilities=False` skips the capability pass: the plan of a recipe this runtime cannot run (golden plans of
    the launch recipes, lowering tests). Everything a user runs keeps it on. `roots`: extra recipe roots that
    `extends` may read from (see `load.recipe_roots`)."""
    loaded = load_recipe(Path(path), sets, roots)
    diags = Diagnostics()
    diags.extend(loaded.diagnostics)
    result = CompileResult(source=loaded.source, loaded=loaded)
    if loaded.ok:
        recipe, schema_diags = validate(loaded)
        diags.extend(schema_diags)
        result.recipe = recipe
    if result.recipe is None:
        return _finish(result, diags)
    root = loaded.source.root_file
    try:
        result.derived = derive(result.recipe, loaded.source)
    except Exception as e:  # reported as INTERNAL001, see _internal_error
        diags.add(_internal_error("derive", e, root))
        return _finish(result, diags)
    dropped = tuple(d.path for d in diags.items if d.code.startswith("SCHEMA") and d.path)
    try:
        diags.extend(
            d
            for d in run_rules(result.recipe, result.derived, loaded.source)
            if not any(d.path == p or d.path.startswith(p + ".") for p in dropped)
        )
    except Exception as e:
        diags.add(_internal_error("rules", e, root))
    if not lower or diags.has_errors:
        return _finish(result, diags)
    try:
        plan, lower_diags = lower_plan(result.recipe, result.derived, loaded.source)
    except Exception as e:
        plan, lower_diags = None, [_internal_error("lower", e, root)]
    diags.extend(lower_diags)
    if plan is not None and capabilities and not diags.has_errors:
        diags.extend(check_capabilities(plan, loaded.source))
    result.plan = None if diags.has_errors else plan
    return _finish(result, diags)


def _finish(result: CompileResult, diags: Diagnostics) -> CompileResult:
    result.diagnostics = diags.sorted()
    result.exit_status = diags.exit_status()
    return result
