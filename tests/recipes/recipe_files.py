"""The shipped recipes, found on disk, and a cached compile of each (compiling is pure, so one per file)."""

from __future__ import annotations

import contextlib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = ROOT / "recipes"


def shipped_recipes() -> list[Path]:
    """Every recipe under recipes/ except shared fragments (recipes/base/**) and data files (recipes/data/**)."""
    found = []
    for path in sorted(RECIPES_DIR.rglob("*.yaml")):
        parts = path.relative_to(RECIPES_DIR).parts
        if parts[0] in ("base", "data", "agents"):
            continue
        found.append(path)
    return found


@cache
def compiled(name: str, capabilities: bool = False):
    """`compile_recipe` of recipes/<name>, run from the project root like the CLI would be. Without the capability
    pass by default: these tests hold the recipes to Molt's rules and tables, whatever this runtime implements."""
    from molt_compile.compile import compile_recipe

    with contextlib.chdir(ROOT):  # plan paths are relative to the compile-time working directory
        return compile_recipe(RECIPES_DIR / name, capabilities=capabilities)
