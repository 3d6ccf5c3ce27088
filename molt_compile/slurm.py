"""The Slurm launcher: one self-contained sbatch script rendered from a plan (`molt-compile RECIPE --slurm F`).

The script (templates/slurm.sbatch.j2) carries the plan itself and writes it beside its per-node script under
`.molt/slurm/<name>-<jobid>/` at run time; boots Ray on the allocation (head, then workers, with the ports fixed
here); waits for the readiness barrier (`python -m runtime.preflight`); runs the plan's entrypoint on the head and
exits with its status; stops this job's Ray on exit or signal. SFT plans run one torchrun per node instead.

Node, GPU and CPU counts come only from the plan (`cluster`), never typed twice.

Quoting: every string from the plan reaches the shell through `shell_quote` (POSIX single quotes; ANSI-C `$'...'`
when it holds control characters, so no value ever spans lines); integers are formatted by Python. `#SBATCH` lines
are read by sbatch, not bash: their values are quoted the same way and must not hold control characters.
`${env:NAME}` references in the job env become run-time expansions of `$NAME`: secrets stay out of the script.
`launch.slurm.mounts` are paths on the nodes: `$NAME`, `${NAME}`, `${env:NAME}` and a leading `~` in them expand at
run time (`mount_words`); LAUNCH003 refuses `$` in the values that nothing expands (#SBATCH lines, srun flags).
`launch.slurm.setup` lines are shell code by definition ("module load ...", "source .venv/bin/activate"): they run
as written, each through `eval` of its quoted text, so one line can never break the script around it.
"""

from __future__ import annotations

import json
import re
import shlex
from functools import lru_cache
from typing import Any

from schemas.plan import PLAN_FILE_PLACEHOLDER, Plan

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")

PORT_NAMES = (
    "node_manager",
    "object_manager",
    "metrics_export",
    "dashboard_agent_listen",
    "dashboard_agent_grpc",
    "runtime_env_agent",
    "ray_client_server",
)
WORKER_PORTS_PER_NODE = 200
PORT_BLOCK = 10 + WORKER_PORTS_PER_NODE
"""Ports of one node: the named ones, a few spare, then its Ray worker ports."""


REQUEUE_EXIT_STATUS = 75
"""`python -m runtime`'s exit status after it checkpointed on SIGUSR1 for a requeue (EX_TEMPFAIL: try again);
runtime/loop.py's `REQUEUE_EXIT_STATUS` is the same number (the compiler imports nothing of the runtime)."""

SBATCH_VALUE_KEYS = ("qos", "constraint", "mem", "output", "error")
"""`launch.slurm` keys rendered as `#SBATCH --KEY=VALUE` when set (the option is named as the key)."""


class SlurmRenderError(ValueError):
    """The plan holds a value that cannot go into a Slurm script (the message names the recipe key)."""


# ------------------------------------------------------------------------------------------------ quoting
def shell_quote(value: object) -> str:
    """One shell word that stands for `value` exactly and expands nothing.

    Printable text: POSIX single quotes (`shlex.quote`). Text with control characters (newlines, escapes, NUL is
    refused): bash ANSI-C quoting `$'...'`, so the word stays on one line of the script.
    """
    text = str(value)
    if "\x00" in text:
        raise SlurmRenderError(f"a NUL character cannot be passed to the shell: {text!r}")
    if not CONTROL.search(text):
        return shlex.quote(text)
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "'":
            out.append("\\'")
        elif CONTROL.match(ch):
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def sbatch_quote(value: object, key: str = "") -> str:
    """A value of an `#SBATCH` line: quoted for sbatch's own parser (it understands shell quotes), and refused
    when it holds a control character (a newline would end the comment and turn the rest into shell code)."""
    text = str(value)
    if CONTROL.search(text):
        raise SlurmRenderError(
            f"{key or 'an #SBATCH value'}: {text!r} holds a control character (newline, tab, "
            "escape); Slurm options must be one line of printable text"
        )
    return shlex.quote(text)


def comment_text(value: object) -> str:
    """Text for a `#` comment line: control characters become `?`, so the comment cannot end early."""
    return CONTROL.sub("?", str(value))


def env_value(value: str) -> str:
    """A job env value as shell words: literal text quoted, `${env:NAME}` references expanded at run time."""
    parts: list[str] = []
    pos = 0
    for m in ENV_REF.finditer(value):
        if m.start() > pos:
            parts.append(shell_quote(value[pos : m.start()]))
        parts.append(f'"${{{m.group(1)}:?must be set in the environment that runs sbatch}}"')
        pos = m.end()
    if pos < len(value) or not parts:
        parts.append(shell_quote(value[pos:]))
    return "".join(parts)


