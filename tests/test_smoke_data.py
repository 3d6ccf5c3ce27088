"""The smoke datasets (tests/data/smoke, built by make_smoke_data.py) fit the launch recipes that name Molt's
`.tmp/<dataset>/<split>` directories: each recipe, pointed at its stand-in, compiles with its own input/label/output/
tool/image keys, and the compiler counts the rows from the save_to_disk headers."""

from __future__ import annotations

from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from tests.smoke import SMOKE_DATA as SMOKE
from tests.smoke import smoke_sets

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if not p.name.startswith("demo_"))


def _smoke_sets(recipe) -> list[str]:
    sets = list(smoke_sets(recipe))
    assert len(sets) == 1 + (recipe.eval.dataset is not None), "every Molt .tmp dataset has its stand-in"
    return sets


def test_every_launch_recipe_was_collected():
    assert len(LAUNCH) >= 12


@pytest.mark.parametrize("path", LAUNCH, ids=lambda p: p.stem)
def test_the_recipe_compiles_on_its_smoke_dataset(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # --set paths resolve against the working directory
    recipe = compile_recipe(path, lower=False).recipe
    result = compile_recipe(path, _smoke_sets(recipe), lower=False)
    # rows only: not model paths (DATA004/005), not batch sizes (BATCH009: --smoke scales them to the 32 rows)
    rows_codes = {"DATA001", "DATA003", "DATA006", "DATA007", "DATA008", "DATA009"}
    data_diags = [(d.code, d.message) for d in result.diagnostics if d.code in rows_codes]
    assert data_diags == []
    count = result.derived.value("data.sample_count" if recipe.kind == "sft" else "data.prompt_count")
    assert count == 32, result.derived["data.sample_count" if recipe.kind == "sft" else "data.prompt_count"].reason
    d = result.recipe.data
    row_keys = {d.input_key, d.output_key if recipe.kind == "sft" else d.label_key}
    if recipe.kind == "rl" and d.tools_key:
        row_keys.add(d.tools_key)
    if (recipe.kind == "sft" and d.image_key) or (recipe.kind == "rl" and d.max_images_per_prompt > 0):
        row_keys.add(d.image_key)
    dataset = d.dataset if recipe.kind == "sft" else d.prompts
    from schemas.datafiles import source_facts

    assert row_keys - {None} <= set(source_facts(dataset, d.split).columns)


def test_the_smoke_rows_grade_and_hold_images():
    import datasets

    geo = datasets.load_from_disk(str(SMOKE / "geo3k_answer/train"))
    row = geo[0]
    assert len(geo) == 32 and row["images"][0].size == (32, 32) and "<image>" in row["prompt"][0]["content"]
    assert row["response"][0]["content"] == f"<answer>{row['reward_model']['ground_truth']}</answer>"
    assert len(datasets.load_from_disk(str(SMOKE / "proRL_text_rl/eval"))) == 8
