"""Launch settings that Slurm or Ray would refuse only after the job was written (issues 13, 19)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import ENV_NAME_PATTERN, RlRecipe, SftRecipe, SlurmLaunch

ENV_NAME = re.compile(ENV_NAME_PATTERN)

SLURM_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite)")
"""sbatch's `--time` formats, exactly: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds, and UNLIMITED / INFINITE (any case, as Slurm compares them)."""
_UNIT = re.compile(r"\s*(\d+)\s*(d|days?|h|hours?|m|min|minutes?|s|sec|seconds?)\s*", re.IGNORECASE)


def _slurm_time_in_words(value: str) -> str | None:
    """`2d`, `36h`, `90m`, `1d12h` -> the sbatch spelling (D-HH:MM:SS or HH:MM:SS), else None."""
    parts = _UNIT.findall(value)
    if not parts or "".join(f"{n}{u}" for n, u in parts).lower() != re.sub(r"\s", "", value).lower():
        return None
    seconds = sum(int(n) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[u[0].lower()] for n, u in parts)
    days, rest = divmod(seconds, 86400)
    clock = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{clock}" if days else clock


def slurm_time_format(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `launch.slurm.time` is written in one of sbatch's `--time` formats: `minutes`, `minutes:seconds`,
    `hours:minutes:seconds`, `days-hours`, `days-hours:minutes`, `days-hours:minutes:seconds`, or `UNLIMITED` /
    `INFINITE`.

    ## Why it matters
    The value is copied into `#SBATCH --time=...`. sbatch rejects anything else ("Invalid time limit
    specification") when the script is submitted, after the compile said nothing: `2d` or `48h` look right and fail.

    ## Example
    ```yaml
    launch: {slurm: {time: 2d}}
    ```

    ## Use instead
    ```yaml
    launch: {slurm: {time: "2-00:00:00"}}
    ```

    ## References
    Slurm sbatch(1) `--time`; molt_rules.md §5 (launch scripts); DESIGN.md (Slurm); issue 19
    """
    value = recipe.launch.slurm.time
    if SLURM_TIME.fullmatch(value):
        return
    spelled = _slurm_time_in_words(value)
    yield diag(
        source,
        "launch.slurm.time",
        f"launch.slurm.time `{value}` is not a Slurm time limit; sbatch would reject `--time={value}`",
        f'write `time: "{spelled}"`'
        if spelled
        else 'use minutes ("90"), hours:minutes:seconds ("04:00:00") or days-hours:minutes:seconds ("2-00:00:00")',
    )


def ray_runtime_env_shape(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    In `launch.ray.runtime_env`, `env_vars` is a mapping of environment variable names (letters, digits, `_`, not
    starting with a digit) to strings without a NUL byte, and `excludes` is a list of strings.

    ## Why it matters
    The compiler merges both into the job's Ray runtime_env. Ray refuses other shapes when the job is submitted
    ("runtime_env['env_vars'] must be of type Dict[str, str]"), and a name holding `=` cannot be exported; the
    recipe's own `env:` is schema-checked the same way.

    ## Example
    ```yaml
    launch: {ray: {runtime_env: {env_vars: {"NCCL_DEBUG=INFO": "1", RETRIES: 3}}}}
    ```

    ## Use instead
    ```yaml
    launch: {ray: {runtime_env: {env_vars: {NCCL_DEBUG: INFO, RETRIES: "3"}}}}
    ```

    ## References
    Ray runtime_env docs (`env_vars: Dict[str, str]`); DESIGN.md (Ray cluster: runtime_env from the plan); issue 13.5
    """
    rt = recipe.launch.ray.runtime_env
    env_vars, excludes = rt.get("env_vars"), rt.get("excludes")
    path = "launch.ray.runtime_env"
    if env_vars is not None and not isinstance(env_vars, dict):
        yield diag(
            source,
            f"{path}.env_vars",
            "launch.ray.runtime_env.env_vars must be a mapping",
            "write env_vars: {NAME: value}",
        )
    for key, value in env_vars.items() if isinstance(env_vars, dict) else ():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            yield diag(
                source,
                f"{path}.env_vars.{key}",
                f"`{key}` in launch.ray.runtime_env.env_vars is not an environment variable name",
                "use letters, digits and `_`, not starting with a digit",
            )
        elif not isinstance(value, str) or "\0" in value:  # a NUL byte: no environment can hold one
            text = isinstance(value, str)
            yield diag(
                source,
                f"{path}.env_vars.{key}",
                f"launch.ray.runtime_env.env_vars.{key} must be a string"
                + (" without a NUL byte (\\0)" if text else f", got {type(value).__name__}"),
                "remove the \\0 from the value" if text else f'quote it: {key}: "{value}"',
            )
    if excludes is not None and not (isinstance(excludes, list) and all(isinstance(x, str) for x in excludes)):
        yield diag(
            source,
            f"{path}.excludes",
            "launch.ray.runtime_env.excludes must be a list of strings",
            'write excludes: ["data/big", "*.bin"]',
        )


SCRIPT_SBATCH = {
    "job-name": "name",
    "nodes": "cluster.nodes",
    "ntasks-per-node": "",
    "gpus-per-node": "cluster.gpus_per_node",
    "time": "launch.slurm.time",
    "account": "launch.slurm.account",
    "partition": "launch.slurm.partition",
    "exclusive": "launch.slurm.exclusive",
    "qos": "launch.slurm.qos",
    "constraint": "launch.slurm.constraint",
    "mem": "launch.slurm.mem",
    "output": "launch.slurm.output",
    "error": "launch.slurm.error",
}
"""#SBATCH options the script writes itself -> the recipe key that sets them ("" when the plan decides)."""
SCRIPT_SRUN = (
    "nodes",
    "ntasks",
    "ntasks-per-node",
    "nodelist",
    "w",
    "N",
    "n",
    "exclude",
    "x",
    "overlap",
    "container-image",
    "container-mounts",
    "container-workdir",
    "no-container-mount-home",
)
"""srun flags the script sets on its steps (placement of the Ray head and workers, the container)."""
_SBATCH_OPTION = re.compile(r"--([a-z][a-z0-9-]*)(=.*)?")
_SRUN_FLAG = re.compile(r"--?([A-Za-z][A-Za-z0-9-]*)(=.*)?")
_MEM = re.compile(r"\d+[KMGT]?")
NEEDS_VALUE = frozenset(
    "account begin chdir cluster comment constraint cpu-bind cpus-per-gpu cpus-per-task dependency distribution "
    "error export gpu-bind gpus gpus-per-task gres hint input job-name licenses mail-type mail-user mem mem-bind "
    "mem-per-cpu mem-per-gpu mpi network ntasks-per-gpu output partition qos reservation signal time wckey "
    "A C D J c d e i m o p q t".split()
)
"""sbatch/srun options that take a value (sbatch(1), srun(1)): alone, such an item takes the next word of the
command line as its value (`--mpi` followed by the script's own flags)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


_NO_VARIABLES = "write the value itself, or set it in `launch.slurm.setup` / `env`; only `mounts` expand variables"


def _bad_script_options(s: SlurmLaunch, source: SourceMap) -> Iterator[Diagnostic]:
    """LAUNCH003's findings in `launch.slurm.sbatch_options` and `srun_options`."""
    for i, option in enumerate(s.sbatch_options):
        m = _SBATCH_OPTION.fullmatch(option)
        key = f"launch.slurm.sbatch_options.{i}"
        if _CONTROL.search(option) or not m:
            yield diag(
                source,
                key,
                f"`{option!r}` is not one sbatch option (`--name` or `--name=value`)",
                'write one option per item, e.g. "--requeue" or "--comment=nightly"',
            )
        elif "$" in option:
            yield diag(source, key, f"`{option}`: sbatch does not expand variables in #SBATCH lines", _NO_VARIABLES)
        elif m.group(1) in NEEDS_VALUE and not m.group(2):
            yield diag(source, key, f"sbatch --{m.group(1)} needs a value", f'write "--{m.group(1)}=VALUE" as one item')
        elif m.group(1) in SCRIPT_SBATCH:
            owner = SCRIPT_SBATCH[m.group(1)]
            yield diag(
                source,
                key,
                f"--{m.group(1)} is written by the script itself",
                f"set `{owner}` instead" if owner else "remove it: the plan decides it",
            )
    for i, flag in enumerate(s.srun_options):
        m = _SRUN_FLAG.fullmatch(flag)
        key = f"launch.slurm.srun_options.{i}"
        if _CONTROL.search(flag) or not m:
            yield diag(source, key, f"`{flag!r}` is not one srun flag", 'e.g. "--mpi=none"')
        elif "$" in flag:
            yield diag(source, key, f"`{flag}`: the script passes srun flags quoted, unexpanded", _NO_VARIABLES)
        elif m.group(1) in NEEDS_VALUE and not m.group(2):
            dashes = "--" if len(m.group(1)) > 1 else "-"
            yield diag(
                source,
                key,
                f"srun {dashes}{m.group(1)} needs a value: alone, it would take the next word of every srun step",
                f'write "{dashes}{m.group(1)}=VALUE" as one item, e.g. "--mpi=none"',
            )
        elif m.group(1) in SCRIPT_SRUN:
            yield diag(
                source,
                key,
                f"srun {flag.split('=')[0]} is set by the script's steps",
                "remove it: the script places the Ray head and workers itself",
            )


def _bad_values(s: SlurmLaunch, source: SourceMap) -> Iterator[Diagnostic]:
    """LAUNCH003's findings in the values of the `#SBATCH` lines the script writes from `launch.slurm` keys."""
    for name in ("qos", "constraint", "output", "error", "account", "partition"):
        value = getattr(s, name)
        if value is not None and _CONTROL.search(value):
            yield diag(
                source,
                f"launch.slurm.{name}",
                f"launch.slurm.{name} holds a control character",
                "write it on one line of printable text",
            )
        elif value is not None and "$" in value:
            yield diag(
                source,
                f"launch.slurm.{name}",
                f"launch.slurm.{name} `{value}`: sbatch does not expand variables in #SBATCH lines",
                _NO_VARIABLES
                if name not in ("output", "error")
                else "use sbatch's own patterns: %j job id, %x name, %u user",
            )
        elif name in ("qos", "account", "partition") and value is not None and re.search(r"\s", value):
            yield diag(
                source,
                f"launch.slurm.{name}",
                f"launch.slurm.{name} `{value}` holds whitespace: Slurm reads it as one name",
                f"several are comma-separated: `{','.join(value.split())}`"
                if name == "partition"
                else "write one name",
            )


def slurm_option_shape(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `launch.slurm.sbatch_options` items are one `--name` or `--name=value` each, not an option the script
    already writes (use its key: `qos`, `mem`, ...); `launch.slurm.srun_options` items are one flag each, not one
    that places the script's steps, and an option that takes a value has it (`--mpi=none`, not `--mpi`);
    `launch.slurm.mem` is a Slurm size (`500G`, `0`); `account`, `partition` and `qos` are one name each (no
    whitespace: several partitions are `gpu,batch`); no value holds a control character, and no value that nothing
    expands holds `$` (only `mounts` expand `$NAME`, `${NAME}` and `~` on the node).

    ## Why it matters
    sbatch reads `#SBATCH` lines itself: a second value of `--nodes` or `--time` silently overrides the plan's, a
    newline would turn the rest of the line into shell code, and a malformed option fails only at submission. The
    script's srun steps pin the Ray head and workers to nodes; a flag that changes that breaks the cluster. A bare
    `--mpi` takes the script's next srun word as its value; `partition: gpu batch` is one partition named
    `gpu batch` to sbatch; `$HOME` in an `#SBATCH` line or an srun flag reaches Slurm as the five characters.

    ## Example
    ```yaml
    launch: {slurm: {mem: 500GB, partition: gpu batch, sbatch_options: ["--time=1-00:00:00", "qos high"], srun_options: ["--nodes=2", "--mpi"]}}
    ```

    ## Use instead
    ```yaml
    launch: {slurm: {mem: 500G, partition: "gpu,batch", time: "1-00:00:00", qos: high, sbatch_options: ["--requeue"], srun_options: ["--mpi=none"]}}
    ```

    ## References
    Slurm sbatch(1) and srun(1); molt_rules.md §5 (launch scripts); DESIGN.md (Slurm); issue 19
    """
    s = recipe.launch.slurm
    yield from _bad_script_options(s, source)
    if s.mem is not None and not _MEM.fullmatch(s.mem):
        yield diag(
            source,
            "launch.slurm.mem",
            f"launch.slurm.mem `{s.mem}` is not a Slurm size",
            'a number with an optional unit K, M, G or T, e.g. "500G"; "0" asks for all the memory',
        )
    yield from _bad_values(s, source)


def slurm_output_dir_missing(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The directory of `launch.slurm.output` and `launch.slurm.error` exists, relative to the project root (where
    the script is submitted from; an absolute path as written). Directories with a `%` pattern are not checked.

    ## Why it matters
    Slurm opens the job's output file before the script runs and does not create its directory: the job fails
    at once and leaves no output to say why. (Compiled on another machine than the cluster's, the directory may
    exist there only: hence a warning.)

    ## Example
    ```yaml
    launch: {slurm: {output: /no/such/dir/%x-%j.out}}
    ```

    ## Use instead
    ```yaml
    launch: {slurm: {output: "%x-%j.out"}}
    ```

    ## References
    Slurm sbatch(1) `--output`; DESIGN.md (Slurm); issue 30
    """
    import os

    root = None
    if source is not None and source.root_file:  # the project root; outside a project, the recipe's directory
        root = source.job_root or os.path.dirname(os.path.abspath(source.root_file))
    for name in ("output", "error"):
        value = getattr(recipe.launch.slurm, name)
        folder = os.path.dirname(value or "")
        if not folder or "%" in folder or "$" in folder or not (root or os.path.isabs(folder)):
            continue
        where = folder if os.path.isabs(folder) else os.path.join(root or "", folder)
        if not os.path.isdir(where):
            yield diag(
                source,
                f"launch.slurm.{name}",
                f"launch.slurm.{name}: the directory {folder}/ does not exist ({where}); Slurm does not create it, "
                "and the job would fail before its first line with no output",
                f"create it (`mkdir -p {folder}`) before sbatch, or write the file in the submit directory",
            )


def slurm_requeue_needs_resume(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `launch.slurm.requeue: true` is set on an RL recipe with `ckpt.resume: true`.

    ## Why it matters
    Near the time limit the job checkpoints and is requeued under the same job id; the requeued job runs the same
    plan. Without `ckpt.resume` it starts again from step 0 and overwrites the run, every time it is requeued.
    SFT plans run under torchrun, which does not checkpoint on the signal: the job would be killed at its limit.

    ## Example
    ```yaml
    launch: {slurm: {requeue: true}}
    ckpt: {resume: false}
    ```

    ## Use instead
    ```yaml
    launch: {slurm: {requeue: true, requeue_signal_s: 600}}
    ckpt: {resume: true}
    ```

    ## References
    Slurm sbatch(1) `--requeue`, `--signal`; scontrol(1) `requeue`; DESIGN.md (Slurm); runtime/loop.py (SIGUSR1); issue 19
    """
    slurm = recipe.launch.slurm
    if not slurm.requeue:
        return
    if recipe.kind != "rl":
        yield diag(
            source,
            "launch.slurm.requeue",
            "launch.slurm.requeue is for RL recipes: the SFT runtime (torchrun) does not checkpoint on the "
            "time-limit signal",
            "remove `requeue`, and size `launch.slurm.time` for the whole run",
        )
    elif not recipe.ckpt.resume:
        yield diag(
            source,
            "launch.slurm.requeue",
            "launch.slurm.requeue without ckpt.resume: the requeued job would start again from step 0",
            "set `ckpt: {resume: true}`",
        )
