"""Cold `molt-compile` on the largest recipe: what a user waits for before the first diagnostic (DESIGN §8,
target < 0.2 s on our 2-core machines; Molt's own CLI needs about 2.1 s to reach its first check)."""

from __future__ import annotations

import os
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


def _wall(cmd: list[str], runs: int = RUNS) -> list[float]:
    times = []
    env = {**os.environ, "COLUMNS": "120"}
    for _ in range(runs):
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, env=env)
        times.append(time.perf_counter() - t)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return times


def run() -> dict:
    recipe = largest_recipe().relative_to(ROOT)
    script = Path(sys.executable).parent / "molt-compile"
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "molt_compile.cli"]
    python = [sys.executable, "-c", "pass"]
    imports = [sys.executable, "-c", "import molt_compile.cli, molt_compile.compile"]
    _wall(cli + [str(recipe)], runs=1)  # warm the page cache and .pyc files; "cold" means a fresh process
    compile_times = _wall(cli + [str(recipe)])
    lint_times = _wall(cli + ["lint", "recipes/"], runs=3) if (ROOT / "recipes").is_dir() else []
    startup = _wall(python)
    import_times = _wall(imports)

    from molt_compile.compile import compile_recipe

    os.chdir(ROOT)
    compile_recipe(recipe)
    in_process = []
    for _ in range(RUNS):
        t = time.perf_counter()
        result = compile_recipe(recipe)
        in_process.append(time.perf_counter() - t)
    return {
        "recipe": str(recipe),
        "cold_cli_median_s": statistics.median(compile_times),
        "cold_cli_min_s": min(compile_times),
        "python_startup_median_s": statistics.median(startup),
        "import_cli_median_s": statistics.median(import_times),
        "in_process_compile_median_ms": statistics.median(in_process) * 1000,
        "lint_recipes_median_s": statistics.median(lint_times) if lint_times else None,
        "exit_status": result.exit_status,
        "target_cold_cli_s": 0.2,
        "load_average_1m": os.getloadavg()[0],
    }
