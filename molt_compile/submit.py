"""`molt-compile RECIPE --submit [--address URL] [--follow]`: run a plan on Ray.

With an address (`--address`, else the recipe's `launch.ray.address`): the Ray Jobs API. The job's runtime_env is
the plan's (working dir = the project root minus VCS, venv, checkpoints and caches; the job env), its entrypoint
the plan's, with the plan file written under `.molt/plans/` so that it travels with the working dir. Before
submitting, the cluster is checked against the plan (`/api/v0/nodes`: alive nodes and their resources).

Without one (the default for a new user): a local Ray cluster sized from the plan (`ray start --head` with the
plan's node resources, free ports, its own temp dir and auth token), the same readiness barrier as the Slurm script
(`python -m runtime.preflight`), then the entrypoint as a child process connected to it; the cluster is stopped
at the end. A head that dies or is not ready while starting is started again (START_ATTEMPTS, fresh ports). A child process rather than a local Jobs API submission: no dashboard or job supervisor to start
(~0.7 GB and ~7 s on a small machine), no upload of the project (the job runs in place and writes its outputs
where the recipe says), the terminal shows the runtime's own progress display, Ctrl-C reaches the job directly,
and its exit status is the job's.

Submission ids are `<name>-<first 12 hex of the fingerprint>-<6 random hex>`: every submission of one plan shares
the prefix (`ray job list | grep <fingerprint12>` finds them all) and a resubmission never collides.

Token auth (Ray 2.60 turns it on for clusters it starts): the token comes from RAY_AUTH_TOKEN, else the file named
by RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token, as Ray's own clients look for it; it is sent as the
`Authorization: Bearer` header Ray's dashboard checks. RAY_AUTH_MODE=disabled sends none.

`${env:NAME}` references in the job env are resolved here, from the environment of the submitting process.

Exit status: the job's (0 succeeded; remote: 1 failed, 130 stopped; local: 128 + N when its driver was killed by
signal N, e.g. 137 for `kill -9`, and 1 when the local Ray head died under it, each with a line saying so and the
last logged books, see `job_exit`), or 2 when it could not be started (no
cluster at the address, auth refused, resources the cluster cannot provide, Ray not installed), with a message
and the fix, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from schemas.plan import PLAN_FILE_PLACEHOLDER, Plan

ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
PLANS_DIR = Path(".molt") / "plans"
LAUNCH_FAILED = 2
START_ATTEMPTS = 3
"""Starts of a local Ray head before giving up (the Slurm script's `ray start` tries as often)."""
EPS = 1e-9


class LaunchError(Exception):
    """A job could not be started: `message` says what happened, `help` the fix."""

    def __init__(self, message: str, help: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.help = help


def _say(msg: str) -> None:
    print(f"molt-compile: {msg}", file=sys.stderr, flush=True)


def submit(plan: Plan, *, address: str | None, follow: bool, root: Path | None = None) -> int:
    """Run `plan` on the Ray cluster at `address` (Jobs API), or on a local cluster started for it. `root`: the job
    root that the plan's relative paths are relative to (the recipe's project root); default the working directory."""
    address = address or ((plan.recipe.get("launch") or {}).get("ray") or {}).get("address")
    try:
        if address:
            return submit_remote(plan, address=address, follow=follow, root=root)
        return run_local(plan, root=root)
    except LaunchError as err:
        _say(f"error: {err.message}")
        if err.help:
            print(f"  help: {err.help}", file=sys.stderr)
        return LAUNCH_FAILED


# ------------------------------------------------------------------------------------------------ shared
def resolve_env(env: dict[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The job env with `${env:NAME}` references replaced by the submitting environment's values."""
    values: Mapping[str, str] = os.environ if environ is None else environ
    out = {}
    for key, value in env.items():
        missing = [m.group(1) for m in ENV_REF.finditer(value) if m.group(1) not in values]
        if missing:
            raise LaunchError(
                f"env.{key} refers to ${{env:{missing[0]}}}, which is not set here",
                f"export {missing[0]}=... before submitting (secrets stay out of recipes and plans)",
            )
        out[key] = ENV_REF.sub(lambda m: values[m.group(1)], value)
    return out


def write_plan_file(plan: Plan, root: Path) -> Path:
    """Write the plan under `.molt/plans/` of the project root; return its path relative to the root.

    Not a gitignored place: Ray's working_dir upload skips what .gitignore lists. `git status` stays clean through
    `.git/info/exclude`, which git reads and Ray does not.
    """
    rel = PLANS_DIR / f"{plan.name}-{plan.fingerprint[:12]}.json"
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    text = plan.to_json()
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    exclude = root / ".git" / "info" / "exclude"
    if (root / ".git").is_dir():
        try:
            lines = exclude.read_text().splitlines() if exclude.exists() else []
            if "/.molt/" not in lines:
                exclude.parent.mkdir(parents=True, exist_ok=True)
                with exclude.open("a") as f:
                    f.write(("\n" if lines and lines[-1] else "") + "/.molt/\n")
        except OSError:
            pass  # only cosmetic
    return rel


def entrypoint_command(plan: Plan, plan_file: Path, *, local: bool = False) -> list[str]:
    """The plan's entrypoint with the plan file filled in. Locally, `python` is this interpreter: the job needs
    the environment molt-compile runs in, whatever PATH says."""
    argv = [arg.replace(PLAN_FILE_PLACEHOLDER, str(plan_file)) for arg in plan.entrypoint]
    if local and argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def submission_id(plan: Plan) -> str:
    return f"{plan.name}-{plan.fingerprint[:12]}-{secrets.token_hex(3)}"


def shortfall(plan: Plan, nodes: list[dict[str, float]]) -> list[str]:
    """What a cluster whose alive nodes offer `nodes` (total resources each) lacks for `plan`; empty if nothing.

    Totals are checked against the plan's demand; device slots also per node, since a bundle cannot span nodes.
    """
    demand = plan.resource_demand()
    total: dict[str, float] = {}
    for res in nodes:
        for key, amount in res.items():
            total[key] = total.get(key, 0.0) + amount
    missing = [
        f"{key} {total.get(key, 0.0):g} of the {amount:g} the job takes"
        for key, amount in sorted(demand.items())
        if total.get(key, 0.0) + EPS < amount
    ]
    device = plan.cluster.device_resource
    biggest = max((b.get(device, 0.0) for pg in plan.placement_groups for b in pg.bundles), default=0.0)
    if biggest and not any(res.get(device, 0.0) + EPS >= biggest for res in nodes):
        missing.append(f"no node with {biggest:g} {device} for one bundle")
    return missing


def auth_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The Ray auth token, looked up as Ray's clients do; None when there is none or auth is disabled."""
    env: Mapping[str, str] = os.environ if environ is None else environ
    if env.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    if env.get("RAY_AUTH_TOKEN"):
        return env["RAY_AUTH_TOKEN"].strip()
    path = (
        Path(env["RAY_AUTH_TOKEN_PATH"])
        if env.get("RAY_AUTH_TOKEN_PATH")
        else (Path(env.get("HOME", str(Path.home()))) / ".ray" / "auth_token")
    )
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------ Ray Jobs API
def _http_json(url: str, headers: dict[str, str], timeout: float = 10.0) -> Any:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read().decode())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace").strip()
        if e.code == 401:
            raise LaunchError(
                f"the Ray cluster at {url.split('/api/')[0]} requires an auth token and none was sent ({body})",
                "export RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=FILE; Ray "
                "writes it to ~/.ray/auth_token on the head node)",
            ) from None
        if e.code == 403:
            raise LaunchError(
                f"the Ray cluster at {url.split('/api/')[0]} refused the auth token ({body})",
                "use the token of that cluster: RAY_AUTH_TOKEN or ~/.ray/auth_token on its head node",
            ) from None
        raise LaunchError(f"{url}: HTTP {e.code}: {body[:300]}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise LaunchError(
            f"cannot reach a Ray dashboard at {url.split('/api/')[0]}: {reason}",
            "check the address (http://HOST:8265, the head's dashboard port) and that the cluster "
            "is up; without --address a local cluster is started",
        ) from None


def _normalize_address(address: str) -> str:
    address = address.strip().rstrip("/")
    if address.startswith("ray://"):
        raise LaunchError(
            f"{address}: a Ray Client address; the Jobs API needs the dashboard's http address", "use http://HOST:8265"
        )
    if "://" not in address:
        address = "http://" + address
    return address


def alive_nodes(address: str, headers: dict[str, str]) -> list[dict[str, float]]:
    """Total resources of every alive node, from the dashboard's state API."""
    data = _http_json(f"{address}/api/v0/nodes?limit=10000&detail=false", headers, timeout=30.0)
    rows = (((data or {}).get("data") or {}).get("result") or {}).get("result") or []
    return [dict(r.get("resources_total") or {}) for r in rows if r.get("state") == "ALIVE"]


def check_cluster(plan: Plan, address: str, headers: dict[str, str]) -> None:
    """Fail before submitting when the cluster cannot provide what the plan takes."""
    _http_json(f"{address}/api/version", headers)  # reachability and auth, with their own messages
    deadline = time.monotonic() + 30
    while True:  # a head whose dashboard answers may not have registered its own node yet
        nodes = alive_nodes(address, headers)
        if nodes or time.monotonic() > deadline:
            break
        time.sleep(1)
    missing = shortfall(plan, nodes)
    if missing:
        have: dict[str, float] = {}
        for res in nodes:
            for k, v in res.items():
                if k in ("CPU", "GPU", plan.cluster.device_resource):
                    have[k] = have.get(k, 0.0) + v
        raise LaunchError(
            f"the cluster at {address} cannot run {plan.name}: it has {len(nodes)} alive node(s) with "
            f"{', '.join(f'{k} {v:g}' for k, v in sorted(have.items())) or 'no CPUs or GPUs'}; missing: "
            f"{'; '.join(missing)}",
            f"the plan needs {plan.cluster.nodes} node(s) with "
            f"{', '.join(f'{k} {v:g}' for k, v in sorted(plan.cluster.node_resources.items()))} each: "
            "resize the cluster or the recipe's `cluster:`",
        )


def job_runtime_env(plan: Plan, root: Path, env: dict[str, str]) -> dict[str, Any]:
    runtime_env = json.loads(json.dumps(plan.runtime_env))  # a mutable deep copy
    working_dir = runtime_env.get("working_dir", ".")
    if working_dir and "://" not in str(working_dir):
        runtime_env["working_dir"] = str((root / working_dir).resolve())
    runtime_env["env_vars"] = {**resolve_env(dict(runtime_env.get("env_vars") or {})), **env}
    # Slurm job dirs (logs, tokens) stay home; the plans under .molt/plans travel.
    runtime_env["excludes"] = sorted({*runtime_env.get("excludes", []), ".molt/slurm"})
    return runtime_env


def submit_remote(plan: Plan, *, address: str, follow: bool, root: Path | None = None) -> int:
    root = (root or Path.cwd()).resolve()
    address = _normalize_address(address)
    token = auth_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    env = resolve_env(plan.env)
    check_cluster(plan, address, headers)
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise LaunchError(
            "Ray is not installed in this environment", "pip install 'molt-recipes[runtime]' (or run `just setup`)"
        ) from None
    plan_file = write_plan_file(plan, root)
    entrypoint = shlex.join(entrypoint_command(plan, plan_file))
    job_id = submission_id(plan)
    try:
        client = JobSubmissionClient(address, headers=headers)
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=job_id,
            runtime_env=job_runtime_env(plan, root, env),
            metadata={"molt.fingerprint": plan.fingerprint, "molt.recipe": plan.source},
        )
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise LaunchError(
            f"the Ray Jobs API at {address} did not accept the job: "
            f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}"
        ) from None
    auth = "RAY_AUTH_MODE=token " if token else ""
    print(f"submitted {job_id} to {address}")
    print(f"  follow: {auth}ray job logs --address {address} --follow {job_id}")
    print(f"  status: {auth}ray job status --address {address} {job_id}")
    print(f"  stop:   {auth}ray job stop --address {address} {job_id}")
    if not follow:
        return 0
    return _follow(client, job_id)


def _follow(client: Any, job_id: str) -> int:
    import asyncio

    from ray.job_submission import JobStatus

    async def tail() -> None:
        async for lines in client.tail_job_logs(job_id):
            sys.stdout.write(lines)
            sys.stdout.flush()

    try:
        with _signals_as_interrupt((signal.SIGTERM,)):
            asyncio.run(tail())
    except KeyboardInterrupt:
        print(f"\nstopped following; the job keeps running (stop it with `ray job stop {job_id}`)")
        return 130
    except _Terminated:  # a scheduler or CI ending the launcher: the job it submitted goes too
        print(f"\nSIGTERM: stopping job {job_id}", flush=True)
        client.stop_job(job_id)
        return 130
    status = client.get_job_status(job_id)
    while not status.is_terminal():  # the log stream can end a moment before the status flips
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    info = client.get_job_info(job_id)
    print(f"job {job_id}: {status.value}" + (f" ({info.message})" if info.message else ""))
    return {JobStatus.SUCCEEDED: 0, JobStatus.STOPPED: 130}.get(status, 1)


# ------------------------------------------------------------------------------------------------ local cluster
def _free_port(_given: set[int] = set()) -> int:  # noqa: B006 (the set is the memory of this process's picks)
    """A port free now and never handed out before by this process: the kernel may give the same ephemeral port
    to two bind-and-close probes in a row, and one `ray start` takes seven (two components on one port: once in
    34 starts)."""
    while True:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port


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


class _Terminated(Exception):
    """SIGTERM reached the launcher (raised in the main thread by `_signals_as_interrupt`)."""


@contextlib.contextmanager
def _signals_as_interrupt(signals: tuple[signal.Signals, ...]):
    """While inside: SIGINT raises KeyboardInterrupt and SIGTERM raises `_Terminated`, so that the launcher's
    `except` forwards them to what it started and tears down; the previous handlers come back after."""

    def handle(signum, frame):
        raise KeyboardInterrupt if signum == signal.SIGINT else _Terminated()

    previous = {s: signal.signal(s, handle) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


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
        self.port = _free_port()
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
            f"--dashboard-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
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
                _say(f"Ray logs kept in {self.temp_dir}")
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
            _say(
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
        _say(f"starting a local Ray cluster for {plan.name} ({res}) ...")
        timeout = float(((plan.recipe.get("launch") or {}).get("slurm") or {}).get("ready_timeout_s", 600))
        cluster = start_local_cluster(plan, env, root, plan_file, timeout)
        argv = entrypoint_command(plan, plan_file, local=True)
        _say(f"cluster ready in {time.monotonic() - t0:.1f} s; running {shlex.join(argv)}")
        # Its own session, and SIGTERM when we die: a signal reaches it once, from us, and a killed launcher never
        # leaves the job behind.
        job = subprocess.Popen(argv, env=cluster.env, cwd=root, preexec_fn=_detach_with_parent)
        try:
            with _signals_as_interrupt((signal.SIGINT, signal.SIGTERM)):
                status = job.wait()
        except (KeyboardInterrupt, _Terminated) as exc:
            forwarded = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
            _say(f"{forwarded.name}: stopping the job (it stops within train.stop_timeout_s)")
            job.send_signal(forwarded)
            try:
                status = job.wait(timeout=_stop_bound(plan))
            except subprocess.TimeoutExpired:
                job.kill()
                status = job.wait()
            status = status or 130
        else:
            status = _explain_exit(plan, status, cluster, root)
        _say(f"job {plan.name} exited with status {status}")
        return status
    except (KeyboardInterrupt, _Terminated):
        status = 130
        return status
    finally:
        if cluster is not None:
            _say("stopping the local Ray cluster")
            cluster.stop(keep_logs=status != 0)


def _explain_exit(plan: Plan, returncode: int, cluster: LocalCluster, root: Path) -> int:
    """A driver killed by a signal, or a Ray head that died under it: named, with the last logged books
    (`job_exit`); the documented status."""
    from molt_compile.job_exit import explain

    out_dir = root / plan.rl.logging.out_dir if plan.rl is not None else root
    status, lines = explain(returncode, out_dir, cluster.proc, cluster.env.get("RAY_ADDRESS"))
    for line in lines:
        _say(line)
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
    _say(f"running {shlex.join(argv)}")
    proc = subprocess.Popen(argv, env={**os.environ, **env}, cwd=root)
    try:
        from molt_compile.job_exit import exit_status

        return exit_status(proc.wait())  # killed by signal N: 128 + N, not Python's negative status
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        return proc.wait() or 130
