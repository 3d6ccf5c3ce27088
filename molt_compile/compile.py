"""The compiler's passes, in order. Each is a pure function in its own module.

    load      (load.py)      YAML -> plain data + SourceMap; `extends` and `--set` resolved with provenance
    validate  (validate.py)  pydantic Recipe v1; schema errors become positioned diagnostics (blockers)
    derive    (derive.py)    every derived number with its inputs and a one-line reason
    rules     (rules/)       the catalog: every illegal combination, as diagnostics
    lower     (lower.py)     the Plan: placement groups, actors, GPU map, fingerprint
    capability (capability.py) the plan against what this runtime implements on its device (CAP001)

Load and validate errors are blockers (exit 2): nothing after them can run. Rule errors (exit 1) still let
`explain` show the derived values, but no plan is produced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.diagnostics import Diagnostic, Diagnostics
from molt_compile.load import Loaded, load_recipe
from molt_compile.source import SourceMap
from molt_compile.validate import validate


@dataclass
class CompileResult:
    recipe: Any = None          # schemas.recipe.RlRecipe | SftRecipe
    source: SourceMap | None = None
    derived: Any = None         # molt_compile.derive.Derived
    plan: Any = None            # schemas.plan.Plan
    diagnostics: list[Diagnostic] = field(default_factory=list)
    exit_status: int = 0
    loaded: Loaded | None = None
    """The loader's output: key positions, overridden values, files read (for `explain` and `lint`)."""
    skipped_passes: tuple[str, ...] = ()
    """Passes whose module is not importable in this build (they are written in parallel); they did not run."""


def _optional_pass(module: str, attr: str) -> Callable[..., Any] | None:
    """A later pass's entry point, or None while its module does not exist yet."""
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            return None
        raise
    except AttributeError:
        return None


def _internal_error(pass_name: str, error: Exception, root_file: str | None) -> Diagnostic:
    """A crash of a later pass as a diagnostic, so that the user sees what broke instead of a traceback."""
    import os
    import traceback

    if os.environ.get("MOLT_COMPILE_DEBUG"):
        raise error
    frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    return Diagnostic(code="INTERNAL001", severity="error", name="internal-error", blocker=True, file=root_file,
                      message=f"the {pass_name} pass failed: {type(error).__name__}: {error}{where}",
                      help="a bug in molt-compile, not in the recipe; MOLT_COMPILE_DEBUG=1 shows the traceback")


def compile_recipe(path: Path | str, sets: Sequence[str] = (), *, lower: bool = True,
                   capabilities: bool = True) -> CompileResult:
    """Run the passes in order; stop after a blocker (load, validate) and skip lowering after any error.

    `capabilities=False` skips the capability pass: the plan of a recipe this runtime cannot run (golden plans of
    the launch recipes, lowering tests). Everything a user runs keeps it on."""
    loaded = load_recipe(Path(path), sets)
    diags = Diagnostics()
    diags.extend(loaded.diagnostics)
    result = CompileResult(source=loaded.source, loaded=loaded)
    skipped: list[str] = []
    if loaded.ok:
        recipe, schema_diags = validate(loaded)
        diags.extend(schema_diags)
        result.recipe = recipe
    if result.recipe is not None:
        derive = _optional_pass("molt_compile.derive", "derive")
        run_rules = _optional_pass("molt_compile.rules", "run_rules")
        lower_fn = _optional_pass("molt_compile.lower", "lower")
        root = loaded.source.root_file
        if derive is None:
            skipped.append("derive")
        else:
            try:
                result.derived = derive(result.recipe, loaded.source)
            except Exception as e:  # noqa: BLE001 - reported as INTERNAL001, see _internal_error
                diags.add(_internal_error("derive", e, root))
        if run_rules is None or result.derived is None:
            skipped.append("rules")
        else:
            try:
                diags.extend(run_rules(result.recipe, result.derived, loaded.source))
            except Exception as e:  # noqa: BLE001
                diags.add(_internal_error("rules", e, root))
        if lower:
            if lower_fn is None or result.derived is None:
                skipped.append("lower")
            elif not diags.has_errors:
                try:
                    plan, lower_diags = lower_fn(result.recipe, result.derived, loaded.source)
                except Exception as e:  # noqa: BLE001
                    plan, lower_diags = None, [_internal_error("lower", e, root)]
                diags.extend(lower_diags)
                if plan is not None and capabilities and not diags.has_errors:
                    from molt_compile.capability import check_capabilities

                    diags.extend(check_capabilities(plan, loaded.source))
                result.plan = None if diags.has_errors else plan
    result.diagnostics = diags.sorted()
    result.exit_status = diags.exit_status()
    result.skipped_passes = tuple(skipped)
    return result
