"""`--submit`: the Ray Jobs API against a real `ray start --head` on loopback (token auth on), the local cluster
started for a plan, and the clear errors (wrong address, missing or wrong token, too small a cluster, a plan a
local machine cannot run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from molt_compile import job_launch, local_cluster
from molt_compile.submit import submit
from schemas.plan import Plan

from .conftest import ROOT, compile_plan, free_port, with_entrypoint

# A job that proves what it got: the plan file travelled with the working dir, the job env arrived.
CHECK = ("import json, os, sys; plan = json.load(open(sys.argv[1])); "
         "print('MOLT-JOB', plan['name'], plan['fingerprint'][:12], 'turns=' + os.environ['MAX_AGENT_TURNS']); "
         "sys.exit(int(os.environ.get('MOLT_TEST_EXIT', '0')))")


def _job_plan(demo_plan: Plan, exit_code: int = 0) -> Plan:
    plan = with_entrypoint(demo_plan, ["python", "-c", CHECK, "{plan_file}"])
    if exit_code:
        plan = plan.model_copy(update={"env": {**plan.env, "MOLT_TEST_EXIT": str(exit_code)}}).with_fingerprint()
    return plan


@pytest.fixture
def token_env(monkeypatch, ray_head, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token: the token comes only from the env
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.token)
    return ray_head


@pytest.mark.slow
def test_submit_then_status_and_logs(token_env, demo_plan: Plan, capsys) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    plan = _job_plan(demo_plan)
    assert submit(plan, address=token_env.address, follow=False) == 0
    out = capsys.readouterr().out
    job_id = out.split("submitted ", 1)[1].split()[0]
    assert job_id.startswith(f"{plan.name}-{plan.fingerprint[:12]}-") and len(job_id.rsplit("-", 1)[1]) == 6
    assert f"ray job logs --address {token_env.address} --follow {job_id}" in out
    client = JobSubmissionClient(token_env.address, headers={"Authorization": f"Bearer {token_env.token}"})
    deadline = time.monotonic() + 300
    while not client.get_job_status(job_id).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job_id)
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs
    assert f"MOLT-JOB {plan.name} {plan.fingerprint[:12]} turns=1" in logs
    info = client.get_job_info(job_id)
    assert info.metadata["molt.fingerprint"] == plan.fingerprint
    assert f".molt/plans/{plan.name}-{plan.fingerprint[:12]}.json" in info.entrypoint


@pytest.mark.slow
def test_follow_streams_logs_and_returns_a_failed_jobs_status(token_env, demo_plan: Plan, capsys) -> None:
    plan = _job_plan(demo_plan, exit_code=3)
    status = submit(plan, address=token_env.address, follow=True)
    out = capsys.readouterr().out
    assert status == 1, out
    assert f"MOLT-JOB {plan.name} {plan.fingerprint[:12]} turns=1" in out
    assert ": FAILED" in out


@pytest.mark.slow
def test_wrong_address_is_a_clear_error(token_env, demo_plan: Plan, capsys) -> None:
    assert submit(demo_plan, address=f"http://127.0.0.1:{free_port()}", follow=False) == 2
    err = capsys.readouterr().err
    assert "cannot reach a Ray dashboard at http://127.0.0.1:" in err and "help:" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_missing_and_wrong_tokens_are_clear_errors(token_env, demo_plan: Plan, monkeypatch, capsys) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    assert submit(demo_plan, address=token_env.address, follow=False) == 2
    err = capsys.readouterr().err
    assert "requires an auth token and none was sent" in err and "RAY_AUTH_TOKEN" in err
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    assert submit(demo_plan, address=token_env.address, follow=False) == 2
    assert "refused the auth token" in capsys.readouterr().err
    # The token file Ray writes (~/.ray/auth_token) works as well as the variable.
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    token_file = Path(os.environ["HOME"]) / ".ray" / "auth_token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text(token_env.token + "\n")
    assert job_launch.auth_token() == token_env.token


@pytest.mark.slow
def test_a_cluster_too_small_for_the_plan_is_refused_before_submitting(token_env, capsys) -> None:
    plan = compile_plan("recipes/qwen3_4b_math.yaml")  # 16 GPUs on 2 nodes
    assert submit(plan, address=token_env.address, follow=False) == 2
    err = capsys.readouterr().err
    assert "cannot run qwen3-4b-math" in err and "GPU 0 of the 16 the job takes" in err
    assert "the plan needs 2 node(s) with CPU 224, GPU 8 each" in err


# ------------------------------------------------------------------------------------------------ local
def _ray_processes_in(temp_prefix: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if temp_prefix in line]


@pytest.mark.slow
def test_local_submit_runs_the_job_on_a_cluster_it_starts_and_stops(demo_plan: Plan, monkeypatch, capfd) -> None:
    monkeypatch.chdir(ROOT)
    started: list[local_cluster.LocalCluster] = []
    real_init = local_cluster.LocalCluster.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        started.append(self)

    monkeypatch.setattr(local_cluster.LocalCluster, "__init__", spy)
    real_start = local_cluster.LocalCluster.start

    def head_dies_once(self):  # the first head dies while starting (as one that misses Ray's start-up deadline)
        real_start(self)
        if len(started) == 1:
            self.proc.kill()

    monkeypatch.setattr(local_cluster.LocalCluster, "start", head_dies_once)
    plan = _job_plan(demo_plan, exit_code=5)
    assert submit(plan, address=None, follow=False) == 5
    out, err = capfd.readouterr()
    assert f"MOLT-JOB {plan.name} {plan.fingerprint[:12]} turns=1" in out
    assert "starting a local Ray cluster for demo-math (CPU 5, device_slot 3)" in err
    assert ("the local Ray head did not start (the head exited with status -9 while starting: (no output)); "
            "retrying with fresh ports (attempt 2 of 3)") in err
    assert "preflight: ready" in out and "1/1 nodes, CPU 5/5, device_slot 3/3" in out
    assert "exited with status 5" in err and "stopping the local Ray cluster" in err
    first, cluster = started
    assert not first.temp_dir.exists() and first.port != cluster.port  # a fresh start, the failed one cleaned up
    assert cluster.proc is not None and cluster.proc.poll() is not None  # the head was stopped ...
    assert _ray_processes_in(str(cluster.temp_dir)) == []  # ... and every process of it is gone
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)  # kept for a failed job (status 5); ours to remove


def test_a_local_head_that_keeps_dying_is_retried_then_a_clear_error(demo_plan: Plan, monkeypatch, capfd) -> None:
    """Every `ray start --head` dies while starting: 3 attempts, one line each, then what to do; no traceback."""
    monkeypatch.chdir(ROOT)
    heads: list[local_cluster.LocalCluster] = []
    real_start = local_cluster.LocalCluster.start

    def head_dies(self):
        real_start(self)
        heads.append(self)
        self.proc.kill()

    monkeypatch.setattr(local_cluster.LocalCluster, "start", head_dies)
    assert submit(_job_plan(demo_plan), address=None, follow=False) == 2
    err = capfd.readouterr().err
    assert len(heads) == local_cluster.START_ATTEMPTS == 3
    assert err.count("the local Ray head did not start") == 2 and "(attempt 3 of 3)" in err
    assert ("error: the local Ray cluster did not start in 3 attempts; the last one: the head exited with "
            "status -9 while starting") in err
    assert "help: Ray's start-up deadlines are too short for this machine's load now" in err
    assert f"The head's logs: {heads[-1].temp_dir}" in err and "Traceback" not in err and "MOLT-JOB" not in err
    assert [h.temp_dir.exists() for h in heads] == [False, False, True]  # only the last head's logs are kept
    shutil.rmtree(heads[-1].temp_dir)


# The end of what `ray start --head` printed when the raylet missed its start-up deadline on a loaded machine.
HEAD_TRACEBACK = """\
2026-11-30 10:01:02,345	INFO scripts.py:1043 -- Local node IP: 127.0.0.1
Traceback (most recent call last):
  File "/venv/bin/ray", line 8, in <module>
    sys.exit(main())
  File "/venv/lib/python3.11/site-packages/ray/scripts/scripts.py", line 1074, in start
    node = ray._private.node.Node(
  File "/venv/lib/python3.11/site-packages/ray/_private/node.py", line 438, in __init__
    raise Exception(
Exception: The current node timed out during startup. This could happen because some of the raylet failed to \
startup or the GCS has become overloaded.
"""


def test_a_head_failure_is_one_line_not_its_traceback() -> None:
    assert local_cluster.head_failure(HEAD_TRACEBACK) == (
        "Exception: The current node timed out during startup. This could happen because some of the raylet "
        "failed to startup or the GCS has become overloaded.")
    assert local_cluster.head_failure("RuntimeError: Failed to start GCS.  Last 1 lines of error files:\n[...] "
                                   "Check failed\n") == "RuntimeError: Failed to start GCS.  Last 1 lines of error files:"
    assert local_cluster.head_failure("") == "(no output)"


def test_local_submit_refuses_plans_this_machine_cannot_run(cpu_plan: Plan, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert submit(cpu_plan, address=None, follow=False) == 2
    assert "needs 2 nodes; a local cluster is this one machine" in capsys.readouterr().err
    gpu_plan = compile_plan("recipes/sft_qwen3_4b_quickstart.yaml")
    assert submit(gpu_plan, address=None, follow=False) == 2
    err = capsys.readouterr().err
    assert "needs 8 GPU(s) (h100-80gb); this machine has 0" in err and "help:" in err


def test_env_references_resolve_from_the_submitting_environment(demo_plan: Plan, monkeypatch, capsys) -> None:
    env = {"WANDB_API_KEY": "${env:MOLT_TEST_KEY}", "PLAIN": "$HOME"}
    monkeypatch.setenv("MOLT_TEST_KEY", "k3y")
    assert job_launch.resolve_env(env) == {"WANDB_API_KEY": "k3y", "PLAIN": "$HOME"}
    monkeypatch.delenv("MOLT_TEST_KEY")
    plan = demo_plan.model_copy(update={"env": {**demo_plan.env, **env}}).with_fingerprint()
    assert submit(plan, address="http://127.0.0.1:1", follow=False) == 2
    assert "env.WANDB_API_KEY refers to ${env:MOLT_TEST_KEY}, which is not set here" in capsys.readouterr().err


@pytest.mark.slow
def test_preflight_times_out_with_what_it_sees_and_what_the_plan_needs(ray_head, cpu_plan: Plan,
                                                                       tmp_path: Path) -> None:
    import os
    import sys

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(cpu_plan.to_json())  # needs two nodes; the head is one
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_head.token}
    res = subprocess.run([sys.executable, "-m", "runtime.preflight", str(plan_file), "--address", ray_head.gcs,
                          "--timeout", "5"], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "error: after 5 s the cluster still lacks: 1 of the 2 nodes with CPU 3, device_slot 2 each" in res.stdout
    assert "The plan needs 2 node(s) with CPU 3, device_slot 2 each; Ray sees:" in res.stdout
    assert "alive  5    3" in res.stdout  # the head: CPU 5, device_slot 3 (more per node, but one node)


@pytest.mark.slow
def test_cli_submit_trains_the_demo_locally(monkeypatch, capfd, tmp_path) -> None:
    """`molt-compile recipes/demo_math.yaml --submit` as a new user runs it (shortened to three steps): a local
    cluster, the real runtime with the vLLM-cpu engine, exit status 0, the cluster gone afterwards. Submitted
    from another directory (issue 19: `cd /tmp && molt-compile fresh/recipes/demo_math.yaml`): the job runs from
    the project root, where the plan's paths start."""
    import os

    from click.testing import CliRunner

    from molt_compile.cli import cli

    monkeypatch.chdir(tmp_path)
    started: list[local_cluster.LocalCluster] = []
    real_start = local_cluster.LocalCluster.start

    def spy(self):
        started.append(self)
        real_start(self)

    monkeypatch.setattr(local_cluster.LocalCluster, "start", spy)
    out_dir = ROOT / "runs" / "launch-cli-demo"
    shutil.rmtree(out_dir, ignore_errors=True)
    result = CliRunner().invoke(cli, [
        os.path.relpath(ROOT / "recipes" / "demo_math.yaml"), "--submit", "--set", "name=launch-cli-demo", "--set", "data.max_samples=24",
        "--set", "eval.dataset=null", "--set", "ckpt.every=-1", "--set", "ckpt.final_save=false",
        "--set", "logging.tensorboard_dir=null"], prog_name="molt-compile")
    out, err = capfd.readouterr()
    try:
        assert result.exit_code == 0, result.output + out + err
        assert "finished at step 3" in out
        assert len((out_dir / "metrics.jsonl").read_text().splitlines()) == 3
        assert "stopping the local Ray cluster" in result.output + err  # CliRunner captures sys.stderr
        (cluster,) = started
        assert _ray_processes_in(str(cluster.temp_dir)) == [] and not cluster.temp_dir.exists()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
