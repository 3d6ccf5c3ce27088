"""Static agent inspection and the rule runner's suppression and crash handling."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from molt_compile.agent_check import inspect_agent
from molt_compile.codes import Code
from molt_compile.compile import compile_recipe
from molt_compile.rules import _run

BASE = Path(__file__).parent / "rules" / "_base_rl.yaml"
IMPORTS = "from runtime.agents import Env, Result, StepEnvRunner, ChatAgent, ChatAgentRunner, Runner\n"


def _agent(tmp_path: Path, body: str):
    p = tmp_path / "agent.py"
    p.write_text(IMPORTS + body)
    inspect_agent.cache_clear()
    return inspect_agent(str(p))


@pytest.mark.parametrize("body,kind", [
    ("class E(Env): pass\nAgentRunner = StepEnvRunner(E)\n", "step"),
    ("class A(ChatAgent): pass\nAgentRunner = ChatAgentRunner(A)\n", "chat"),
    ("import runtime.agents as agents\nclass E(agents.Env): pass\nAgentRunner = agents.StepEnvRunner(E)\n", "step"),
    ("class R(Runner):\n    PRERENDER_PROMPT = False\nAgentRunner = R\n", "chat"),
    ("class B(StepEnvRunner): pass\nclass AgentRunner(B): pass\n", "step"),
    ("class E(Env): pass\nrunner = StepEnvRunner(E)\nAgentRunner = runner\n", "step"),
    ("AgentRunner: Runner = StepEnvRunner(Env)\n", "step"),
    ("from somewhere import AgentRunner\n", "external"),
    ("from somewhere import make\nAgentRunner = make()\n", "external"),
])
def test_accepted_runner_forms(tmp_path, body, kind):
    info = _agent(tmp_path, body)
    assert info.runner == kind and info.not_a_runner is None and info.wrong_env is None


@pytest.mark.parametrize("body,attr", [
    ("class AgentRunner: pass\n", "not_a_runner"),
    ("AgentRunner = 3\n", "not_a_runner"),
    ("AgentRunner = lambda: None\n", "not_a_runner"),
    ("class X: pass\nAgentRunner = StepEnvRunner(X)\n", "wrong_env"),
    ("class X(Env): pass\nAgentRunner = ChatAgentRunner(X)\n", "wrong_env"),
])
def test_rejected_runner_forms(tmp_path, body, attr):
    assert getattr(_agent(tmp_path, body), attr)


def test_missing_runner_and_syntax_error(tmp_path):
    assert _agent(tmp_path, "x = 1\n").runner is None
    info = _agent(tmp_path, "def f(:\n")
    assert info.syntax_error and info.syntax_line == 2  # the import line, then the bad one


def test_ignore_suppresses_and_unused_ignore_is_reported(tmp_path):
    for sub in ("agents", "data"):
        shutil.copytree(BASE.parent / sub, tmp_path / sub)
    (tmp_path / "used.yaml").write_text(f"extends: {BASE}\ncluster: {{nodes: 2}}\nignore: {{PLACE007: spare node}}\n")
    codes = {d.code for d in compile_recipe(tmp_path / "used.yaml", lower=False, roots=[BASE.parent]).diagnostics}
    assert "PLACE007" not in codes and "IGNORE002" not in codes
    (tmp_path / "unused.yaml").write_text(f"extends: {BASE}\nignore: {{PLACE007: spare node}}\n")
    diags = compile_recipe(tmp_path / "unused.yaml", lower=False, roots=[BASE.parent]).diagnostics
    assert [(d.code, d.path, d.line) for d in diags] == [("IGNORE002", "ignore.PLACE007", 2)]


def test_a_crashing_rule_becomes_a_diagnostic_not_a_traceback():
    def broken(recipe, derived, source):
        raise ZeroDivisionError("boom")
        yield  # pragma: no cover

    (d,) = _run(Code("TEST001", "broken-rule", "warning", broken), broken(None, None, None))
    assert d.severity == "error" and "ZeroDivisionError" in d.message and d.code == "TEST001"


def test_messages_carry_the_numbers_and_related_positions():
    path = Path(__file__).parent / "rules" / "BATCH001_1.yaml"
    (d,) = compile_recipe(path, lower=False).diagnostics
    assert d.message == "train.batch_size 2 is not a multiple of micro_batch_size 1 × actor dp 4 = 4"
    assert d.help == "set train.batch_size to 4"
    rel = {r.path: r for r in d.related}
    assert rel["train.micro_batch_size"].line is not None and rel["train.micro_batch_size"].file.endswith(
        "_base_rl.yaml")


@pytest.mark.parametrize(("heads", "kv", "vocab", "tp", "ok"), [
    (32, 8, 151936, 4, True), (32, 8, 151936, 16, True), (32, 8, 151936, 32, True),  # 16, 32: KV heads replicated
    (32, 8, 151936, 3, False), (12, 2, 1000, 3, False), (12, 2, 1000, 4, True), (64, 1, 154880, 8, True),
    (24, 8, 1000, 12, False), (48, 8, 1000, 12, False), (48, 12, 1000, 6, False),  # 1024 rows % 6
    (48, 12, 3072, 6, True),
])
def test_vllm_shape_rule_follows_vllm(heads, kv, vocab, tp, ok):
    """vLLM: heads % tp; kv % tp below kv heads, tp % kv from there (replication); padded-to-64 vocab % tp."""
    from molt_compile.rules.shapes import _vllm_shape_problem

    assert (_vllm_shape_problem(heads, kv, vocab, tp) is None) == ok


@pytest.mark.parametrize(("value", "ok"), [
    ("90", True), ("90:30", True), ("04:00:00", True), ("2-12", True), ("2-12:30", True), ("2-12:30:15", True),
    ("UNLIMITED", True), ("infinite", True), ("0", True),
    ("2d", False), ("48h", False), ("1:2:3:4", False), ("2-", False), ("-1:00", False), ("4:00:00 ", False),
    ("", False), ("2-1-3", False), ("1.5", False), ("04:00:00\n#SBATCH --x", False),
])
def test_slurm_time_accepts_exactly_sbatch_formats(value, ok):
    from molt_compile.rules.launch import SLURM_TIME

    assert bool(SLURM_TIME.fullmatch(value)) == ok


@pytest.mark.parametrize(("value", "spelled"), [("2d", "2-00:00:00"), ("48h", "2-00:00:00"), ("90m", "01:30:00"),
                                                ("1d 12h", "1-12:00:00"), ("soon", None), ("2x", None)])
def test_slurm_time_help_spells_units_out(value, spelled):
    from molt_compile.rules.launch import _slurm_time_in_words

    assert _slurm_time_in_words(value) == spelled


@pytest.mark.parametrize(("text", "code", "says"), [
    ("algo: {kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}\nref:\n", "EST009", "`ref:` is empty (YAML null)"),
    ("algo: {kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}\n", "EST009", "the recipe has no `ref:` section"),
    ("algo: {estimator: gae}\ncritic:\n", "EST002", "`critic:` is empty (YAML null)"),
    ("algo: {estimator: on_policy_distill}\nref:\nagent: null\n", "EST004", "`ref:` is empty (YAML null)"),
])
def test_a_bare_section_is_told_it_is_empty(tmp_path, text, code, says):
    """Issue 19: a bare `ref:` was told "the recipe has no `ref:` section" with a caret on that very line."""
    shutil.copy(BASE, tmp_path / "_base_rl.yaml")
    for sub in ("agents", "data"):
        shutil.copytree(BASE.parent / sub, tmp_path / sub)
    (tmp_path / "r.yaml").write_text("extends: _base_rl.yaml\n" + text)
    found = [d for d in compile_recipe(tmp_path / "r.yaml", lower=False).diagnostics if d.code == code]
    assert found and says in found[0].message, [(d.code, d.message) for d in found]
    if "empty" in says:
        assert "removes the section" in found[0].help
    if text.endswith("ref:\n"):  # explain's derived value says the same
        ref = compile_recipe(tmp_path / "r.yaml", lower=False).derived.get("ref.exists")
        assert ref.reason.startswith("`ref:` is empty (YAML null)")


@pytest.mark.parametrize(("arch", "says"), [("null", "model.arch is not set"),
                                            ("qwen9-unknown", "model.arch `qwen9-unknown` is not a catalog key")])
def test_memory_not_estimated_names_the_unknown_arch(tmp_path, arch, says):
    shutil.copy(BASE, tmp_path / "_base_rl.yaml")
    for sub in ("agents", "data"):
        shutil.copytree(BASE.parent / sub, tmp_path / sub)
    (tmp_path / "r.yaml").write_text(f"extends: _base_rl.yaml\nmodel: {{path: /lustre/models/custom, arch: {arch}}}\n")
    (d,) = [d for d in compile_recipe(tmp_path / "r.yaml", lower=False).diagnostics if d.code == "MEM006"]
    assert says in d.message
