"""Shell injection: a recipe full of hostile strings renders a script that bash accepts, and running that whole
script (in a sandbox where srun, scontrol and python are recording stubs) creates none of the marker files the
injections try to create, while every value still reaches the job exactly as written."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from molt_compile.compile import compile_recipe
from molt_compile.slurm import SlurmRenderError, render_sbatch
from schemas.plan import Plan

from .conftest import ROOT

STUBS = {
    "scontrol": "#!/bin/bash\nprintf 'n1\\nn2\\n'\n",
    # Records its arguments; a Ray node step blocks like `ray start --block` until the job's cleanup stops it;
    # any other step runs its command (after the srun options), like srun on the head would.
    "srun": """#!/bin/bash
printf '%s\\n' "$@" >> "$STUB_DIR/srun.log"; echo --- >> "$STUB_DIR/srun.log"
for a in "$@"; do if [ "$a" = ray-node ]; then trap 'exit 0' TERM; sleep 300 & wait; exit 0; fi; done
while [ $# -gt 0 ] && [ "$1" != bash ]; do shift; done
exec "$@"
""",
    # The job's python: records argv and environment; the preflight passes, the entrypoint exits STUB_EXIT.
    "python": """#!/bin/bash
n=$(ls "$STUB_DIR" | grep -c '^python-.*\\.argv$')
printf '%s\\0' "$@" > "$STUB_DIR/python-$n.argv"
env -0 > "$STUB_DIR/python-$n.env"
case " $* " in *" runtime.preflight "*) exit 0 ;; esac
exit "${STUB_EXIT:-0}"
""",
}


def _hostile(mark: Path, n: int) -> str:
    """A string that would create mark-N if any shell evaluated it, in every way one could."""
    m = f"{mark}-{n}"
    return f"""$(touch {m})`touch {m}`'; touch {m}; '"; touch {m}; "\\"${{IFS}}$((0))\n touch {m}\r;touch {m} #"""


def _recipe(tmp: Path, mark: Path, port: int, dash_port: int) -> Path:
    data = ROOT / "recipes" / "data" / "demo_math"
    values = {
        "extends": str(ROOT / "recipes" / "demo_math.yaml"),
        "model": {"path": str(data / "model")},
        "agent": {"path": str(ROOT / "recipes" / "agents" / "demo_math.py"),
                  "env": {"AGENT_EVIL": _hostile(mark, 1)}},
        "data": {"prompts": str(data / "train.jsonl")},
        "eval": {"dataset": str(data / "eval.jsonl")},
        "env": {"EVIL_ALL": _hostile(mark, 2), "EVIL_DOLLAR": f"$HOME ${{HOME}} $(touch {mark}-3)",
                "EVIL_EMPTY": "", "EVIL_UNICODE": "ünï ✓ \u2028 end", "EVIL_BACKSLASH": "\\\\n \\x41 \\'"},
        "launch": {"slurm": {
            "ray_port": port, "dashboard_port": dash_port, "ready_timeout_s": 20,
            # A hostile time, account or partition is refused by LAUNCH001/LAUNCH003; the renderer's quoting of
            # them is tested below, on the plan.
            "account": "a", "partition": "p", "time": "00:10:00",
            "container_image": f"img'$(touch {mark}-7)'`touch {mark}-7`",
            "mounts": [f"/a:/b$(touch {mark}-8)", "/c:/d';touch " + f"{mark}-8"],
            # Setup lines are shell code the recipe asks to run: they must run exactly as written (once per step,
            # never evaluated twice) and cannot break the script around them.
            "setup": [f"""printf '%s\\n' '$(touch {mark}-9)' "$EVIL_DOLLAR" >> "$MOLT_JOB_DIR/setup.out" """,
                      "MOLT_SETUP_RAN=$((${MOLT_SETUP_RAN:-0} + 1)); export MOLT_SETUP_RAN"],
        }},
    }
    path = tmp / "evil.yaml"
    path.write_text(json.dumps(values))  # JSON is YAML: every escape above survives exactly
    return path


@pytest.fixture
def listening_port():
    with socket.socket() as s:  # stands in for the head's GCS port, which the script waits for
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield s.getsockname()[1]


def _sandbox(tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    root = tmp / "project"
    (root / "runtime").mkdir(parents=True)
    (root / "schemas").mkdir()
    stubs = tmp / "stubs"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(stat.S_IRWXU)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp), "STUB_DIR": str(stubs), "STUB_EXIT": "7",
           "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(root), "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURMD_NODENAME": "n1", "MOLT_HEAD_IP": "127.0.0.1"}
    return root, stubs, env


def _read_env(path: Path) -> dict[str, str]:
    out = {}
    for item in path.read_bytes().split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            out[k.decode()] = v.decode()
    return out


