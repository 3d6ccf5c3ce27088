"""Launcher test fixtures: plans to launch, the test Slurm (two simulated nodes), and a Ray head on loopback.

Every cluster here is started by the tests and torn down by them, by pid: the Slurm of `.ci/slurm_up.sh`
(shared by concurrent sessions through its holder list) and `ray start --head --block` children whose SIGTERM
makes Ray stop their own processes. Ports are away from Ray's defaults; resources are small (2-core machines).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from schemas.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
VENV_BIN = Path(sys.executable).parent


def compile_plan(recipe: Path | str, sets: tuple[str, ...] = ()) -> Plan:
    """The plan of a recipe, compiled from the project root (plan paths are relative to it). Without the capability
    pass: launcher tests render and submit plans of recipes this runtime may not run (their entrypoints are checks)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        result = compile_recipe(Path(recipe), sets, capabilities=False)
    finally:
        os.chdir(cwd)
    assert result.plan is not None, [f"{d.code} {d.message}" for d in result.diagnostics]
    return result.plan


def with_entrypoint(plan: Plan, argv: list[str]) -> Plan:
    """The same plan with another entrypoint (re-fingerprinted): launcher tests run a check instead of training."""
    return plan.model_copy(update={"entrypoint": argv}).with_fingerprint()


@pytest.fixture(scope="session")
def cpu_plan() -> Plan:
    """tests/launch/data/cpu_two_nodes.yaml: a CPU plan over two nodes (3 CPUs and 2 device slots each)."""
    return compile_plan(DATA / "cpu_two_nodes.yaml")


@pytest.fixture(scope="session")
def demo_plan() -> Plan:
    """recipes/demo_math.yaml: the one-node CPU demo."""
    return compile_plan("recipes/demo_math.yaml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ Slurm
@dataclass
class Slurm:
    conf: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for sbatch/squeue: this Slurm's config, and the venv first on PATH (jobs inherit it)."""
        env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": f"{VENV_BIN}:/usr/sbin:{os.environ['PATH']}"}
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="session")
def slurm() -> Iterator[Slurm]:
    """A real Slurm (slurmctld, two `slurmd -N`, munge) from .ci/slurm_up.sh; stopped at the end of the session
    unless another session still holds it."""
    holder = str(os.getpid())
    up = subprocess.run([str(ROOT / ".ci" / "slurm_up.sh"), "--holder", holder], capture_output=True, text=True,
                        timeout=600)
    assert up.returncode == 0, f"slurm_up.sh failed:\n{up.stdout}\n{up.stderr}"
    conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout)
    assert conf, up.stdout
    try:
        yield Slurm(conf=Path(conf.group(1)))
    finally:
        subprocess.run([str(ROOT / ".ci" / "slurm_down.sh"), "--holder", holder], capture_output=True, timeout=120)


# ------------------------------------------------------------------------------------------------ Ray head
@dataclass
class RayHead:
    address: str          # http://127.0.0.1:PORT, the Jobs API
    gcs: str              # 127.0.0.1:PORT
    token: str
    proc: subprocess.Popen
    temp_dir: Path


# Ray 2.60 gives its raylet a fixed 30 s to register with the GCS (`_private/node.py`, not configurable); on a
# two-core machine running other Ray jobs that can pass, and `ray start` exits "timed out during startup".
HEAD_START_ATTEMPTS = 3


def start_ray_head(tmp: Path, *, num_cpus: int, resources: dict[str, float], timeout: float = 240) -> RayHead:
    """`ray start --head --block` on loopback: non-default ports, its own temp dir, token auth with a fresh token;
    started again (fresh ports and temp dir) when the raylet's registration timed out."""
    for attempt in range(1, HEAD_START_ATTEMPTS + 1):
        try:
            return _start_ray_head(tmp, num_cpus=num_cpus, resources=resources, timeout=timeout)
        except _RegistrationTimedOut:
            if attempt == HEAD_START_ATTEMPTS:
                raise AssertionError("the Ray head's raylet did not register in three attempts:\n"
                                     + (tmp / "ray-head.log").read_text()[-3000:]) from None
    raise AssertionError("unreachable")


class _RegistrationTimedOut(Exception):
    pass


def _start_ray_head(tmp: Path, *, num_cpus: int, resources: dict[str, float], timeout: float) -> RayHead:
    import json

    token = secrets.token_hex(16)
    temp_dir = Path(f"/tmp/mlt-rh-{secrets.token_hex(3)}")  # short: Ray's socket paths must stay < 108 bytes
    gcs_port, dash_port = free_port(), free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_agent_register_timeout_ms": "300000", "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}  # jobs' python
    cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", f"--port={gcs_port}",
           f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(resources)}",
           f"--temp-dir={temp_dir}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
           f"--dashboard-port={dash_port}", f"--ray-client-server-port={free_port()}",
           f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"]
    log = (tmp / "ray-head.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    head = RayHead(address=f"http://127.0.0.1:{dash_port}", gcs=f"127.0.0.1:{gcs_port}", token=token, proc=proc,
                   temp_dir=temp_dir)
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:  # ready when the Jobs API answers an authenticated request and lists the head node alive
        if proc.poll() is not None:
            text = (tmp / "ray-head.log").read_text()
            shutil.rmtree(temp_dir, ignore_errors=True)
            if "timed out during startup" in text:
                raise _RegistrationTimedOut()
            raise AssertionError(text[-3000:])
        try:
            req = urllib.request.Request(f"{head.address}/api/v0/nodes?detail=false",
                                         headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                if b'"ALIVE"' in resp.read():
                    return head
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_ray_head(head)
            raise AssertionError("the Ray head did not come up:\n" + (tmp / "ray-head.log").read_text()[-3000:])
        time.sleep(1)


def stop_ray_head(head: RayHead) -> None:
    if head.proc.poll() is None:
        head.proc.send_signal(signal.SIGTERM)
        try:
            head.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.proc.pid, signal.SIGKILL)
            head.proc.wait()
    shutil.rmtree(head.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory, demo_plan: Plan) -> Iterator[RayHead]:
    """A Ray head sized for the demo plan (CPU 5, device_slot 3), with the Jobs API on loopback."""
    res = dict(demo_plan.cluster.node_resources)
    head = start_ray_head(tmp_path_factory.mktemp("rayhead"), num_cpus=int(res.pop("CPU")), resources=res)
    try:
        yield head
    finally:
        stop_ray_head(head)