MOUNT_VAR = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
"""A variable in a mount: `${env:NAME}`, `${NAME}` or `$NAME` (the same run-time expansion)."""


def mount_words(mounts: list[str]) -> str:
    """Container mounts as one shell word, comma-joined: literal text quoted, variables expanded on the node at run
    time (a `~` that starts a mount's source is `$HOME`), an unset variable stopping the job with its name."""
    parts: list[str] = []
    for mount in mounts:
        if mount == "~" or mount.startswith(("~/", "~:")):
            parts.append('"${HOME:?must be set on the node}"')
            mount = mount[1:]
        pos = 0
        for m in MOUNT_VAR.finditer(mount):
            if m.start() > pos:
                parts.append(shell_quote(mount[pos : m.start()]))
            name = m.group(1) or m.group(2) or m.group(3)
            parts.append(f'"${{{name}:?must be set on the node (launch.slurm.mounts)}}"')
            pos = m.end()
        parts.append(shell_quote(mount[pos:] + ","))
    return "".join(parts)


def command_words(argv: list[str], variables: dict[str, str]) -> str:
    """A command line from the plan: every argument quoted; `{placeholder}`s become "$VARIABLE" expansions."""
    pattern = re.compile("|".join(re.escape(p) for p in variables)) if variables else None
    words = []
    for arg in argv:
        if pattern is None:
            words.append(shell_quote(arg))
            continue
        pieces: list[str] = []
        pos = 0
        for m in pattern.finditer(arg):
            if m.start() > pos:
                pieces.append(shell_quote(arg[pos : m.start()]))
            pieces.append(f'"${{{variables[m.group(0)]}}}"')
            pos = m.end()
        if pos < len(arg) or not pieces:
            pieces.append(shell_quote(arg[pos:]))
        words.append("".join(pieces))
    return " ".join(words)


# ------------------------------------------------------------------------------------------------ ports
def node_ports(ray_port: int, dashboard_port: int, nodes: int) -> dict[str, list[int]]:
    """Fixed Ray ports of every node: a block of PORT_BLOCK ports per node after the GCS port, skipping the GCS
    and dashboard ports. Distinct per node so that simulated nodes sharing one host do not collide."""
    reserved = {ray_port, dashboard_port}
    table: dict[str, list[int]] = {name: [] for name in (*PORT_NAMES, "min_worker", "max_worker")}
    start = ray_port + 1
    for _ in range(nodes):
        while any(start <= p < start + PORT_BLOCK for p in reserved):
            start = max(p for p in reserved if start <= p < start + PORT_BLOCK) + 1
        if start + PORT_BLOCK - 1 > 65535:
            raise SlurmRenderError(
                f"launch.slurm.ray_port: {ray_port} leaves no room for the ports of {nodes} nodes "
                f"({PORT_BLOCK} each, up to 65535); use a lower port such as 6379"
            )
        for i, name in enumerate(PORT_NAMES):
            table[name].append(start + i)
        table["min_worker"].append(start + 10)
        table["max_worker"].append(start + PORT_BLOCK - 1)
        start += PORT_BLOCK
    return table


