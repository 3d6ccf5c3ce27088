"""`molt-compile`: routing, output formats, exit statuses, lint, schema, explain, rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from molt_compile.cli import cli, recipe_json_schema
from molt_compile.compile import compile_recipe

ROOT = Path(__file__).resolve().parents[1]
BAD = "tests/data/bad"
GOOD = "tests/data/good"


def run(*args: str):
    return CliRunner().invoke(cli, list(args), prog_name="molt-compile", catch_exceptions=False)


# ----------------------------------------------------------------------------------------- the compile command
def test_nested_typo_prints_position_line_caret_and_suggestion(in_root):
    result = run(f"{BAD}/typo_nested.yaml")
    assert result.exit_code == 1  # a recipe error; the rules ran on the rest (this stub has rule errors too)
    lines = result.output.splitlines()
    at = lines.index("error[SCHEMA001] unknown-key: unknown key `queue_sise` in `train.async`")
    assert lines[at + 1] == f" --> {BAD}/typo_nested.yaml:8:5  (train.async.queue_sise; set in {BAD}/typo_nested.yaml)"
    assert lines[at + 3] == "8 |     queue_sise: 2"
    assert lines[at + 4] == "  |     ^^^^^^^^^^"
    assert lines[at + 5] == "  = help: did you mean `queue_size`?"
    assert lines[-1].startswith(f"{BAD}/typo_nested.yaml: ")


def test_real_process_prints_no_traceback(in_root):
    for name, status in (("typo_nested.yaml", 1), ("alias_bomb.yaml", 2), ("not_utf8.yaml", 2),
                         ("python_tag.yaml", 2), ("missing.yaml", 2)):
        proc = subprocess.run([sys.executable, "-m", "molt_compile.cli", f"{BAD}/{name}"], capture_output=True,
                              text=True, cwd=ROOT)
        assert proc.returncode == status, (name, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr
        assert f"{BAD}/{name}" in proc.stdout


def _program(*args: str, **kw) -> subprocess.CompletedProcess:
    """`molt-compile ARGS` as the installed program runs it (`molt_compile.cli:run`), in a fresh process."""
    return subprocess.run([sys.executable, "-m", "molt_compile.cli", *args], capture_output=True, cwd=ROOT, **kw)


def test_the_program_flushes_all_its_output_and_keeps_each_exit_status(in_root, tmp_path):
    """`run` ends the process without tearing it down: every byte written must still arrive, and the status is
    the command's (0, 1 for errors, 2 for unusable input or usage)."""
    whole = _program("schema", text=True)
    assert whole.returncode == 0 and whole.stderr == ""
    assert json.loads(whole.stdout) == recipe_json_schema()  # ~100 KB through a pipe, none of it lost
    plan = tmp_path / "p.json"
    ok = _program(f"{GOOD}/rl_min.yaml", "--plan-out", str(plan), text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert plan.read_text() == compile_recipe(ROOT / GOOD / "rl_min.yaml").plan.to_json()
    assert ok.stdout.endswith(f"rl_min.yaml: 0 errors, 0 warnings\nplan written to {plan}\n"), ok.stdout
    assert _program("tests/capability/rl-muon.yaml").returncode == 1  # CAP001 errors
    assert _program("recipes/glm5_ep256.yaml").returncode == 0  # CAP002 and other warnings only
    assert _program(f"{BAD}/typo_nested.yaml").returncode == 1  # a schema error is a recipe error
    usage = _program("lint", text=True)
    assert usage.returncode == 2 and "Missing argument" in usage.stderr


def test_the_program_leaves_a_closed_pipe_quietly(in_root):
    proc = subprocess.Popen([sys.executable, "-m", "molt_compile.cli", "schema"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader went away before the first byte (`molt-compile schema | true`)
    assert proc.wait(timeout=60) == 1
    assert proc.stderr.read() == b""


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / BAD).glob("*.yaml")))
def test_every_bad_file_exits_1_or_2_with_a_diagnostic(in_root, name):
    """2 for input no pass can read (YAML, files, `extends`); 1 for a recipe the schema rejects."""
    result = run(f"{BAD}/{name}")
    schema_error = compile_recipe(ROOT / BAD / name).loaded.ok
    assert result.exit_code == (1 if schema_error else 2), result.output
    assert result.output.startswith("error[") and ("error[SCHEMA" in result.output) == schema_error
    assert f"{BAD}/{name}: " in result.output.splitlines()[-1] or "cycle" in name


