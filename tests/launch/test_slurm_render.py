"""The rendered sbatch script: its #SBATCH lines, counts and ports come from the plan; it parses (`bash -n`) for
every shipped recipe; the plan it carries is the plan."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from molt_compile.slurm import (
    PORT_BLOCK,
    SlurmRenderError,
    command_words,
    env_value,
    node_ports,
    render_sbatch,
    shell_quote,
)
from schemas.plan import Plan

from .conftest import ROOT, compile_plan


def _with_slurm(plan: Plan, **settings) -> Plan:
    recipe = dict(plan.recipe)
    recipe["launch"] = {**recipe["launch"], "slurm": {**recipe["launch"]["slurm"], **settings}}
    return plan.model_copy(update={"recipe": recipe}).with_fingerprint()


def _sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def _bash_n(script: str, tmp_path: Path) -> None:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_cpu_plan_header_has_counts_from_the_plan_and_no_gpus(cpu_plan: Plan) -> None:
    lines = _sbatch_lines(render_sbatch(cpu_plan))
    assert lines == ["#SBATCH --job-name=demo-math", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --exclusive", "#SBATCH --time=00:20:00"]


def test_gpu_plan_header_asks_for_the_plans_gpus_per_node() -> None:
    plan = compile_plan("recipes/qwen3_4b_math.yaml")
    lines = _sbatch_lines(render_sbatch(plan))
    assert f"#SBATCH --nodes={plan.cluster.nodes}" in lines
    assert f"#SBATCH --gpus-per-node={plan.cluster.gpus_per_node}" in lines
    assert not any("--account" in line or "--partition" in line for line in lines)


def test_account_partition_and_container_appear_only_when_set(cpu_plan: Plan) -> None:
    plan = _with_slurm(cpu_plan, account="proj-17", partition="batch", container_image="nvcr.io#nvidia/molt:1",
                       mounts=["/lustre:/lustre"])
    script = render_sbatch(plan)
    lines = _sbatch_lines(script)
    assert "#SBATCH --account=proj-17" in lines and "#SBATCH --partition=batch" in lines
    assert "--container-image='nvcr.io#nvidia/molt:1'" in script
    assert """--container-mounts=/lustre:/lustre,"$MOLT_ROOT:$MOLT_ROOT\"""" in script
    # One container per node for the whole job: every step names the same one (pyxis reuses it).
    steps = [line for line in script.splitlines() if "--container-image" in line]
    assert len(steps) >= 2 and all('--container-name="molt-$SLURM_JOB_ID"' in line for line in steps)
    assert "--container-" not in render_sbatch(cpu_plan)


def test_recipe_sbatch_and_srun_options_are_rendered(cpu_plan: Plan, tmp_path: Path) -> None:
    plan = _with_slurm(cpu_plan, qos="high", constraint="h100&ib", mem="0", output="logs/%x-%j.out",
                       error="logs/%x-%j.err", exclusive=False, sbatch_options=["--requeue", "--comment=a b"],
                       srun_options=["--mpi=none"])
    script = render_sbatch(plan)
    lines = _sbatch_lines(script)
    assert lines[-7:] == ["#SBATCH --qos=high", "#SBATCH --constraint='h100&ib'", "#SBATCH --mem=0",
                          "#SBATCH --output=logs/%x-%j.out", "#SBATCH --error=logs/%x-%j.err", "#SBATCH --requeue",
                          "#SBATCH '--comment=a b'"]
    assert "#SBATCH --exclusive" not in lines
    steps = [line for line in script.splitlines() if line.lstrip().startswith(("srun", "STEP=(srun"))
             and "--overlap" in line and "--exclude" not in line]
    assert steps and all("--mpi=none" in line for line in steps)
    _bash_n(script, tmp_path)


def test_requeue_asks_slurm_for_the_signal_and_requeues_on_the_runs_status(cpu_plan: Plan, tmp_path: Path) -> None:
    assert "USR1" not in render_sbatch(cpu_plan)
    script = render_sbatch(_with_slurm(cpu_plan, requeue=True, requeue_signal_s=420))
    assert {"#SBATCH --requeue", "#SBATCH --signal=B:USR1@420"} <= set(_sbatch_lines(script))
    assert 'trap requeue_now USR1' in script and '[ "$rc" = 75 ]' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    _bash_n(script, tmp_path)


