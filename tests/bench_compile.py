"""Cold `molt-compile` on the largest recipe: what a user waits for before the first diagnostic (DESIGN §8,
target < 0.2 s on our 2-core machines; Molt's own CLI needs about 2.1 s to reach its first check).

Reports wall time (what the user sees; noisy on a shared machine, so the load average is reported with it), the
process's CPU time (user + sys; much less sensitive to other tenants), and where the time goes: the cumulative
import time of each top-level module the CLI loads (`python -X importtime`) and the passes, in process.
"""

from __future__ import annotations

import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 10


def largest_recipe() -> Path:
    glm = ROOT / "recipes" / "glm5_ep256.yaml"
    return glm if glm.exists() else ROOT / "tests" / "data" / "good" / "rl_min.yaml"


def _cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _measure(cmd: list[str], runs: int = RUNS) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds) of `runs` fresh processes."""
    walls, cpus = [], []
    env = {**os.environ, "COLUMNS": "120"}
    for _ in range(runs):
        cpu0, t0 = _cpu_of_children(), time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, env=env)
        walls.append(time.perf_counter() - t0)
        cpus.append(_cpu_of_children() - cpu0)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return walls, cpus


def import_breakdown(cli: list[str], recipe: str) -> dict[str, float]:
    """Cumulative import time (ms) of each top-level module a cold compile loads, largest first."""
    code = (f"import sys; from molt_compile.cli import main; sys.argv = ['molt-compile', {recipe!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n")
    env = {**os.environ, "PYDANTIC_DISABLE_PLUGINS": "__all__", "COLUMNS": "120"}
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
    _measure(cli + [recipe], runs=1)  # page cache and .pyc files warm; "cold" means a fresh process
    walls, cpus = _measure(cli + [recipe])
    startup_walls, startup_cpus = _measure([sys.executable, "-c", "pass"])
    help_walls, _ = _measure(cli + ["--help"], runs=5)

    os.chdir(ROOT)
    from molt_compile.compile import compile_recipe

    compile_recipe(recipe)
    in_process = []
    for _ in range(RUNS):
        t = time.perf_counter()
        result = compile_recipe(recipe)
        in_process.append(time.perf_counter() - t)
    return {
        "recipe": recipe,
        "exit_status": result.exit_status,
        "cold_cli_wall_median_s": statistics.median(walls),
        "cold_cli_wall_min_s": min(walls),
        "cold_cli_cpu_median_s": statistics.median(cpus),
        "python_startup_wall_median_s": statistics.median(startup_walls),
        "python_startup_cpu_median_s": statistics.median(startup_cpus),
        "help_wall_median_s": statistics.median(help_walls),
        "warm_in_process_compile_median_ms": statistics.median(in_process) * 1000,
        "import_ms_by_top_level_module": import_breakdown(cli, recipe),
        "target_cold_cli_s": 0.2,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
