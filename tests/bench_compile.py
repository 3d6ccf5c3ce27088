"""Cold `molt-compile` on the largest recipe: what a user waits for before the first diagnostic (DESIGN §8,
target < 0.2 s on our 2-core machines; Molt's own CLI needs about 2.1 s to reach its first check).

Runs `molt-compile RECIPE --plan-out F` in fresh processes, interleaved with the import floor (a process that only
imports pydantic with its model machinery, ruamel.yaml, click, rich and jinja2: what any CLI on these libraries pays)
and a bare interpreter, so that all three share the machine's load. Reports wall time (what the user sees; noisy on a
shared machine, so the load average is reported with it), the process's CPU time (user + sys; much less sensitive to
other tenants), their ratios to the floor, and where the time goes: the cumulative import time of each top-level
module the CLI loads (`python -X importtime`) and the passes, in process. Every check runs (the capability pass
included). With MOLT_BENCH_BASELINE=DIR (another checkout, e.g. `git worktree add /tmp/base main`) the glm5 compile of
that checkout runs in the same rounds, and the ratio to it is reported; both then run as `python -m molt_compile.cli`.

    python -m tests.bench compile

Last measured 2026-12-03 on the 2-core machine, each trick against the same tree with it, paired whole-process runs
(21 pairs, CPU-time medians): glm5_ep256 cold compile 1.10x the import floor. What each remaining trick saves: exiting
without tearing the interpreter down (`cli.run`, os._exit) 20% (~40 ms); the stand-in for pydantic's plugin loader
8% (~15 ms); the garbage collector off 5% (~10 ms); each costs a few lines, so all stay. A second YAML composer
(libyaml, on the text where it provably agreed with the pure parser) saved 7% (~15 ms) for ~100 lines of agreement
argument and its own fuzz tests: it was removed; the pure-Python composer is the only parser.
On the 1,024-node plan (which lowers and serialises; glm5 stops at its CAP and DATA errors), same method, 15 pairs:
the plan's own serializer (`schemas.plan.plain`) against pydantic's saves 11%, so it stays; building InstancePlans
past `model_construct` saved 4%, so it went (the plans are byte-identical either way).
What is left above the bare interpreter (0.021 s on 2026-12-02): pydantic's import ~50 ms, creating the 75 recipe and
plan model classes ~18 ms (~0.03 ms a field, 611 fields), click ~15 ms, building the recipe's validator ~7 ms,
ruamel.yaml's import ~7 ms, composing the six YAML layers ~15 ms.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 7
FLOOR = "from pydantic import BaseModel, ConfigDict, Field; import ruamel.yaml, click, rich, jinja2"
"""What a CLI on these libraries pays before its own code: pydantic with its model machinery (a bare `import pydantic`
is lazy and skips pydantic.main, about a third of the cost), ruamel.yaml, click, rich,
jinja2."""
RECIPES = ("recipes/glm5_ep256.yaml", "tests/data/plan/synthetic_1024.yaml")


def largest_recipe() -> Path:
    glm = ROOT / "recipes" / "glm5_ep256.yaml"
    return glm if glm.exists() else ROOT / "tests" / "data" / "good" / "rl_min.yaml"


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one(cmd: list[str], cwd: Path = ROOT) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process, run in `cwd` with `cwd` on the import path."""
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # cold means a fresh process, with the bytecode cache a user's install has
    if cwd != ROOT:
        env["PYTHONPATH"] = str(cwd)
    cpu0, t0 = _cpu_of_children(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1) or b"Traceback" in proc.stderr:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return wall, _cpu_of_children() - cpu0


def _interleaved(
    cmds: dict[str, list[str]], runs: int = RUNS, where: dict[str, Path] | None = None
) -> dict[str, tuple[list[float], list[float]]]:
    """`runs` rounds of every command in turn (after one warm-up round), so that they see the same load."""
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cmds}
    for round_ in range(runs + 1):
        for name, cmd in cmds.items():
            wall, cpu = _one(cmd, (where or {}).get(name, ROOT))
            if round_:
                out[name][0].append(wall)
                out[name][1].append(cpu)
    return out


def import_breakdown(cli: list[str], recipe: str) -> dict[str, float]:
    """Cumulative import time (ms) of each top-level module a cold compile loads, largest first."""
    code = (f"import sys; from molt_compile.cli import main; sys.argv = ['molt-compile', {recipe!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n")
    env = {**os.environ, "PYDANTIC_DISABLE_PLUGINS": "__all__", "COLUMNS": "120"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env=env)
    top: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and not m.group(2).startswith(" "):
            top[m.group(2)] = top.get(m.group(2), 0) + int(m.group(1)) / 1000
    biggest = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return {name: round(ms, 1) for name, ms in biggest}


def run() -> dict:
    recipe = str(largest_recipe().relative_to(ROOT))
    script = Path(sys.executable).parent / "molt-compile"
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "molt_compile.cli"]
    plan_out = str(Path(tempfile.mkdtemp()) / "p.json")
    cmds = {"floor": [sys.executable, "-c", FLOOR], "python": [sys.executable, "-c", "pass"]}
    where: dict[str, Path] = {}
    baseline = os.environ.get("MOLT_BENCH_BASELINE")  # another checkout (`git worktree add /tmp/base main`): before
    if baseline:
        cli = [sys.executable, "-m", "molt_compile.cli"]  # both from source, so that they start alike
        where["baseline." + Path(RECIPES[0]).stem] = Path(baseline).resolve()
    for path in RECIPES:
        if (ROOT / path).exists():
            cmds[Path(path).stem] = cli + [path, "--plan-out", plan_out]
    if baseline:
        cmds["baseline." + Path(RECIPES[0]).stem] = cli + [RECIPES[0], "--plan-out", plan_out]
    measured = _interleaved(cmds, where=where)
    floor_wall, floor_cpu = (statistics.median(v) for v in measured["floor"])
    out: dict = {"recipe": recipe, "runs": RUNS}
    for name, (walls, cpus) in measured.items():
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        out[f"{name}.cold_wall_median_s"] = round(wall, 3)
        out[f"{name}.cold_wall_min_s"] = round(min(walls), 3)
        out[f"{name}.cold_cpu_median_s"] = round(cpu, 3)
        if name not in ("floor", "python"):
            out[f"{name}.wall_over_floor"] = round(wall / floor_wall, 2)
            out[f"{name}.cpu_over_floor"] = round(cpu / floor_cpu, 2)
    base = "baseline." + Path(RECIPES[0]).stem
    if base in measured:
        for i, kind in ((0, "wall"), (1, "cpu")):
            ratio = statistics.median(measured[Path(RECIPES[0]).stem][i]) / statistics.median(measured[base][i])
            out[f"{Path(RECIPES[0]).stem}.{kind}_over_baseline"] = round(ratio, 2)
    help_walls = [_one(cli + ["--help"])[0] for _ in range(5)]

    os.chdir(ROOT)
    from molt_compile.compile import compile_recipe

    compile_recipe(recipe)
    in_process = []
    for _ in range(RUNS):
        t = time.perf_counter()
        result = compile_recipe(recipe)
        in_process.append(time.perf_counter() - t)
    out.update({
        "exit_status": result.exit_status,
        "help_wall_median_s": round(statistics.median(help_walls), 3),
        "warm_in_process_compile_median_ms": round(statistics.median(in_process) * 1000, 1),
        "import_ms_by_top_level_module": import_breakdown(cli, recipe),
        "target_cold_cli_s": {"glm5_ep256": 0.2, "synthetic_1024": 0.5},
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    })
    return out