def test_ray_start_declares_exactly_the_plans_node_resources(cpu_plan: Plan) -> None:
    script = render_sbatch(cpu_plan)
    assert "--num-cpus=3 --num-gpus=0" in script
    assert """--resources='{"device_slot":2.0}'""" in script
    assert "#SBATCH --gpus-per-node" not in script


def test_embedded_plan_is_the_plan(cpu_plan: Plan) -> None:
    script = render_sbatch(cpu_plan)
    m = re.search(r"<<'(MOLT_PLAN_END_\w+)'\n(.*?)\n\1\n", script, re.S)
    assert m, "no plan heredoc"
    assert m.group(2) + "\n" == cpu_plan.to_json()
    assert Plan.from_json(m.group(2)) == cpu_plan


def test_every_shipped_recipe_renders_a_script_bash_accepts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    rendered = 0
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        result = compile_recipe(recipe.relative_to(ROOT), capabilities=False)
        if result.plan is None:
            continue  # recipes with rule errors have no plan (their own tests cover them)
        script = render_sbatch(result.plan)
        _bash_n(script, tmp_path)
        assert f"#SBATCH --nodes={result.plan.cluster.nodes}" in script
        if result.plan.kind == "sft":
            assert "torchrun-node" in script and "ray start" not in script
            assert '--node-rank "${NODE_RANK}"' in script and '--master-addr "${MASTER_ADDR}"' in script
        else:
            assert "python -m runtime.preflight" in script
        rendered += 1
    assert rendered >= 5


def test_node_ports_are_distinct_and_avoid_gcs_and_dashboard() -> None:
    table = node_ports(6379, 8265, 36)
    every = [p for name, ports in table.items() if name not in ("min_worker", "max_worker") for p in ports]
    worker_ranges = list(zip(table["min_worker"], table["max_worker"], strict=True))
    for lo, hi in worker_ranges:
        every += range(lo, hi + 1)
    assert len(every) == len(set(every)), "two nodes share a port"
    assert 6379 not in every and 8265 not in every
    assert all(hi - lo + 1 == PORT_BLOCK - 10 for lo, hi in worker_ranges)


def test_ports_past_65535_are_a_clear_error() -> None:
    with pytest.raises(SlurmRenderError, match="launch.slurm.ray_port"):
        node_ports(65000, 8265, 4)


def test_shell_quote_round_trips_through_bash() -> None:
    values = ["plain", "", "it's", 'dq " and \\ backslash', "$(id)", "`id`", "a\nb", "tab\there", "\x1b[31m",
              "ünïcødé ✓", "-n", "*", "~root"]
    for value in values:
        out = subprocess.run(["bash", "-c", f"printf '%s' {shell_quote(value)}"], capture_output=True, text=True)
        assert out.stdout == value, (value, shell_quote(value))
        assert "\n" not in shell_quote(value)


def test_env_references_expand_at_run_time_and_literals_stay_literal() -> None:
    word = env_value("Bearer ${env:MOLT_TEST_SECRET} $(touch x)")
    out = subprocess.run(["bash", "-c", f"printf '%s' {word}"], capture_output=True, text=True,
                         env={"MOLT_TEST_SECRET": "s3cr3t", "PATH": "/usr/bin:/bin"})
    assert out.stdout == "Bearer s3cr3t $(touch x)"
    missing = subprocess.run(["bash", "-c", f"printf '%s' {word}"], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin"})
    assert missing.returncode != 0 and "MOLT_TEST_SECRET: must be set" in missing.stderr


def test_command_words_substitute_placeholders_only() -> None:
    words = command_words(["torchrun", "--node-rank", "{node_rank}", "x={node_rank}-{plan_file}", "'{nope}'"],
                          {"{node_rank}": "NODE_RANK", "{plan_file}": "PLAN_FILE"})
    out = subprocess.run(["bash", "-c", f'NODE_RANK=3 PLAN_FILE="p q.json"; printf "%s|" {words}'],
                         capture_output=True, text=True)
    assert out.stdout == "torchrun|--node-rank|3|x=3-p q.json|'{nope}'|"
