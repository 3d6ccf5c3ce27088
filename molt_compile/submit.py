"""`molt-compile RECIPE --submit [--address URL] [--follow]`: run a plan on Ray.

With an address (`--address`, else the recipe's `launch.ray.address`): the Ray Jobs API. The job's runtime_env is
the plan's (working dir = the project root minus VCS, venv, checkpoints and caches; the job env), its entrypoint
the plan's, with the plan file written under `.molt/plans/` so that it travels with the working dir. Before
submitting, the cluster is checked against the plan (`/api/v0/nodes`: alive nodes and their resources).

Without one (the default for a new user): a local Ray cluster started for the plan (`local_cluster.py`).
What both share (the job env, the plan file, the entrypoint, ids, auth) is in `job_launch.py`.

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

import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from molt_compile.job_launch import (
    LAUNCH_FAILED,
    LaunchError,
    Terminated,
    auth_token,
    entrypoint_command,
    resolve_env,
    say,
    shortfall,
    signals_as_interrupt,
    submission_id,
    write_plan_file,
)
from molt_compile.local_cluster import run_local
from schemas.plan import Plan


def submit(plan: Plan, *, address: str | None, follow: bool, root: Path | None = None) -> int:
    """Run `plan` on the Ray cluster at `address` (Jobs API), or on a local cluster started for it. `root`: the job
    root that the plan's relative paths are relative to (the recipe's project root); default the working directory."""
    address = address or ((plan.recipe.get("launch") or {}).get("ray") or {}).get("address")
    try:
        if address:
            return submit_remote(plan, address=address, follow=follow, root=root)
        return run_local(plan, root=root)
    except LaunchError as err:
        say(f"error: {err.message}")
        if err.help:
            print(f"  help: {err.help}", file=sys.stderr)
        return LAUNCH_FAILED


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
        with signals_as_interrupt((signal.SIGTERM,)):
            asyncio.run(tail())
    except KeyboardInterrupt:
        print(f"\nstopped following; the job keeps running (stop it with `ray job stop {job_id}`)")
        return 130
    except Terminated:  # a scheduler or CI ending the launcher: the job it submitted goes too
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
