"""Benchmark harness (`just bench` = `python -m tests.bench [NAME...]`): runs `run() -> dict` of every
`tests/bench_*.py` module (or only the named ones) and prints one table per module.

A benchmark measures; it does not assert. Numbers go into reports and the README, not into test thresholds.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def discover(names: list[str]) -> list[str]:
    found = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if names:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in names}
        missing = wanted - set(found)
        if missing:
            raise SystemExit(f"no such benchmark: {', '.join(sorted(missing))} (have: {', '.join(found)})")
        found = [n for n in found if n in wanted]
    return found


def _show(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def main(argv: list[str]) -> int:
    as_json = "--json" in argv
    names = [a for a in argv if not a.startswith("--")]
    results: dict[str, dict] = {}
    for name in discover(names):
        started = time.perf_counter()
        try:
            results[name] = importlib.import_module(f"tests.{name}").run()
        except Exception as e:  # one broken benchmark must not hide the others' numbers
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        results[name]["bench_wall_s"] = round(time.perf_counter() - started, 2)
        if not as_json:
            width = max(len(k) for k in results[name])
            print(f"\n{name}")
            for key, value in results[name].items():
                print(f"  {key.ljust(width)}  {_show(value)}")
    if as_json:
        print(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
