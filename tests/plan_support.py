"""Helpers of the derive/lower/plan tests: build a recipe from a file or a dict and run derive and lower on it.

These call the passes directly (load -> validate -> derive -> lower), without the rule catalog, so a derive or
lowering test does not depend on which rules exist.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from molt_compile.derive import Derived, derive
from molt_compile.load import load_recipe
from molt_compile.lower import lower
from molt_compile.validate import validate
from schemas.recipe import RlRecipe, SftRecipe

ROOT = Path(__file__).resolve().parents[1]
PLAN_DATA = ROOT / "tests" / "data" / "plan"


def from_file(path: Path | str, sets: tuple[str, ...] = ()) -> tuple[Any, Derived, Any]:
    """(recipe, derived, source) of a recipe file; fails the test on load/schema errors."""
    loaded = load_recipe(Path(path), sets)
    recipe, diags = validate(loaded) if loaded.ok else (None, loaded.diagnostics)
    assert recipe is not None, [d.message for d in list(loaded.diagnostics) + list(diags)]
    return recipe, derive(recipe, loaded.source), loaded.source


def lowered(path: Path | str, sets: tuple[str, ...] = ()):
    recipe, derived, source = from_file(path, sets)
    return lower(recipe, derived, source)


BASE_RL: dict[str, Any] = {
    "version": 1, "name": "t", "kind": "rl",
    "cluster": {"nodes": 1, "gpus_per_node": 8},
    "model": {"path": "/models/m"},
    "agent": {"path": "agent.py"},
    "data": {"prompts": "/nonexistent/prompts.jsonl"},
}
BASE_SFT: dict[str, Any] = {
    "version": 1, "name": "s", "kind": "sft",
    "cluster": {"nodes": 1, "gpus_per_node": 8},
    "model": {"path": "/models/m"},
    "data": {"dataset": "/nonexistent/d.jsonl"},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def rl(**over: Any) -> RlRecipe:
    return RlRecipe.model_validate(merge(BASE_RL, over))


def sft(**over: Any) -> SftRecipe:
    return SftRecipe.model_validate(merge(BASE_SFT, over))
