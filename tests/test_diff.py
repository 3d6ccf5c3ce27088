"""diff_results(): resolved-recipe, derived and plan differences between two compiled recipes; the CLI's exit codes."""

from __future__ import annotations

import subprocess
import sys

from plan_support import PLAN_DATA, ROOT, from_file

from molt_compile.compile import CompileResult
from molt_compile.diagnostics import Diagnostic
from molt_compile.diff import diff_results
from molt_compile.lower import lower

OMNI = PLAN_DATA / "rl_omni3_30b.yaml"


def compiled(path, sets=()) -> CompileResult:
    recipe, derived, source = from_file(path, sets)
    plan, diags = lower(recipe, derived, source)
    return CompileResult(recipe=recipe, source=source, derived=derived, plan=plan, diagnostics=diags)


def test_same_recipe_is_equal() -> None:
    lines, changed = diff_results(compiled(OMNI), compiled(OMNI))
    assert changed is False
    assert lines[-1] == "no differences: the recipes resolve to the same plan"
    assert not any(line.startswith(("recipe:", "derived:", "roles:", "fingerprint")) for line in lines)


def test_fewer_engines() -> None:
    a, b = compiled(OMNI), compiled(OMNI, ("rollout.engines=2",))
    lines, changed = diff_results(a, b)
    assert changed is True
    text = "\n".join(lines)
    assert "recipe:\n  rollout.engines: 4 -> 2" in text
    assert "  rollout.total_gpus: 8 -> 4" in text and "  cluster.used_gpus: 24 -> 20" in text
    assert '  rollout.engine: "4 × (2 dev, 0 CPU) rollout" -> "2 × (2 dev, 0 CPU) rollout"' in text
    assert "device map:" in text and "  + node 0: rollout.engine ×4, idle ×4" in text
    assert f"fingerprint: {a.plan.fingerprint} -> {b.plan.fingerprint}" in text


def test_equivalent_spellings_are_equal(tmp_path) -> None:
    """A value written explicitly equal to its default resolves to the same recipe and plan."""
    lines, changed = diff_results(compiled(OMNI), compiled(OMNI, ("rollout.top_p=1.0", "train.seed=42")))
    assert changed is False, lines


def test_missing_plan_is_reported() -> None:
    a = compiled(OMNI)
    b = CompileResult(recipe=a.recipe, source=a.source, derived=a.derived, plan=None,
                      diagnostics=[Diagnostic(code="X001", severity="error", message="m")])
    lines, changed = diff_results(a, b)
    assert changed is True and "plan B: none (1 error(s))" in lines
    assert f"fingerprint: {a.plan.fingerprint} -> none" in lines


def test_cli_exit_codes() -> None:
    cli = [sys.executable, "-m", "molt_compile.cli"]
    same = subprocess.run(cli + ["diff", "recipes/qwen3_4b_math.yaml", "recipes/qwen3_4b_math.yaml"], cwd=ROOT,
                          capture_output=True, text=True)
    assert same.returncode == 0, same.stdout + same.stderr
    other = subprocess.run(cli + ["diff", "recipes/qwen3_4b_math.yaml", "recipes/qwen3_4b_math_quickstart.yaml"],
                           cwd=ROOT, capture_output=True, text=True)
    assert other.returncode == 1, other.stdout + other.stderr
    assert "  rollout.engines: 8 -> 1" in other.stdout and "plans differ" in other.stdout
