"""`molt-compile RECIPE --submit` without an address (the default for a new user): a local Ray cluster sized from
the plan (`ray start --head` with the plan's node resources, free ports, its own temp dir and auth token), the same
readiness barrier as the Slurm script (`python -m runtime.preflight`), then the entrypoint as a child process
connected to it; the cluster is stopped at the end. A head that dies or is not ready while starting is started
again (START_ATTEMPTS, fresh ports). SFT plans run under torchrun on this machine, without Ray.

A child process rather than a local Jobs API submission: no dashboard or job supervisor to start (~0.7 GB and ~7 s on
a small machine), no upload of the project (the job runs in place and writes its outputs where the recipe says), the
terminal shows the runtime's own progress display, Ctrl-C reaches the job directly, and its exit status is the job's
(128 + N when its driver was killed by signal N, 1 when the local Ray head died under it; see `job_exit`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from molt_compile.job_launch import (
    LAUNCH_FAILED,
    LaunchError,
    Terminated,
    entrypoint_command,
    resolve_env,
    say,
    signals_as_interrupt,
    write_plan_file,
)
from schemas.plan import PLAN_FILE_PLACEHOLDER, Plan
from schemas.ports import free_port

START_ATTEMPTS = 3
"""Starts of a local Ray head before giving up (the Slurm script's `ray start` tries as often)."""


def _local_gpus() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _check_local(plan: Plan) -> None:
    if plan.cluster.nodes > 1:
        raise LaunchError(
            f"{plan.name} needs {plan.cluster.nodes} nodes; a local cluster is this one machine",
            "run it on a cluster: --slurm job.sbatch && sbatch job.sbatch, or --submit --address http://HEAD:8265",
        )
    gpus = int(plan.cluster.node_resources.get("GPU", 0))
    if gpus:
        have = _local_gpus()
        if have < gpus:
            raise LaunchError(
                f"{plan.name} needs {gpus} GPU(s) ({plan.cluster.gpu}); this machine has {have}",
                "use a GPU machine, or a CPU recipe (`cluster: {gpu: cpu}`) such as recipes/demo_math.yaml",
            )
    if shutil.which("ray") is None and not (Path(sys.executable).parent / "ray").exists():
        raise LaunchError(
            "Ray is not installed in this environment", "pip install 'molt-recipes[runtime]' (or run `just setup`)"
        )


def _stop_bound(plan: Plan) -> float:
    """How long the job may take to stop after the forwarded signal: its own stop bound, plus its teardown."""
    return (plan.rl.supervisor.stop_timeout_s if plan.rl is not None else 60.0) + 60.0


def _detach_with_parent() -> None:
    """In the child: own session (a Ctrl-C of the terminal is ours to handle), and SIGTERM when we die, so a
    killed launcher never leaves a cluster behind (Linux prctl PR_SET_PDEATHSIG)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class LocalCluster:
    """A one-node Ray cluster sized from a plan: `ray start --head --block` as our child, stopped with SIGTERM
    (Ray's own handler then stops the node's processes). Free ports, own temp dir, own auth token: it never
    touches another Ray on the machine."""

    def __init__(
        self, plan: Plan, env: dict[str, str], resources: dict[str, float] | None = None, cwd: Path | None = None
    ) -> None:
        self.plan = plan
        self.resources = dict(resources if resources is not None else plan.cluster.node_resources)
        """What the node declares: the plan's node, or more for a cluster several plans share (smoke runs)."""
        self.cwd = cwd  # of `ray start`; Ray's workers inherit it: the job root, where the plan's paths start
        # /tmp, not $TMPDIR: Ray's unix socket paths under the temp dir must stay under 108 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="molt-ray-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.port = free_port()
        self.token = secrets.token_hex(32)
        self.env = {
            **os.environ,
            **env,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ADDRESS": f"127.0.0.1:{self.port}",
            # the raylet's wait for its dashboard agent; Ray's default is too short on a loaded machine
            "RAY_agent_register_timeout_ms": os.environ.get("RAY_agent_register_timeout_ms", "300000"),
        }
        self.env.pop("RAY_AUTH_TOKEN_PATH", None)
        self.proc: subprocess.Popen | None = None
        self.log = self.temp_dir / "ray-head.log"

    def command(self) -> list[str]:
        res = dict(self.resources)
        cpus = int(res.pop("CPU", self.plan.cluster.cpus_per_node))
        gpus = int(res.pop("GPU", 0))
        ray = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
        cmd = [
            ray,
            "start",
            "--head",
            "--block",
            "--disable-usage-stats",
            f"--port={self.port}",
            f"--num-cpus={cpus}",
            f"--num-gpus={gpus}",
            f"--temp-dir={self.temp_dir}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
        ]
        if res:
            cmd.append(f"--resources={json.dumps(res, sort_keys=True)}")
        return cmd

    def start(self) -> None:
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                self.command(),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_detach_with_parent,
                cwd=self.cwd,
            )

    def wait_ready(self, plan_file: Path, root: Path, timeout_s: float) -> None:
        """The readiness barrier of the Slurm script, against this cluster; fails early when the head dies."""
        pre = subprocess.Popen(
            [sys.executable, "-m", "runtime.preflight", str(plan_file), "--timeout", str(timeout_s)],
            env=self.env,
            cwd=root,
        )
        while pre.poll() is None:
            if self.proc is not None and self.proc.poll() is not None:
                pre.terminate()
                pre.wait()
                raise LaunchError(
                    f"the head exited with status {self.proc.returncode} while starting: {head_failure(self._log())}"
                )
            time.sleep(0.5)
        if pre.returncode != 0:
            raise LaunchError(f"it was not ready within {timeout_s:g} s (preflight exited {pre.returncode})")

    def _log(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, keep_logs: bool, quiet: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if keep_logs:
            if not quiet:
                say(f"Ray logs kept in {self.temp_dir}")
        else:
            shutil.rmtree(self.temp_dir, ignore_errors=True)


def head_failure(log: str) -> str:
    """One line for why `ray start --head` failed, from its output: the exception of its traceback (its last
    `...Error: ...` / `...Exception: ...` line), else its last line; never the traceback."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b:?", line)]
    line = (errors or lines or ["(no output)"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def start_local_cluster(
    plan: Plan,
    env: dict[str, str],
    root: Path,
    plan_file: Path,
    timeout_s: float,
    resources: dict[str, float] | None = None,
    attempts: int = START_ATTEMPTS,
) -> LocalCluster:
    """A ready local cluster for `plan`, started up to `attempts` times: on a loaded machine `ray start --head` may
    die in its own start-up deadline (the raylet's registration with the GCS has 30 s, Ray's constant) or not get
    ready in time; each retry takes fresh ports and a fresh temp dir (as the Slurm script's retries of `ray start`).
    A start that still fails is a LaunchError saying what to do, with the head's logs kept."""
    for attempt in range(1, attempts + 1):
        cluster = LocalCluster(plan, env, resources, cwd=root)
        try:
            cluster.start()
            cluster.wait_ready(plan_file, root, timeout_s)
            return cluster
        except LaunchError as err:
            last = attempt == attempts
            cluster.stop(keep_logs=last, quiet=True)
            if last:
                raise LaunchError(
                    f"the local Ray cluster did not start in {attempts} attempts; the last one: {err.message}",
                    "Ray's start-up deadlines are too short for this machine's load now: wait until it is less busy "
                    "(`uptime`) and submit again; a head that was not ready in time also waits longer with "
                    f"--set launch.slurm.ready_timeout_s=SECONDS. The head's logs: {cluster.temp_dir}",
                ) from None
            say(
                f"the local Ray head did not start ({err.message}); retrying with fresh ports "
                f"(attempt {attempt + 1} of {attempts}) ..."
            )
        except BaseException:
            cluster.stop(keep_logs=False, quiet=True)
            raise
    raise AssertionError("unreachable")


def run_local(plan: Plan, root: Path | None = None) -> int:
    root = (root or Path.cwd()).resolve()
    _check_local(plan)
    env = resolve_env(plan.env)
    plan_file = write_plan_file(plan, root)
    if plan.kind == "sft":
        return _run_local_torchrun(plan, plan_file, root, env)
    res = ", ".join(f"{k} {v:g}" for k, v in sorted(plan.cluster.node_resources.items()))
    status = LAUNCH_FAILED
    t0 = time.monotonic()
    cluster: LocalCluster | None = None
    try:
        say(f"starting a local Ray cluster for {plan.name} ({res}) ...")
        timeout = float(((plan.recipe.get("launch") or {}).get("slurm") or {}).get("ready_timeout_s", 600))
        cluster = start_local_cluster(plan, env, root, plan_file, timeout)
        argv = entrypoint_command(plan, plan_file, local=True)
        say(f"cluster ready in {time.monotonic() - t0:.1f} s; running {shlex.join(argv)}")
        # Its own session, and SIGTERM when we die: a signal reaches it once, from us, and a killed launcher never
        # leaves the job behind.
        job = subprocess.Popen(argv, env=cluster.env, cwd=root, preexec_fn=_detach_with_parent)
        try:
            with signals_as_interrupt((signal.SIGINT, signal.SIGTERM)):
                status = job.wait()
        except (KeyboardInterrupt, Terminated) as exc:
            forwarded = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
            say(f"{forwarded.name}: stopping the job (it stops within train.stop_timeout_s)")
            job.send_signal(forwarded)
            try:
                status = job.wait(timeout=_stop_bound(plan))
            except subprocess.TimeoutExpired:
                job.kill()
                status = job.wait()
            status = status or 130
        else:
            status = _explain_exit(plan, status, cluster, root)
        say(f"job {plan.name} exited with status {status}")
        return status
    except (KeyboardInterrupt, Terminated):
        status = 130
        return status
    finally:
        if cluster is not None:
            say("stopping the local Ray cluster")
            cluster.stop(keep_logs=status != 0)


def _explain_exit(plan: Plan, returncode: int, cluster: LocalCluster, root: Path) -> int:
    """A driver killed by a signal, or a Ray head that died under it: named, with the last logged books
    (`job_exit`); the documented status."""
    from molt_compile.job_exit import explain

    out_dir = root / plan.rl.logging.out_dir if plan.rl is not None else root
    status, lines = explain(returncode, out_dir, cluster.proc, cluster.env.get("RAY_ADDRESS"))
    for line in lines:
        say(line)
    return status


def torchrun_argv(plan: Plan, plan_file: Path) -> list[str]:
    """The SFT plan's per-node command for this one machine (node 0, master 127.0.0.1), with this interpreter's
    torchrun whatever PATH says (as entrypoint_command)."""
    command = plan.sft.command if plan.sft is not None else plan.entrypoint
    subst = {"{node_rank}": "0", "{master_addr}": "127.0.0.1", PLAN_FILE_PLACEHOLDER: str(plan_file)}
    argv = []
    for arg in command:
        for key, value in subst.items():
            arg = arg.replace(key, value)
        argv.append(arg)
    if argv and argv[0] == "torchrun":
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    return argv


def _run_local_torchrun(plan: Plan, plan_file: Path, root: Path, env: dict[str, str]) -> int:
    argv = torchrun_argv(plan, plan_file)
    say(f"running {shlex.join(argv)}")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=root)
    try:
        from molt_compile.job_exit import exit_status

        return exit_status(proc.wait())  # killed by signal N: 128 + N, not Python's negative status
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait() or 130
