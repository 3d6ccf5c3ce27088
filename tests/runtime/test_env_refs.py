"""Issue 32, item 3: `${env:NAME}` references reach the actors resolved, and an unset one stops the job at start.

On a compiled plan (the demo recipe with a secret in the job env and in `agent.env`): the env every actor gets
(`role_options`' runtime_env, the agent runners' argument) holds the value, not the reference text; the plan file
keeps the reference; `python -m runtime` exits 2 before Ray starts, naming the unset variable.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from loop_support import ROOT, compile_plan

from runtime import env_refs
from runtime.roles import role_options

SETS = ("env.HUB_TOKEN='${env:MOLT_TEST_HUB}'", "agent.env.JUDGE_KEY='k-${env:MOLT_TEST_JUDGE}'")


def test_resolve_substitutes_keeps_launcher_values_and_names_the_unset_one():
    env = {"A": "${env:X}", "B": "pre-${env:Y}-post", "C": "plain"}
    assert env_refs.resolve(env, {"X": "1", "Y": "2"}, "env") == {"A": "1", "B": "pre-2-post", "C": "plain"}
    # the Slurm script / --submit resolved A already; X itself is not set where the driver runs
    assert env_refs.resolve({"A": "${env:X}"}, {"A": "s3cr3t"}, "env", launcher_resolved=True) == {"A": "s3cr3t"}
    with pytest.raises(env_refs.UnsetReference, match=r"env\.B refers to \$\{env:Y\}"):
        env_refs.resolve(env, {"X": "1"}, "env")
    with pytest.raises(env_refs.UnsetReference):  # a leftover literal is no resolved value
        env_refs.resolve({"A": "${env:X}"}, {"A": "${env:X}"}, "env", launcher_resolved=True)


def test_actors_get_the_values_and_the_plan_keeps_the_references(monkeypatch):
    plan = compile_plan("recipes/demo_math.yaml", *SETS)
    monkeypatch.setenv("MOLT_TEST_HUB", "hub-value")
    monkeypatch.setenv("MOLT_TEST_JUDGE", "judge-value")
    job = env_refs.driver_env(plan, os.environ)
    assert job["HUB_TOKEN"] == "hub-value" and job["JUDGE_KEY"] == "k-judge-value"
    for key, value in job.items():  # what __main__ does before ray.init; the restart case is the same call
        monkeypatch.setenv(key, value)
    runner_env = role_options(plan, "runner")["runtime_env"]["env_vars"]
    assert runner_env["JUDGE_KEY"] == "k-judge-value"
    assert env_refs.for_actors(plan.rl.agent.env)["JUDGE_KEY"] == "k-judge-value"
    assert "hub-value" not in plan.to_json() and "${env:MOLT_TEST_HUB}" in plan.to_json()


def test_an_unset_reference_stops_the_entrypoint_by_name(tmp_path):
    plan = compile_plan("recipes/demo_math.yaml", *SETS)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    env = {k: v for k, v in os.environ.items() if k not in ("MOLT_TEST_HUB", "MOLT_TEST_JUDGE", "RAY_ADDRESS")}
    env["MOLT_TEST_HUB"] = "hub-value"
    proc = subprocess.run([sys.executable, "-m", "runtime", str(plan_file)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "${env:MOLT_TEST_JUDGE}" in proc.stderr and "not set" in proc.stderr
