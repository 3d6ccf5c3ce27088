"""`catalog`, `init`, `explain KEY...`, `--format json` of explain/diff/rules, `--help`'s exit codes, the schemas."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from molt_compile.cli import cli, recipe_json_schema

ROOT = Path(__file__).resolve().parents[1]
DEMO = "recipes/demo_math.yaml"


def run(*args: str, **kw):
    return CliRunner().invoke(cli, list(args), prog_name="molt-compile", catch_exceptions=False, **kw)


def test_help_documents_exit_codes_and_completion():
    out = run("--help").output
    assert re.search(r"0\s+no errors", out) and re.search(r"1\s+the recipe has errors", out)
    assert re.search(r"2\s+unusable input", out) and "_MOLT_COMPILE_COMPLETE=bash_source" in out
    assert max(map(len, out.splitlines())) <= 100


def test_catalog_text_and_json():
    assert "qwen3-4b" in run("catalog", "models").output
    gpus = json.loads(run("catalog", "gpus", "--format", "json").output)
    assert "models" not in gpus and {g["key"] for g in gpus["gpus"]} >= {"h100-80gb", "h200-141gb"}


@pytest.mark.parametrize("flags", [[], ["--kind", "sft", "--gpu", "h200-141gb", "--nodes", "2"],
                                   ["--arch", "qwen3-8b", "--gpu", "a100-80gb", "--nodes", "2"]])
def test_init_writes_a_recipe_that_compiles_clean(tmp_path, flags):
    from molt_compile.compile import compile_recipe

    out = tmp_path / "my-job.yaml"
    result = run("init", str(out), *flags, input="")
    assert result.exit_code == 0, result.output
    assert "0 errors" in result.output
    compiled = compile_recipe(out)
    assert compiled.exit_status == 0 and compiled.plan is not None and compiled.recipe.name == "my-job"
    assert compiled.derived.value("cluster.used_gpus") == compiled.derived.value("cluster.total_gpus")
    assert run("init", str(out)).exit_code == 2  # refuses to overwrite


def test_explain_filters_keys_and_prints_json(in_root):
    out = run("explain", DEMO, "actor.optimizer").output
    assert "actor.optimizer.lr" in out and "rollout.engines" not in out and "model catalog" not in out
    data = json.loads(run("explain", DEMO, "actor.optimizer.lr", "*.temperature", "--format", "json").output)
    keys = {v["key"] for v in data["values"]}
    assert {"actor.optimizer.lr", "rollout.temperature"} <= keys and all(k.endswith(("lr", "temperature")) for k in keys)
    lr = next(v for v in data["values"] if v["key"] == "actor.optimizer.lr")
    assert lr["value"] == 5e-4 and lr["source"].startswith("recipes/demo_math.yaml:")
    assert run("explain", DEMO, "no.such.key").exit_code == 2


def test_explain_fits_100_columns(in_root, monkeypatch):
    from rich.console import Console

    import molt_compile.cli_inspect as cli_module

    monkeypatch.setattr(cli_module, "console", lambda **_: Console(width=100, force_terminal=False, no_color=True))
    result = run("explain", DEMO)
    assert max(len(line) for line in result.output.splitlines()) <= 100
    assert "actor.optimizer.lr" in result.output


def test_diff_and_rules_json(in_root):
    result = run("diff", DEMO, "recipes/demo_math_hf.yaml", "--format", "json")
    data = json.loads(result.output)
    assert result.exit_code == 1 and data["changed"] is True
    assert data["sections"]["recipe"]["rollout.engine"] == ["vllm", "hf"]
    same = json.loads(run("diff", DEMO, DEMO, "--format", "json").output)
    assert same == {**same, "changed": False, "sections": {}}
    codes = json.loads(run("rules", "--format", "json").output)["codes"]
    assert {"VLLM009", "LOAD001", "CAP001"} <= {c["code"] for c in codes}
    (one,) = json.loads(run("rules", "vllm009", "--format", "json").output)["codes"]
    assert one["severity"] == "error" and "## What it checks" in one["doc"]
    assert run("rules", "NOPE1", "--format", "json").exit_code == 2


# ----------------------------------------------------------------------------------------- editor schemas
def test_committed_sft_schema_is_current():
    committed = json.loads((ROOT / "schemas" / "recipe_sft.schema.json").read_text())
    assert committed == recipe_json_schema("sft"), "stale: run `molt-compile schema --kind sft > schemas/recipe_sft.schema.json`"
    assert committed["$id"].endswith(":v1") and recipe_json_schema()["$id"].endswith(":v1")


def _modeline_schema(path: Path) -> dict:
    first = path.read_text().splitlines()[0]
    return json.loads((path.parent / first.split("$schema=")[1]).read_text())


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*sft*.yaml")), ids=lambda p: p.name)
def test_shipped_sft_recipes_validate_as_sft_in_the_editor(path):
    """What yaml-language-server does: validate the file against the schema its modeline names."""
    doc = yaml.safe_load(path.read_text())
    schema = _modeline_schema(path)
    jsonschema.validate(doc, schema)  # SFT keys (data.dataset, train.max_epochs) are accepted
    bad = {**doc, "data": {**doc["data"], "output_kye": "x"}}
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(bad, schema)
    assert "output_kye" in str(err.value.message)
    if "kind" not in doc:  # inherited from base/sft.yaml: the RL schema would reject the SFT data keys
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, recipe_json_schema())


def test_init_of_every_catalog_arch_and_gpu_compiles_clean(tmp_path):
    """Issue 30.8: `init --arch qwen3-30b-a3b` wrote a recipe that failed MOE005. Every model x GPU x kind now
    passes every rule; an MoE recipe's only errors are this runtime's gaps (CAP001: trainer EP, which Molt's MOE001
    requires, and the automodel backend under SFT). glm-5.2 (~750B) is left out: a starter recipe does not size it."""
    from molt_compile.compile import compile_recipe
    from schemas.catalog import GPUS, MODELS

    for arch, spec in MODELS.items():
        if arch == "glm-5.2":
            continue
        for gpu in GPUS:  # "cpu" among them
            for kind in ("rl", "sft"):
                out = tmp_path / f"{arch}-{gpu}-{kind}".replace(".", "_") / "r.yaml"
                result = run("init", str(out), "--arch", arch, "--gpu", gpu, "--kind", kind)
                errors = {(d.code, d.path) for d in compile_recipe(out).diagnostics if d.severity == "error"}
                # this runtime's gaps (CAP001): trainer EP, and nemo-automodel under SFT
                expected = {("CAP001", "actor.mesh.ep"), ("CAP001", "model.backend")} if spec.is_moe else set()
                assert errors <= expected and result.exit_code == (1 if errors else 0), (arch, gpu, kind, result.output)


def test_qwen3_4b_math_comment_matches_its_gpu_map(in_root):
    """Issue 30.8: the recipe's comment put the actor on node 0 and the engines on node 1; the plan does the
    opposite (engines are placed first)."""
    from molt_compile.cli_output import console as _console
    from molt_compile.compile import compile_recipe
    from molt_compile.render_plan import render_summary

    result = compile_recipe(Path("recipes/qwen3_4b_math.yaml"), capabilities=False)
    console = _console(pipe_width=140)
    with console.capture() as captured:
        console.print(render_summary(result.plan, None))
    rows = {ln.split("│")[1].strip(): ln.split("│")[2] for ln in captured.get().splitlines() if "│ node " in ln}
    assert "rollout.engine ×8" in rows["node 0"] and "actor.rank+ref.rank ×8" in rows["node 1"], rows
    comment = " ".join(Path("recipes/qwen3_4b_math.yaml").read_text().split("\nversion:")[0].split())
    assert "vLLM engines on node 0" in comment and "reference on node 1" in comment
