"""The capability pass (CAP001): every row of the runtime's capability table is a compile error at its line, or a
CAP002 warning where its code is written for the device kind but not run there.

Data files live in tests/capability/: `<row id>.yaml` asks for that row (and marks each CAP001 line with
`# E: CAP001`, each CAP002 line with `# W: CAP002`, other rows it needs included); `ok-*.yaml` asks for none. Every
row has its file, so a row that is added without a test, or a predicate that stops firing, fails here.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from schemas.capabilities import CAPABILITIES, DEVICES

ROOT = Path(__file__).resolve().parents[1]
CAP_DIR = Path(__file__).parent / "capability"
MARK = re.compile(r"#\s*[EW]:\s*(CAP00[12])")
FILES = sorted(CAP_DIR.glob("*.yaml"))

LAUNCH_RECIPE_ROWS = {
    # What each shipped recipe asks for that this runtime does not implement: the rows leave as issues land.
    "glm5_ep256.yaml": set(),
    "omni3_30b_distill.yaml": set(),
    "omni3_30b_geo3k.yaml": set(),
    "qwen3_4b_math.yaml": set(),
    "qwen3_4b_math_quickstart.yaml": set(),
    "qwen3_6_35b_geo3k.yaml": set(),
    "qwen3_6_35b_geo3k_quickstart.yaml": set(),
    "sft_omni3_30b.yaml": set(),
    "sft_qwen3_4b.yaml": set(),
    "sft_qwen3_4b_quickstart.yaml": set(),
    "sft_qwen3_6_35b.yaml": set(),
    "sft_qwen3_6_35b_quickstart.yaml": set(),
    "demo_math.yaml": set(), "demo_math_hf.yaml": set(), "demo_tool.yaml": set(), "demo_sft.yaml": set(),
    "demo_gpu.yaml": set(),
}


def _expected(path: Path, code: str = "CAP001") -> set[int]:
    """The lines marked with `code` (a line may carry both marks)."""
    return {n for n, line in enumerate(path.read_text().splitlines(), start=1)
            if any(m.group(1) == code for m in MARK.finditer(line))}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_capability_file_reports_exactly_the_marked_lines(path: Path):
    result = compile_recipe(path)
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert all(d.code == "CAP001" for d in errors), [(d.code, d.line, d.message) for d in errors]
    here = {d.line for d in errors if d.file and Path(d.file).resolve() == path.resolve()}
    assert here == _expected(path), [(d.path, d.line, d.message) for d in errors]
    assert len(here) == len(errors), "a CAP001 outside this file"
    assert (result.plan is None) == bool(errors), "a recipe with CAP001 errors has no plan"
    for d in errors:
        assert d.name == "not-implemented-by-runtime" and d.help.startswith("write ")
    warned = [d for d in result.diagnostics if d.code == "CAP002"]
    assert {d.line for d in warned} == _expected(path, "CAP002"), [(d.path, d.line, d.message) for d in warned]
    assert all(d.severity == "warning" and "not run" in d.message for d in warned)


def test_every_row_has_its_file_and_ids_are_unique():
    ids = [c.id for c in CAPABILITIES]
    assert len(ids) == len(set(ids))
    stems = {p.stem for p in FILES}
    assert {c.id for c in CAPABILITIES} <= stems, sorted({c.id for c in CAPABILITIES} - stems)
    assert stems - {c.id for c in CAPABILITIES} <= {p.stem for p in FILES if p.stem.startswith("ok-")}


@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: c.id)
def test_row_points_at_a_recipe_key(cap):
    from molt_compile import schema_walk as sw
    from schemas.recipe import RlRecipe, SftRecipe

    model = RlRecipe if cap.kind == "rl" else SftRecipe
    assert sw.type_at(model, cap.key.split("."))[0] is not None, f"{cap.key} is not a key of a {cap.kind} recipe"
    assert cap.devices <= set(DEVICES) and cap.instead and cap.what


@pytest.mark.parametrize("recipe", sorted(LAUNCH_RECIPE_ROWS), ids=str)
def test_shipped_recipe_names_exactly_its_unimplemented_settings(recipe):
    with contextlib.chdir(ROOT):
        result = compile_recipe(Path("recipes") / recipe)
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert {d.code for d in errors} <= {"CAP001"}
    rows = [c for c in CAPABILITIES if c.kind == result.recipe.kind]  # a key may ask for more than one row
    ids = {next(c.id for c in rows if c.key == d.path and d.message.startswith(c.what)) for d in errors}
    assert ids == LAUNCH_RECIPE_ROWS[recipe], [(d.path, d.message) for d in errors]
    assert all(d.line is not None or d.path == "model.backend" for d in errors), "a CAP001 without its line"


def test_rules_cli_documents_the_table(capsys):
    from click.testing import CliRunner

    from molt_compile.cli import cli

    out = CliRunner().invoke(cli, ["rules", "CAP001"]).output
    assert "not-implemented-by-runtime" in out
    for cap in CAPABILITIES:
        assert f"| {cap.id} |" in out


def test_a_new_moe_recipe_compiles_by_following_the_messages():
    """The MOE001 <-> CAP001 loop of issue 27: MOE001 asks for ep > 1, and the layout its help names (ep = the GPUs
    per node, here the trainer's ranks) must not be refused; on GPUs it is written, not run: CAP002 only."""
    recipe = CAP_DIR / "held_out" / "qwen3_30b_grpo.yaml"
    first = compile_recipe(recipe)
    errors = [d for d in first.diagnostics if d.severity == "error"]
    assert [(d.code, d.path) for d in errors] == [("MOE001", "actor.mesh.ep")]
    assert "e.g. the GPUs per node" in (errors[0].help or "")
    followed = compile_recipe(recipe, [f"actor.mesh.ep={first.recipe.actor.gpus_per_node}"])
    assert not [d for d in followed.diagnostics if d.severity == "error"], followed.diagnostics
    assert {d.code for d in followed.diagnostics if d.code.startswith("CAP")} == {"CAP002"}


@pytest.mark.parametrize(("recipe", "cluster"), [("ok-cpu-automodel-tp.yaml", 5), ("ok-cpu-sft-automodel-tp.yaml", 4)])
def test_tp_by_cp_on_cpus_is_refused_by_the_cp_row_alone(recipe, cluster):
    """tp x cp is written (ok-cuda-trainer-tp-cp.yaml: the TP and CP rows' warnings on GPUs); on CPU ranks the TP
    row runs and CP has no CPU path: one CAP001, the CP row's, at actor.mesh.cp."""
    result = compile_recipe(CAP_DIR / recipe, ["actor.mesh.cp=2", "actor.gpus_per_node=4",
                                               f"cluster.gpus_per_node={cluster}"])
    errors = [d for d in result.diagnostics if d.severity == "error"]
    assert [(d.code, d.path) for d in errors] == [("CAP001", "actor.mesh.cp")], errors
    assert errors[0].message.startswith("context parallelism in the trainer (actor.mesh.cp > 1)")
    assert not [d for d in result.diagnostics if d.code == "CAP002"]
