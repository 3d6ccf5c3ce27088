"""Benchmark: cold-process compile + lower of the largest recipes (`just bench` calls `run()`).

- GLM-5.2 EP256 (recipes/glm5_ep256.yaml): 36 nodes, 288 GPUs. Target < 0.2 s.
- A synthetic 1,024-node recipe (tests/data/plan/synthetic_1024.yaml, GLM scaled to 8,192 GPUs). Target < 0.5 s.

Both ask for what this runtime does not run yet (CAP001), which drops the plan; the child skips the capability pass
so that the plan is still serialised (`tests/bench_compile.py` measures the CLI with every check).

"Cold process" means a fresh interpreter per compile (imports included), with the bytecode cache warm, as a user
running `molt-compile` twice would see it. Each measurement is a subprocess that runs `compile_recipe` and
serialises the plan; we report the minimum and the median wall time of several runs (the minimum is the least
disturbed by other load on the machine) and the median CPU time of the child. Also reported: the in-process time of
derive + lower + JSON alone, which is what this package adds on top of loading and validating.

    python -m tests.bench_lower
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "glm5_ep256": (ROOT / "recipes" / "glm5_ep256.yaml", 0.2),
    "synthetic_1024_nodes": (ROOT / "tests" / "data" / "plan" / "synthetic_1024.yaml", 0.5),
}
_CHILD = ("import sys\nfrom molt_compile.compile import compile_recipe\nr = compile_recipe(sys.argv[1], capabilities=False)\n"
          "sys.exit(0 if r.plan is not None and r.plan.to_json() else 3)\n")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a cold process still has its bytecode cache
    return env


def _one(path: Path) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one cold compile."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=ROOT, env=_env(), capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {path} failed ({res.returncode}): {res.stderr.decode()[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _in_process(path: Path) -> float:
    """Seconds of derive + lower + to_json alone, in a warm process (median of 5)."""
    from molt_compile.derive import derive
    from molt_compile.load import load_recipe
    from molt_compile.lower import lower
    from molt_compile.validate import validate

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        loaded = load_recipe(path)
        recipe, _ = validate(loaded)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            plan, _ = lower(recipe, derive(recipe, loaded.source), loaded.source)
            plan.to_json()
            times.append(time.perf_counter() - t0)
    finally:
        os.chdir(cwd)
    return statistics.median(times)


def run(repeats: int = 7) -> dict:
    out: dict = {"load_avg_1m": round(os.getloadavg()[0], 2)}
    for name, (path, target) in CASES.items():
        _one(path)  # warm the bytecode cache
        walls, cpus = zip(*(_one(path) for _ in range(repeats)), strict=True)
        out[f"{name}.cold_wall_min_s"] = round(min(walls), 3)
        out[f"{name}.cold_wall_median_s"] = round(statistics.median(walls), 3)
        out[f"{name}.cold_cpu_median_s"] = round(statistics.median(cpus), 3)
        out[f"{name}.target_s"] = target
        out[f"{name}.meets_target"] = min(walls) < target
        out[f"{name}.derive_lower_json_s"] = round(_in_process(path), 4)
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
