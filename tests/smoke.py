"""`just smoke` (= `python -m tests.smoke [RECIPE...]`): every shipped recipe, shrunk, run on this machine's CPUs.

Each recipe runs with the small offline dataset it needs (`SMOKE_SETS`: the recipe's own format, its columns,
under tests/data/smoke/), through `molt-compile RECIPE --smoke`'s code, all on one local Ray cluster; then one
table, recipe -> verdict. A recipe either passes (2 steps, a checkpoint, a resume, an eval) or is refused at
compile time by the capability rule (CAP001: a setting this runtime does not implement yet). Exit 0 only then.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"

SMOKE_SETS: dict[str, tuple[str, ...]] = {
    # recipe -> --set overrides that point it at its smoke data (cluster paths are not readable here)
}


def shipped() -> list[Path]:
    return sorted(p for p in RECIPES.glob("*.yaml"))


def run(names: list[str] | None = None, say=print):
    from molt_compile.smoke_run import run_smokes

    recipes = [p for p in shipped() if not names or p.name in names or p.stem in names]
    items = [(p.relative_to(ROOT), SMOKE_SETS.get(p.name, ())) for p in recipes]
    return run_smokes(items, root=ROOT, say=say)


def main(argv: list[str]) -> int:
    from molt_compile.smoke_run import table

    t0 = time.monotonic()
    verdicts = run(argv or None, say=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(verdicts))
    print(f"{len(verdicts)} recipes in {time.monotonic() - t0:.0f} s: "
          f"{sum(v.status == 'passed' for v in verdicts)} passed, "
          f"{sum(v.status == 'refused' for v in verdicts)} refused by the capability rule (CAP001), "
          f"{sum(v.status not in ('passed', 'refused') for v in verdicts)} failed")
    return 0 if all(v.status in ("passed", "refused") for v in verdicts) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
