"""`just smoke` (= `python -m tests.smoke [RECIPE...]`): every shipped recipe, shrunk, run on this machine's CPUs.

Each recipe runs with the small offline dataset it needs (`SMOKE_SETS`: the recipe's own format, its columns,
under tests/data/smoke/), through `molt-compile RECIPE --smoke`'s code, all on one local Ray cluster; then one
table, recipe -> verdict; two recipes run at once (`--jobs N`). A recipe either passes (2 steps, a checkpoint, a
resume, an eval) or is refused at compile time by the capability rule (CAP001: a setting this runtime does not
implement yet). Exit 0 only then.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

SMOKE_DATA = ROOT / "tests" / "data" / "smoke"
MOLT_TMP = re.compile(r"\.tmp/([A-Za-z0-9_]+)/(train|eval)$")
"""The launch recipes read Molt's `.tmp/<dataset>/<split>` directories; tests/data/smoke/<dataset>/<split> stands in."""


def shipped() -> list[Path]:
    return sorted(p for p in RECIPES.glob("*.yaml"))


def smoke_sets(recipe) -> tuple[str, ...]:
    """`--set` overrides that point a validated recipe's data at its stand-in (none for local data)."""
    sets = []
    for key in ("data.dataset" if recipe.kind == "sft" else "data.prompts", "eval.dataset"):
        section, name = key.split(".")
        m = MOLT_TMP.search(getattr(getattr(recipe, section), name) or "")
        if m:
            sets.append(f"{key}={(SMOKE_DATA / m.group(1) / m.group(2)).relative_to(ROOT)}")
    return tuple(sets)


def run(names: list[str] | None = None, say=print, jobs: int = 2):
    from molt_compile.compile import compile_recipe
    from molt_compile.smoke_run import run_smokes

    recipes = [p.relative_to(ROOT) for p in shipped() if not names or p.name in names or p.stem in names]
    items = [(p, smoke_sets(compile_recipe(ROOT / p, lower=False).recipe)) for p in recipes]
    return run_smokes(items, root=ROOT, say=say, jobs=jobs)


def main(argv: list[str]) -> int:
    import argparse

    from molt_compile.smoke_run import table

    parser = argparse.ArgumentParser(prog="just smoke", description="Smoke-run the shipped recipes.")
    parser.add_argument("recipes", nargs="*", help="recipe names or stems (default: every shipped recipe)")
    parser.add_argument("--jobs", type=int, default=2, help="recipes run at once on the one cluster (default 2)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    verdicts = run(args.recipes or None, say=lambda line: print(line, file=sys.stderr, flush=True), jobs=args.jobs)
    print(table(verdicts))
    print(f"{len(verdicts)} recipes in {time.monotonic() - t0:.0f} s: "
          f"{sum(v.status == 'passed' for v in verdicts)} passed, "
          f"{sum(v.status == 'refused' for v in verdicts)} refused by the capability rule (CAP001), "
          f"{sum(v.status not in ('passed', 'refused') for v in verdicts)} failed")
    return 0 if all(v.status in ("passed", "refused") for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
