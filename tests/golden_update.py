"""Regenerate the golden plans: `python -m tests.golden_update` (from the project root; `just regen` runs it).

Compiles every shipped recipe under recipes/ (recursively, skipping the `base/` fragments that only other recipes
extend) and writes tests/golden/<name>.plan.json, where <name> is the recipe's path under recipes/ without
`.yaml`, with `/` as `__`. Golden files of recipes that no longer exist are removed. Review the diff before
committing: a golden changes only when a plan is meant to change.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
GOLDEN = ROOT / "tests" / "golden"


def shipped_recipes() -> list[Path]:
    """Every recipe under recipes/, relative to the project root, except fragments under a `base/` directory."""
    found = []
    for path in sorted(RECIPES.rglob("*.yaml")):
        rel = path.relative_to(ROOT)
        if "base" in rel.parts[1:-1]:
            continue
        found.append(rel)
    return found


def golden_path(recipe: Path) -> Path:
    name = recipe.relative_to("recipes").with_suffix("").as_posix().replace("/", "__")
    return GOLDEN / f"{name}.plan.json"


def compile_plan_json(recipe: Path) -> tuple[str | None, list[str]]:
    """The plan JSON of one recipe (compiled with the project root as working directory), or the errors."""
    from molt_compile.compile import compile_recipe

    result = compile_recipe(recipe, capabilities=False)  # the lowering of every recipe, runnable here or not
    errors = [f"{d.code} {d.path}: {d.message}" for d in result.diagnostics if d.severity == "error"]
    return (result.plan.to_json() if result.plan is not None else None), errors


def main() -> int:
    os.chdir(ROOT)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    recipes = shipped_recipes()
    written = changed = 0
    failed = []
    for recipe in recipes:
        text, errors = compile_plan_json(recipe)
        if text is None:
            failed.append((recipe, errors))
            continue
        target = golden_path(recipe)
        if not target.exists() or target.read_text() != text:
            changed += 1
        target.write_text(text)
        written += 1
    keep = {golden_path(r) for r in recipes}
    stale = [p for p in sorted(GOLDEN.glob("*.plan.json")) if p not in keep]
    for p in stale:
        p.unlink()
    print(f"{len(recipes)} recipes, {written} golden plans written ({changed} changed), {len(stale)} stale removed")
    for recipe, errors in failed:
        print(f"NO PLAN for {recipe}:", *errors[:5], sep="\n  ", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
