"""Every shipped recipe compiles to exactly its golden plan (tests/golden/<name>.plan.json).

A golden changes only deliberately: `python -m tests.golden_update` (or `just regen`), then review the diff.
"""

from __future__ import annotations

import difflib

import pytest
from golden_update import GOLDEN, ROOT, compile_plan_json, golden_path, shipped_recipes

RECIPES = shipped_recipes()


def test_recipes_are_found_and_every_one_has_a_golden() -> None:
    assert len(RECIPES) > 0
    missing = [str(r) for r in RECIPES if not golden_path(r).exists()]
    assert missing == [], "no golden plan; run `python -m tests.golden_update`"
    stale = sorted({p.name for p in GOLDEN.glob("*.plan.json")} - {golden_path(r).name for r in RECIPES})
    assert stale == [], "golden plans of recipes that no longer exist"


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_plan_matches_golden(recipe, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    text, errors = compile_plan_json(recipe)
    assert text is not None, errors
    golden = golden_path(recipe)
    expected = golden.read_text() if golden.exists() else ""
    if text != expected:
        diff = "".join(list(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(golden),
                                                 "compiled", n=2))[:80])
        pytest.fail(f"{recipe} no longer compiles to {golden.name} (run `python -m tests.golden_update` if the "
                    f"change is intended):\n{diff}")