# ------------------------------------------------------------------------------------------------ render
@lru_cache(maxsize=1)
def _template():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("molt_compile", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        comment_start_string="{##",
        comment_end_string="##}",
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch"] = sbatch_quote
    env.filters["comment"] = comment_text
    return env.get_template("slurm.sbatch.j2")


def _slurm_settings(plan: Plan) -> dict[str, Any]:
    return dict((plan.recipe.get("launch") or {}).get("slurm") or {})


def _env_lines(plan: Plan) -> list[tuple[str, str]]:
    lines = []
    for key, value in plan.env.items():
        if not ENV_NAME.match(key):
            raise SlurmRenderError(
                f"env: {key!r} is not an environment variable name (letters, digits and _, not starting with a digit)"
            )
        lines.append((key, env_value(str(value))))
    return lines


def _container_args(slurm: dict[str, Any]) -> list[str]:
    image = slurm.get("container_image")
    if not image:
        return []
    mounts = [str(m) for m in slurm.get("mounts") or []]
    # The project is mounted at the same path, so every path of the plan means the same inside the container.
    words = mount_words(mounts) if mounts else ""
    # A named container is created by the first step on a node and reused by the later ones (pyxis), so the image
    # is unpacked once per node for the whole job, not once per step; pyxis's default job scope removes it at the end.
    return [
        f"--container-image={shell_quote(image)}",
        '--container-name="molt-$SLURM_JOB_ID"',
        f'--container-mounts={words}"$MOLT_ROOT:$MOLT_ROOT"',
        '--container-workdir="$MOLT_ROOT"',
        "--no-container-mount-home",
    ]


def _delimiter(label: str, plan: Plan, body: str) -> str:
    base = f"MOLT_{label}_END_{plan.fingerprint[:12] or 'X'}"
    delim = base
    n = 0
    while delim in body.splitlines():
        n += 1
        delim = f"{base}_{n}"
    return delim


def render_sbatch(plan: Plan) -> str:
    """The sbatch script of `plan` (raises SlurmRenderError naming the recipe key of a value it cannot carry)."""
    slurm = _slurm_settings(plan)
    cluster = plan.cluster
    res = dict(cluster.node_resources)
    num_cpus = int(res.pop("CPU", cluster.cpus_per_node))
    num_gpus = int(res.pop("GPU", 0))
    ray_port = int(slurm.get("ray_port", 6379))
    dashboard_port = int(slurm.get("dashboard_port", 8265))
    plan_json = plan.to_json().rstrip("\n")
    sbatch_values = [(k, slurm[k]) for k in SBATCH_VALUE_KEYS if slurm.get(k) not in (None, "")]
    for key, value in (
        ("name", plan.name),
        *((f"launch.slurm.{k}", slurm.get(k)) for k in ("time", "account", "partition")),
        *((f"launch.slurm.{k}", v) for k, v in sbatch_values),
        *((f"launch.slurm.sbatch_options[{i}]", v) for i, v in enumerate(slurm.get("sbatch_options") or [])),
    ):
        if value is not None:
            sbatch_quote(value, key)  # refuses control characters, naming the key
    setup = [str(line) for line in slurm.get("setup") or []]
    for i, line in enumerate(setup):
        if "\x00" in line:
            raise SlurmRenderError(f"launch.slurm.setup[{i}]: holds a NUL character")
    values = dict(
        name=plan.name,
        source=plan.source,
        fingerprint=plan.fingerprint,
        kind=plan.kind,
        nodes=int(cluster.nodes),
        gpus_per_node=int(cluster.gpus_per_node) if cluster.device == "cuda" else 0,
        time=slurm.get("time") or "04:00:00",
        account=slurm.get("account"),
        partition=slurm.get("partition"),
        env=_env_lines(plan),
        setup=setup,
        srun_args=[shell_quote(str(f)) for f in slurm.get("srun_options") or []],
        container_args=_container_args(slurm) + [shell_quote(str(f)) for f in slurm.get("srun_options") or []],
        exclusive=bool(slurm.get("exclusive", True)),
        sbatch_values=sbatch_values,
        requeue=bool(slurm.get("requeue")) and plan.kind == "rl",
        requeue_signal_s=int(slurm.get("requeue_signal_s", 300)),
        requeue_exit=REQUEUE_EXIT_STATUS,
        sbatch_options=[str(o) for o in slurm.get("sbatch_options") or []],
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources_json=json.dumps({k: v for k, v in sorted(res.items())}, separators=(",", ":")) if res else "",
        node_resources_text=", ".join(f"{k} {v:g}" for k, v in sorted(cluster.node_resources.items())),
        ray_port=ray_port,
        dashboard_port=dashboard_port,
        ready_timeout_s=int(slurm.get("ready_timeout_s", 600)),
        plan_json=plan_json,
        plan_delimiter=_delimiter("PLAN", plan, plan_json),
        node_delimiter=f"MOLT_NODE_SCRIPT_END_{plan.fingerprint[:12] or 'X'}",
    )
    if plan.kind == "rl":
        values["ports"] = node_ports(ray_port, dashboard_port, cluster.nodes)
        values["entrypoint"] = command_words(plan.entrypoint, {PLAN_FILE_PLACEHOLDER: "MOLT_PLAN_FILE"})
    else:
        command = plan.sft.command if plan.sft is not None else plan.entrypoint
        values["node_command"] = command_words(
            command, {"{node_rank}": "NODE_RANK", "{master_addr}": "MASTER_ADDR", PLAN_FILE_PLACEHOLDER: "PLAN_FILE"}
        )
    script = _template().render(**values)
    lines = script.splitlines()
    for key in ("plan_delimiter", "node_delimiter"):
        if lines.count(values[key]) != 1:  # a value that ends a heredoc early would run as shell code
            raise SlurmRenderError(
                f"internal: the heredoc delimiter {values[key]} occurs {lines.count(values[key])} times in the script"
            )
    return script


def submit_hint(path: object) -> str:
    """How to submit a written script; says so when this machine has no Slurm (the script is still valid)."""
    import shutil

    hint = f"  submit it from the project root: sbatch {shlex.quote(str(path))}"
    if shutil.which("sbatch") is None:
        hint += (
            "\n  (sbatch is not installed on this machine: copy the project and the script to a Slurm login "
            "node, or test with .ci/slurm_up.sh, which starts a two-node Slurm here)"
        )
    return hint