def test_set_is_applied_and_checked(in_root):
    bad = run(f"{GOOD}/rl_min.yaml", "--set", "rollout.engins=2")
    assert bad.exit_code == 2
    assert "error[LOAD009] set-unknown-key" in bad.output and "did you mean `rollout.engines`?" in bad.output
    assert "(rollout.engins; set by --set)" in bad.output
    unparsable = run(f"{GOOD}/rl_min.yaml", "--set", "rollout.engines={")
    assert unparsable.exit_code == 2 and "LOAD010" in unparsable.output


def test_submit_form_is_routed_to_the_compile_command(in_root):
    # A recipe with a schema error stops before submitting, which shows the option parsed as part of `compile`.
    result = run(f"{BAD}/typo_nested.yaml", "--submit", "--address", "http://127.0.0.1:1", "--follow")
    assert result.exit_code == 1 and "SCHEMA001" in result.output
    explicit = run("compile", f"{BAD}/typo_nested.yaml", "--submit")
    assert explicit.exit_code == 1 and explicit.output == result.output


def test_usage_errors_exit_2(in_root):
    assert run(f"{GOOD}/rl_min.yaml", "--format", "xml").exit_code == 2
    assert run(f"{GOOD}/rl_min.yaml", "--bogus").exit_code == 2
    assert run("compile").exit_code == 2
    assert run("lint").exit_code == 2
    assert run("lint", "no/such/dir").exit_code == 2
    assert run("diff", "a.yaml").exit_code == 2


def test_help_lists_the_subcommands():
    result = run("--help")
    assert result.exit_code == 0
    for word in ("lint", "schema", "explain", "diff", "rules", "RECIPE"):
        assert word in result.output


def test_json_format(in_root):
    result = run(f"{BAD}/bad_enum.yaml", "--format", "json")
    assert result.exit_code == 1
    doc = json.loads(result.output)
    assert doc["plan"] is None
    assert doc["summary"]["exit_status"] == 1
    (d,) = [d for d in doc["diagnostics"] if d["code"].startswith("SCHEMA")]
    assert (d["code"], d["path"], d["line"], d["col"]) == ("SCHEMA005", "algo.estimator", 6, 14)
    assert d["help"] == "did you mean `grpo`?" and d["name"] == "bad-enum-value"


def test_json_format_carries_the_plan(in_root):
    compiled = compile_recipe(Path(f"{GOOD}/rl_min.yaml"))
    assert compiled.exit_status == 0 and compiled.plan is not None, compiled.diagnostics
    result = run(f"{GOOD}/rl_min.yaml", "--format", "json")
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert doc["plan"] == json.loads(compiled.plan.to_json())
    assert doc["summary"]["fingerprint"] == compiled.plan.fingerprint and doc["summary"]["exit_status"] == 0


def test_github_format(in_root):
    result = run(f"{BAD}/typo_nested.yaml", "--format", "github")
    assert result.exit_code == 1
    assert (
        f"::error file={BAD}/typo_nested.yaml,line=8,col=5,title=SCHEMA001::"
        "unknown key `queue_sise` in `train.async` (train.async.queue_sise)%0Ahelp: did you mean `queue_size`?\n"
    ) in result.output


