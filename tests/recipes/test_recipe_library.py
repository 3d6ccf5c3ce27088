"""Every shipped recipe compiles without errors, and the ones mirroring Molt's scripts say what they are."""

from __future__ import annotations

import pytest
from recipe_files import RECIPES_DIR, compiled, shipped_recipes

SCHEMA_LINE = "# yaml-language-server: $schema=../schemas/recipe.schema.json"
MOLT_SCRIPT_RECIPES = [p for p in shipped_recipes() if not p.name.startswith("demo_")]
"""The recipes that mirror a Molt launch script (the demo recipes are the CPU runtime's, with their own tests)."""


def test_the_library_holds_the_twelve_molt_recipes():
    names = {p.name for p in MOLT_SCRIPT_RECIPES}
    assert len(MOLT_SCRIPT_RECIPES) == 12, sorted(names)
    assert "glm5_ep256.yaml" in names  # the name the design documents use


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.name)
def test_recipe_compiles_without_errors(path):
    """Without errors against Molt's rules (the capability pass aside: tests/test_capability.py)."""
    result = compiled(path.relative_to(RECIPES_DIR).as_posix())
    errors = [f"{d.code} {d.path}: {d.message}" for d in result.diagnostics if d.severity == "error"]
    assert errors == []
    assert result.exit_status == 0
    assert result.recipe is not None and result.derived is not None
    assert result.plan is not None, "a recipe without errors lowers to a plan"
    assert result.plan.name == result.recipe.name


@pytest.mark.parametrize("path", MOLT_SCRIPT_RECIPES, ids=lambda p: p.name)
def test_recipe_header_says_what_where_and_how(path):
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0] == (SCHEMA_LINE.replace("recipe.", "recipe_sft.") if path.name.startswith("sft_") else SCHEMA_LINE)
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert "Molt script: examples/scripts/" in header, "name the launch script this recipe mirrors"
    assert "GPUs:" in header and "Run:" in header
    assert "molt-compile recipes/" + path.name in header
    assert "sbatch" in header or "--submit" in header


@pytest.mark.parametrize("path", sorted((RECIPES_DIR / "base").glob("*.yaml")), ids=lambda p: p.name)
def test_bases_are_fragments_with_a_schema_line(path):
    """Bases carry no job name: they only make sense extended (and `lint` treats them as fragments)."""
    from molt_compile.load import load_recipe

    text = path.read_text()
    schema = "recipe_sft.schema.json" if path.name == "sft.yaml" else "recipe.schema.json"  # kind: sft comes from it
    assert text.splitlines()[0] == f"# yaml-language-server: $schema=../../schemas/{schema}"
    loaded = load_recipe(path)
    assert loaded.ok, [d.message for d in loaded.diagnostics]
    assert loaded.is_fragment and "name" not in loaded.own_keys


def test_lint_recipes_dir_reports_only_capability_errors_and_counts_every_recipe():
    """`molt-compile lint recipes/` is CI's dry run of the whole library: it really looked at each shipped recipe
    (the demo recipes included), treated only recipes/base/* as fragments, and its only errors are CAP001 (settings
    this runtime does not implement yet, listed per recipe by tests/test_capability.py); the demos have none."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "molt_compile.cli", "lint", str(RECIPES_DIR), "--format", "json"],
                          capture_output=True, text=True, cwd=RECIPES_DIR.parent, timeout=300)
    report = json.loads(proc.stdout)
    errors = [d for d in report["diagnostics"] if d["severity"] == "error"]
    assert {d["code"] for d in errors} <= {"CAP001"}, proc.stderr
    assert not [d for d in errors if "/demo_" in d["file"]]
    assert proc.returncode == (1 if errors else 0)
    shipped = shipped_recipes()
    assert len(shipped) >= 12
    assert report["summary"]["recipes"] == len(shipped)
    assert report["summary"]["fragments"] >= len(list((RECIPES_DIR / "base").glob("*.yaml")))
    molt_only = subprocess.run([sys.executable, "-m", "molt_compile.cli", "lint", "--no-capabilities",
                                str(RECIPES_DIR), "--format", "json"], capture_output=True, text=True,
                               cwd=RECIPES_DIR.parent, timeout=300)
    assert molt_only.returncode == 0 and not [d for d in json.loads(molt_only.stdout)["diagnostics"]
                                              if d["severity"] == "error"]


@pytest.mark.parametrize("path", MOLT_SCRIPT_RECIPES, ids=lambda p: p.name)
def test_recipe_renders_the_sbatch_its_header_promises(path, tmp_path):
    """The header's `molt-compile recipes/x.yaml --slurm x.sbatch` works: a syntactically valid script that asks
    Slurm for the nodes and GPUs of the Molt script it mirrors (read from the plan, never typed twice)."""
    import subprocess

    from molt_compile.slurm import render_sbatch

    plan = compiled(path.name).plan
    script = render_sbatch(plan)
    assert f"#SBATCH --nodes={plan.cluster.nodes}\n" in script
    assert f"#SBATCH --gpus-per-node={plan.cluster.gpus_per_node}\n" in script
    assert f"#SBATCH --time={plan.recipe['launch']['slurm']['time']}\n" in script
    sbatch = tmp_path / f"{path.stem}.sbatch"
    sbatch.write_text(script)
    checked = subprocess.run(["bash", "-n", str(sbatch)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
