"""Reading a plan file where a job starts (`python -m runtime`, `python -m runtime.sft`): one reader for both.

The plan is parsed, checked against this build's own capability table (a plan compiled by another build of
molt-compile may ask for more) and against the optional packages it needs (`runtime/packages.py`), and its
`${env:NAME}` references are resolved (never written back into the plan).
"""

from __future__ import annotations

import os
from pathlib import Path

from schemas.plan import Plan


class PlanUnusable(Exception):
    """The plan file cannot run here; `str()` is the line to print (the entrypoints exit 2)."""


def read_plan(path: Path) -> tuple[Plan, dict[str, str]]:
    """The plan in `path` and the driver's resolved env (`runtime.env_refs.driver_env`); raises `PlanUnusable`."""
    from runtime.env_refs import UnsetReference, driver_env

    try:
        plan = Plan.from_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanUnusable(f"{path}: cannot use this plan: {exc}") from None
    problems = startup_problems(plan)
    if problems:
        raise PlanUnusable(f"{path}: this plan cannot run on this build of the runtime: {'; '.join(problems)}")
    from runtime.packages import missing_packages

    missing = missing_packages(plan)
    if missing:
        raise PlanUnusable(f"{path}: this plan cannot run in this environment: {'; '.join(missing)}")
    try:
        return plan, driver_env(plan, os.environ)
    except UnsetReference as exc:
        raise PlanUnusable(f"{path}: {exc}") from None


def startup_problems(plan: Plan) -> list[str]:
    """What stops this runtime from running `plan`, before anything starts: empty for every plan this build's
    compiler accepts (tests/runtime/test_startup.py holds that over mutated recipes).

    Every actor, the generator included, takes its plan sections unchanged: there is no slice to build."""
    from schemas.capabilities import unimplemented

    return [f"{c.key}: {c.what} (capability {c.id}; recompile: molt-compile reports it as CAP001)"
            for c in unimplemented(plan)]
