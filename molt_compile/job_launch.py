"""What both ways of running a plan share (`submit.py`: the Ray Jobs API; `local_cluster.py`: a local Ray cluster):
the job env with its `${env:NAME}` references resolved, the plan file, the entrypoint, submission ids, the check of
a cluster's resources against the plan, Ray's auth token, and the launch error with its fix."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from schemas.plan import PLAN_FILE_PLACEHOLDER, Plan

ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
PLANS_DIR = Path(".molt") / "plans"
LAUNCH_FAILED = 2
EPS = 1e-9


class LaunchError(Exception):
    """A job could not be started: `message` says what happened, `help` the fix."""

    def __init__(self, message: str, help: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.help = help


def say(msg: str) -> None:
    print(f"molt-compile: {msg}", file=sys.stderr, flush=True)


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


class Terminated(Exception):
    """SIGTERM reached the launcher (raised in the main thread by `signals_as_interrupt`)."""


@contextlib.contextmanager
def signals_as_interrupt(signals: tuple[signal.Signals, ...]):
    """While inside: SIGINT raises KeyboardInterrupt and SIGTERM raises `Terminated`, so that the launcher's
    `except` forwards them to what it started and tears down; the previous handlers come back after."""

    def handle(signum, frame):
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()

    previous = {s: signal.signal(s, handle) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