def test_plan_out(in_root, tmp_path):
    compiled = compile_recipe(Path(f"{GOOD}/rl_min.yaml"))
    out = tmp_path / "plans" / "rl_min.plan.json"
    result = run(f"{GOOD}/rl_min.yaml", "--plan-out", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_text() == compiled.plan.to_json()


def test_plan_out_is_not_written_for_a_recipe_with_errors(in_root, tmp_path):
    out = tmp_path / "plan.json"
    result = run(f"{GOOD}/child.yaml", "--plan-out", str(out))
    assert result.exit_code == 1 and not out.exists()


def test_slurm_script(in_root, tmp_path):
    out = tmp_path / "job.sbatch"
    result = run(f"{GOOD}/rl_min.yaml", "--slurm", str(out))
    try:
        from molt_compile.slurm import render_sbatch
    except ImportError:
        assert result.exit_code == 2 and "not available" in result.output and not out.exists()
    else:
        assert result.exit_code == 0, result.output
        assert out.read_text() == render_sbatch(compile_recipe(Path(f"{GOOD}/rl_min.yaml")).plan)


def test_compile_summary_is_printed(in_root):
    compiled = compile_recipe(Path(f"{GOOD}/rl_min.yaml"))
    result = run(f"{GOOD}/rl_min.yaml")
    assert result.exit_code == 0
    assert compiled.plan.fingerprint[:12] in result.output and "rl-min" in result.output
    assert result.output.splitlines()[-1] == f"{GOOD}/rl_min.yaml: 0 errors, 0 warnings"


# ----------------------------------------------------------------------------------------- lint
def test_lint_skips_base_fragments(in_root):
    result = run("lint", GOOD)
    compiled = [compile_recipe(Path(f"{GOOD}/{n}")) for n in ("child.yaml", "rl_min.yaml", "sft_min.yaml")]
    assert "checked 3 recipes: " in result.output
    assert "(2 base fragments not linted as jobs)" in result.output
    assert result.exit_code == (1 if any(c.exit_status for c in compiled) else 0)


def test_lint_reports_every_bad_file_once(in_root):
    result = run("lint", BAD)
    assert result.exit_code == 1
    names = sorted(p.name for p in (ROOT / BAD).glob("*.yaml"))
    for name in names:
        assert f"{BAD}/{name}" in result.output, name
    # cycle_a and cycle_b each report the entry that closes their cycle; nothing is printed twice.
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error[")]
    warnings = [ln for ln in result.output.splitlines() if ln.startswith("warning[")]
    # Each diagnostic's header with its location: two rules may point at one key, but no diagnostic comes twice.
    arrows, header = [], ""
    for ln in result.output.splitlines():
        if ln.startswith(("error[", "warning[", "info[")):
            header = ln
        elif ln.startswith(" -->"):
            arrows.append((header, ln))
    assert len(arrows) == len(set(arrows)) >= len(errors)  # nothing printed twice
    # cycle_b.yaml names no job and cycle_a.yaml extends it: a fragment. Unreadable files are checked as jobs.
    assert result.output.splitlines()[-1] == (
        f"checked {len(names) - 1} recipes: {len(errors)} errors, {len(warnings)} warnings"
        " (1 base fragment not linted as jobs)")


def test_lint_treats_an_extended_file_without_a_name_as_a_fragment(tmp_path):
    (tmp_path / "shared.yaml").write_text("version: 1\nkind: rl\nmodel: {path: /m}\n")
    (tmp_path / "job.yaml").write_text("extends: shared.yaml\nname: job\nkind: rl\ndata: {prompts: p}\n")
    (tmp_path / "broken.yaml").write_text("a: [\n")
    result = run("lint", str(tmp_path))
    last = result.output.splitlines()[-1]
    assert last.startswith("checked 2 recipes: ") and last.endswith("(1 base fragment not linted as jobs)")
    assert "YAML001" in result.output and result.exit_code == 1
    assert "missing key `name`" not in result.output  # shared.yaml is not checked as a job


def test_lint_github_format(in_root):
    result = run("lint", f"{BAD}/tabs.yaml", "--format", "github")
    assert result.exit_code == 1
    assert result.output.startswith(f"::error file={BAD}/tabs.yaml,line=5,col=1,title=YAML002::")


# ----------------------------------------------------------------------------------------- schema
def test_committed_json_schema_is_current():
    committed = json.loads((ROOT / "schemas" / "recipe.schema.json").read_text())
    assert committed == recipe_json_schema(), "stale: run `molt-compile schema > schemas/recipe.schema.json`"


def test_schema_command_and_content():
    result = run("schema")
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["$id"] == "urn:molt-recipes:schema:recipe:v1" and schema["title"] == "Molt recipe v1"
    assert (schema["then"]["$ref"], schema["else"]["$ref"]) == ("#/$defs/SftRecipe", "#/$defs/RlRecipe")
    assert schema["if"]["properties"]["kind"] == {"const": "sft"}
    assert '"required": [' not in json.dumps({k: v for k, v in schema.items() if k != "if"})  # any key may be omitted
    rl_train = schema["$defs"]["RlTrain"]["properties"]
    assert "async" in rl_train and "async_" not in rl_train
    assert schema["$defs"]["AsyncCfg"]["properties"]["queue_size"]["description"].startswith("Depth of the rollout")
    assert schema["$defs"]["Cluster"]["additionalProperties"] is False


# ----------------------------------------------------------------------------------------- explain, rules, diff
def test_explain_shows_sources_and_docs(in_root):
    result = run("explain", f"{GOOD}/child.yaml", "--set", "train.async.force_sync=true")
    out = result.output
    row = next(ln for ln in out.splitlines() if "train.async.queue_size" in ln)
    assert "2" in row and f"{GOOD}/child.yaml:8" in row and "(over tests/data/good/base/common.yaml:14)" in row and "Depth of the" in row
    row = next(ln for ln in out.splitlines() if "train.async.force_sync" in ln)
    assert "--set" in row
    row = next(ln for ln in out.splitlines() if " model.attn " in ln)
    assert "sdpa" in row and "base/common.yaml:7" in row
    row = next(ln for ln in out.splitlines() if " rollout.temperature " in ln)
    assert "default" in row
    compiled = compile_recipe(Path(f"{GOOD}/child.yaml"), ["train.async.force_sync=true"], lower=False)
    if compiled.derived is not None:
        for dv in compiled.derived.values():
            assert dv.name in out
    assert result.exit_code == compiled.exit_status


def test_explain_lists_the_catalog_keys(in_root):
    """Issue 19: MODEL004's and MEM006's help send the user to `explain` for the catalog keys; it did not list them."""
    from schemas.catalog import GPUS, MODELS

    out = run("explain", f"{GOOD}/child.yaml").output
    catalog = out.split("model catalog: keys for model.arch")[1]
    rows = {ln.split("│")[1].strip() for ln in catalog.splitlines() if ln.count("│") > 2}
    assert set(MODELS) <= rows and set(GPUS) <= rows
    assert "GPU catalog: keys for cluster.gpu" in catalog


def test_explain_of_a_bad_recipe_prints_diagnostics(in_root):
    result = run("explain", f"{BAD}/typo_nested.yaml")
    assert result.exit_code == 1 and "SCHEMA001" in result.output
    assert "train.async.queue_size" in result.output  # the rest of the recipe is explained


def test_rules_documents_loader_codes():
    result = run("rules", "YAML005")
    assert result.output.startswith("YAML005 alias-expansion-too-large")
    assert "billion laughs" in result.output
    unknown = run("rules", "YAML999")
    assert unknown.exit_code == 2 and "did you mean" in unknown.output


def test_rules_lists_codes_or_says_the_catalog_is_missing():
    result = run("rules")
    assert "SCHEMA001" in result.output and "unknown-key" in result.output
    try:
        from molt_compile.rules import ALL_RULES
    except ImportError:
        assert result.exit_code == 2 and "not available" in result.output
    else:
        assert result.exit_code == 0
        for rule in ALL_RULES:
            assert rule.code in result.output


def test_diff_of_a_recipe_with_itself(in_root):
    result = run("diff", f"{GOOD}/rl_min.yaml", f"{GOOD}/rl_min.yaml")
    try:
        from molt_compile.diff import diff_results  # noqa: F401
    except ImportError:
        assert result.exit_code == 2 and "not available" in result.output
    else:
        assert result.exit_code == 0


def test_diff_of_an_unloadable_recipe(in_root):
    result = run("diff", f"{GOOD}/rl_min.yaml", f"{BAD}/tabs.yaml")
    assert result.exit_code == 2 and "YAML002" in result.output


def _raw_yaml(path: Path):
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(path.read_text())


def test_json_schema_accepts_every_shipped_recipe_file_as_an_editor_sees_it():
    import jsonschema

    files = sorted((ROOT / "recipes").rglob("*.yaml")) + sorted((ROOT / "tests" / "data" / "good").rglob("*.yaml"))
    assert files
    for path in files:  # the schema the file's modeline names (SFT recipes that inherit `kind: sft`: the SFT one)
        schema = recipe_json_schema("sft" if "recipe_sft.schema.json" in path.read_text().split("\n", 1)[0] else None)
        errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(_raw_yaml(path))]
        assert errors == [], (path, errors[:3])


def test_json_schema_flags_what_an_editor_should(in_root):
    import jsonschema

    validator = jsonschema.Draft202012Validator(recipe_json_schema())
    for name in ("typo_nested.yaml", "bad_enum.yaml", "wrong_type.yaml", "out_of_range.yaml", "version_2.yaml"):
        assert list(validator.iter_errors(_raw_yaml(ROOT / BAD / name))), name


# ----------------------------------------------------------------------------------------- compile_recipe
def test_a_crashing_pass_is_a_diagnostic_not_a_traceback(in_root, monkeypatch):
    import molt_compile.compile

    def broken_derive(recipe, source=None):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(molt_compile.compile, "derive", broken_derive)
    compiled = compile_recipe(Path(f"{GOOD}/rl_min.yaml"))
    assert compiled.exit_status == 2 and compiled.plan is None
    (d,) = [d for d in compiled.diagnostics if d.code == "INTERNAL001"]
    assert "derive pass failed: ZeroDivisionError: division by zero at test_cli.py:" in d.message
    result = run(f"{GOOD}/rl_min.yaml")
    assert result.exit_code == 2 and "error[INTERNAL001] internal-error" in result.output
    monkeypatch.setenv("MOLT_COMPILE_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        compile_recipe(Path(f"{GOOD}/rl_min.yaml"))


def test_passes_run_in_order_and_stop_at_blockers(in_root):
    ok = compile_recipe(Path(f"{GOOD}/rl_min.yaml"))
    assert ok.recipe is not None and ok.derived is not None and ok.plan is not None
    no_lower = compile_recipe(Path(f"{GOOD}/rl_min.yaml"), lower=False)
    assert no_lower.plan is None and no_lower.derived is not None and no_lower.exit_status == 0
    blocked = compile_recipe(Path(f"{BAD}/syntax_error.yaml"))
    assert blocked.recipe is None and blocked.derived is None and blocked.exit_status == 2
    recovered = compile_recipe(Path(f"{BAD}/typo_nested.yaml"))  # the typo dropped, the rules ran on the rest
    assert recovered.derived is not None and recovered.plan is None and recovered.exit_status == 1
    no_recipe = compile_recipe(Path(f"{BAD}/missing_key.yaml"))
    assert no_recipe.recipe is None and no_recipe.exit_status == 1
    rule_errors = compile_recipe(Path(f"{GOOD}/child.yaml"))
    assert rule_errors.exit_status == 1 and rule_errors.derived is not None and rule_errors.plan is None
    assert rule_errors.diagnostics == sorted(rule_errors.diagnostics, key=lambda d: d.sort_key())


def test_lint_checks_a_job_that_forgot_its_name(tmp_path):
    (tmp_path / "job.yaml").write_text("version: 1\nkind: rl\nmodel: {path: /m}\ndata: {prompts: p}\n")
    result = run("lint", str(tmp_path))
    assert result.exit_code == 1 and "missing required key `name`" in result.output
    assert result.output.splitlines()[-1].startswith("checked 1 recipe: ")


def test_rules_prints_one_rules_documentation():
    try:
        from molt_compile.rules import ALL_RULES
    except ImportError:
        assert run("rules", "AGENT001").exit_code == 2
        return
    import inspect

    rule = ALL_RULES[0]
    result = run("rules", rule.code.lower())
    assert result.exit_code == 0
    assert result.output.startswith(f"{rule.code} {rule.name} ({rule.severity})")
    assert inspect.cleandoc(rule.check.__doc__).splitlines()[0] in result.output


def test_schema_errors_and_rule_errors_are_reported_in_one_round(tmp_path):
    """Issue 30.3: a schema error hid every rule error and exited 2. Now the typo and the bad value are reported and
    dropped, the rules run on the rest, and the status is 1 (a recipe error); 2 stays for unusable input."""
    (tmp_path / "r.yaml").write_text(
        f"extends: {ROOT / GOOD / 'rl_min.yaml'}\nname: many\nactor:\n  mesh: {{tp: 3}}\n"
        "train: {microbatch_size: 2}\nalgo: {estimator: grpo2}\n")
    proc = _program(str(tmp_path / "r.yaml"), "--recipe-root", str(ROOT), text=True)
    headers = {ln.split("]")[0] for ln in proc.stdout.splitlines() if ln.startswith("error[")}
    assert {"error[SCHEMA001", "error[SCHEMA005", "error[PAR006"} <= headers, proc.stdout
    assert proc.returncode == 1 and proc.stderr == ""
    (tmp_path / "y.yaml").write_text("version: 1\nname: [\n")
    assert _program(str(tmp_path / "y.yaml")).returncode == 2  # YAML syntax: unusable input


def test_set_paths_are_relative_to_the_project_root_and_the_text_says_so(tmp_path):
    """Issue 30.6: `--set` paths resolved against the project root while `--help`, `rules AGENT002` and the fix
    said "working directory". The behaviour stays (the same plan from any directory); the text now agrees."""
    recipe = str(ROOT / "recipes" / "demo_math.yaml")
    import os

    def elsewhere(*args: str) -> subprocess.CompletedProcess:  # the program, run from another directory
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        return subprocess.run([sys.executable, "-m", "molt_compile.cli", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env)

    from_elsewhere = elsewhere(recipe, "--set", "agent.path=recipes/agents/demo_math_chat.py", "--format", "json")
    assert "AGENT002" not in from_elsewhere.stdout  # resolved against the project root, not tmp_path
    (tmp_path / "mine.py").write_text("")
    wrong = elsewhere(recipe, "--set", "agent.path=mine.py", "--format", "json")
    (d,) = [d for d in json.loads(wrong.stdout)["diagnostics"] if d["code"] == "AGENT002"]
    assert f"({ROOT / 'mine.py'})" in d["message"] and "the project root for --set" in d["help"]
    for text in (run("rules", "AGENT002").output, run("rules", "DATA003").output, (ROOT / "README.md").read_text()):
        assert "working directory for" not in text and "--set` paths are relative to the working" not in text
    for command in ("compile", "explain", "diff"):
        assert "relative to the project root" in " ".join(run(command, "--help").output.split()), command


def test_diff_takes_set_for_both_recipes(in_root):
    """Issue 30.8: `diff` had no `--set`."""
    a, b = f"{GOOD}/rl_min.yaml", "tests/data/good/child.yaml"
    same = run("diff", a, a, "--set", "train.batch_size=256")
    assert same.exit_code == 0, same.output
    changed = run("diff", a, b, "--set", "train.batch_size=256", "--format", "json")
    plain = run("diff", a, b, "--format", "json")
    assert changed.output != plain.output and "256" not in plain.output


def test_slurm_values_are_expanded_or_refused(in_root, tmp_path):
    """Issue 30.7: `$HOME` in `mounts` reached pyxis single-quoted; a bare `--mpi` took the next srun word;
    `partition: gpu batch` was accepted; a missing `output:` directory failed the job with no output."""
    recipe = tmp_path / "r.yaml"
    base = f"extends: {ROOT / GOOD / 'rl_min.yaml'}\nname: s\n"
    recipe.write_text(base + "launch: {slurm: {container_image: img, mounts: ['$HOME/data:/data', '~/x:/x'],"
                      " output: no_such_dir/%j.out}}\n")
    out = tmp_path / "job.sbatch"
    ok = run(str(recipe), "--recipe-root", str(ROOT), "--slurm", str(out))
    assert ok.exit_code == 0 and "warning[LAUNCH005]" in ok.output, ok.output
    line = next(ln for ln in out.read_text().splitlines() if "--container-mounts=" in ln)
    mounts = line.split("--container-mounts=")[1].split(" --container-workdir")[0]
    shown = subprocess.run(["bash", "-c", f"MOLT_ROOT=/p; printf %s {mounts}"], capture_output=True, text=True,
                           env={"HOME": "/home/u", "PATH": "/usr/bin:/bin"}).stdout
    assert shown == "/home/u/data:/data,/home/u/x:/x,/p:/p"
    recipe.write_text(base + "launch: {slurm: {partition: gpu batch, srun_options: [--mpi], account: $ACCT}}\n")
    bad = run(str(recipe), "--recipe-root", str(ROOT), "--format", "json")
    found = {(d["code"], d["path"]) for d in json.loads(bad.output)["diagnostics"] if d["severity"] == "error"}
    assert bad.exit_code == 1 and found == {("LAUNCH003", "launch.slurm.partition"),
                                            ("LAUNCH003", "launch.slurm.srun_options.0"),
                                            ("LAUNCH003", "launch.slurm.account")}


def test_wandb_has_an_offline_mode_and_a_misplaced_key_names_its_section(in_root, tmp_path):
    """Issue 30.8: `logging.wandb` had no mode key, and SCHEMA001's hint for it pointed at `actor.loss`."""
    ok = run(f"{GOOD}/rl_min.yaml", "--set", "logging.wandb={project: p, mode: offline}", "--format", "json")
    assert json.loads(ok.output)["plan"]["recipe"]["logging"]["wandb"]["mode"] == "offline"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"extends: {ROOT / GOOD / 'rl_min.yaml'}\nname: w\nlogging: {{wandb: {{project: p, "
                      "estimator: grpo}}\n")
    (d,) = [d for d in json.loads(run(str(recipe), "--recipe-root", str(ROOT), "--format", "json").output)[
        "diagnostics"] if d["code"] == "SCHEMA001"]
    assert d["help"].startswith("`logging.wandb` has: project, entity, group, run_name, key, mode;"), d["help"]


def test_rules_and_explain_print_brackets_and_whole_sentences(in_root):
    """Issue 30.8: rich markup ate `[low, high]` in `explain` and `rules`, and the `rules` table cut sentences
    where the docstring wrapped."""
    from molt_compile.rules import catalog

    assert "[low, high]" in run("rules").output
    assert "[low, high]" in run("explain", "recipes/demo_math.yaml", "algo.is_correction").output
    cut = [c.code for c in catalog().values() if not c.summary.rstrip("`)").endswith((".", "?", "!"))]
    assert cut == []


def test_lint_of_no_recipe_is_a_usage_error(tmp_path):
    """Issue 30.8: `lint` of an empty directory exited 0, so a CI job with a mistyped path passed."""
    result = run("lint", str(tmp_path))
    assert result.exit_code == 2 and "no *.yaml or *.yml recipe" in result.output


def test_shell_completion_offers_file_names(in_root):
    """Issue 30.8: the completion line in the README and `--help` disabled file-name completion: click offered only
    subcommands, and bash's `complete -F` without `-o default` then completes nothing else."""
    import os

    def complete(words: str) -> list[str]:
        env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(len(words.split()) - 1),
               "_MOLT_COMPILE_COMPLETE": "bash_complete"}
        return _program(env=env, text=True).stdout.split()

    assert complete("molt-compile reci") == ["file,reci"]  # a recipe as the first word: bash completes paths
    assert complete("molt-compile li") == ["file,li", "plain,lint"]
    for command in ("lint", "explain", "diff", "compile"):
        assert complete(f"molt-compile {command} rec") == ["file,rec"], command


def test_the_memory_table_has_a_row_for_hf_engines(in_root, tmp_path):
    """Issue 30.8: `rollout.engine: hf` had no row: a 30B model's bf16 weights (~57 GiB) sit whole on each engine GPU."""
    from molt_compile.memory import GIB, memory_report

    out = run(f"{GOOD}/rl_min.yaml", "--set", "rollout.engine=hf").output
    (row,) = [ln for ln in out.splitlines() if "rollout.engine (HF)" in ln]
    assert "weights 7.5 GiB" in row and "KV cache not estimated" in row
    recipe = tmp_path / "moe.yaml"
    recipe.write_text(f"extends: {ROOT / GOOD / 'rl_min.yaml'}\nname: hf30\nmodel: {{path: /m, arch: qwen3-30b-a3b}}\n"
                      "rollout: {engine: hf}\n")
    result = compile_recipe(recipe, lower=False, roots=[ROOT])
    weights = memory_report(result.recipe, result.derived, result.source).hf_engine_weights / GIB
    assert 56 < weights < 58


def test_a_large_job_without_checkpoints_gets_a_note(in_root):
    """Issue 30.8: a 32-GPU job with `ckpt.every: -1` saved nothing before its end, silently."""
    out = run("tests/rules/CKPT005_1.yaml").output
    assert "info[CKPT005] large-job-without-checkpoints: a 32-GPU job with ckpt.every -1" in out
    assert "[CKPT005]" not in run("tests/rules/CKPT005_ok.yaml").output