def test_hostile_recipe_runs_nothing_and_every_value_arrives_verbatim(tmp_path: Path, listening_port: int,
                                                                      monkeypatch) -> None:
    mark = tmp_path / "MARK"
    monkeypatch.chdir(ROOT)
    result = compile_recipe(_recipe(tmp_path, mark, listening_port, listening_port + 1), roots=[ROOT])
    assert result.plan is not None, [f"{d.code} {d.message}" for d in result.diagnostics]
    # Plan names are schema-checked ([a-z0-9-]) and times rule-checked (LAUNCH001); the renderer quotes them anyway.
    recipe = dict(result.plan.recipe)
    recipe["launch"] = {**recipe["launch"], "slurm": {**recipe["launch"]["slurm"],
                                                      "time": f"00:10:00$(touch {mark}-6)",
                                                      "account": f"a$(touch {mark}-4)`touch {mark}-4`'\"",
                                                      "partition": f"p;touch {mark}-5"}}
    plan = result.plan.model_copy(update={"name": f"n$(touch {mark}-10)`touch {mark}-10`",
                                          "recipe": recipe}).with_fingerprint()
    script = render_sbatch(plan)
    root, stubs, env = _sandbox(tmp_path)
    job = tmp_path / "job.sbatch"
    job.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(job)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr

    run = subprocess.run(["bash", str(job)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    leaked = sorted(p.name for p in tmp_path.glob("MARK*"))
    assert leaked == [], f"injected commands ran: {leaked}\n{run.stdout}\n{run.stderr}"
    # The whole script ran: preflight, then the entrypoint, whose status (the stub's 7) is the job's.
    assert run.returncode == 7, run.stdout + run.stderr
    assert "molt: job exits with status 7" in run.stdout

    job_dir = root / ".molt" / "slurm" / f"{plan.name}-42"  # the hostile name is a literal directory name
    assert (job_dir / "plan.json").read_text() == plan.to_json()
    argvs = sorted(stubs.glob("python-*.argv"))
    assert len(argvs) == 2
    preflight, entry = [p.read_bytes().split(b"\0")[:-1] for p in argvs]
    assert preflight[:3] == [b"-m", b"runtime.preflight", f".molt/slurm/{plan.name}-42/plan.json".encode()]
    assert entry == [b"-m", b"runtime", f".molt/slurm/{plan.name}-42/plan.json".encode()]

    # Every env value of the plan reaches the job exactly as written.
    seen = _read_env(stubs / "python-1.env")
    for key, value in plan.env.items():
        assert seen.get(key) == value, key
    assert seen["RAY_AUTH_MODE"] == "token" and len(seen["RAY_AUTH_TOKEN"]) == 64

    # Setup lines ran once per step, as written: their single-quoted $(...) printed, not run.
    setup_out = (job_dir / "setup.out").read_text()
    assert setup_out == 2 * f"$(touch {mark}-9)\n{plan.env['EVIL_DOLLAR']}\n"
    assert seen["MOLT_SETUP_RAN"] == "1"

    # The container options reached srun as single arguments, verbatim.
    srun_args = (stubs / "srun.log").read_text()
    slurm = plan.recipe["launch"]["slurm"]
    assert f"--container-image={slurm['container_image']}\n" in srun_args
    assert f"--container-mounts={','.join(slurm['mounts'])},{root}:{root}\n" in srun_args


@pytest.mark.parametrize("key", ["account", "partition", "time"])
def test_control_characters_in_sbatch_options_are_refused(cpu_plan: Plan, key: str) -> None:
    recipe = dict(cpu_plan.recipe)
    recipe["launch"] = {**recipe["launch"], "slurm": {**recipe["launch"]["slurm"], key: "x\ntouch /tmp/pwned"}}
    plan = cpu_plan.model_copy(update={"recipe": recipe}).with_fingerprint()
    with pytest.raises(SlurmRenderError, match=f"launch.slurm.{key}.*control character"):
        render_sbatch(plan)


@pytest.mark.parametrize("key", ["BAD KEY", "X;touch /tmp/pwned", "1X", "A-B", "$(id)"])
def test_env_names_that_are_not_identifiers_are_refused(cpu_plan: Plan, key: str) -> None:
    plan = cpu_plan.model_copy(update={"env": {**cpu_plan.env, key: "v"}}).with_fingerprint()
    with pytest.raises(SlurmRenderError, match="not an environment variable name"):
        render_sbatch(plan)


def test_a_broken_setup_line_fails_its_step_with_a_clear_message(tmp_path: Path, cpu_plan: Plan,
                                                               listening_port: int) -> None:
    recipe = dict(cpu_plan.recipe)
    recipe["launch"] = {**recipe["launch"], "slurm": {**recipe["launch"]["slurm"], "ray_port": listening_port,
                                                      "setup": ["echo 'unbalanced", "echo never"]}}
    plan = cpu_plan.model_copy(update={"recipe": recipe}).with_fingerprint()
    root, stubs, env = _sandbox(tmp_path)
    job = tmp_path / "job.sbatch"
    job.write_text(render_sbatch(plan))
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0  # the line is data to the script
    try:
        run = subprocess.run(["bash", str(job)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{e.stdout}\n{e.stderr}") from None
    assert run.returncode == 1
    assert "launch.slurm.setup[0] failed" in run.stderr
    assert "molt: the cluster did not come up" in run.stderr
    assert not list(stubs.glob("python-*.argv"))  # the step stopped before its command


def test_sft_script_runs_torchrun_with_rank_master_and_plan_file_filled_in(tmp_path: Path, monkeypatch) -> None:
    from .conftest import compile_plan

    plan = compile_plan("recipes/sft_qwen3_4b.yaml")
    root, stubs, env = _sandbox(tmp_path)
    (stubs / "torchrun").write_text('#!/bin/bash\nprintf \'%s\\0\' "$@" > "$STUB_DIR/torchrun.argv"\nexit 0\n')
    (stubs / "torchrun").chmod(stat.S_IRWXU)
    env["SLURMD_NODENAME"] = "n2"  # the stub srun runs the node command once, here as the second node
    job = tmp_path / "job.sbatch"
    job.write_text(render_sbatch(plan))
    run = subprocess.run(["bash", str(job)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    argv = (stubs / "torchrun.argv").read_bytes().decode().split("\0")[:-1]
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-addr") + 1] == "127.0.0.1"
    assert argv[argv.index("--nnodes") + 1] == str(plan.sft.nnodes)
    assert argv[-1] == f".molt/slurm/{plan.name}-42/plan.json"
    assert "--nodes=2 --ntasks=2" in job.read_text()
