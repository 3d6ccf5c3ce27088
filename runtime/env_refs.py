"""`${env:NAME}` references in the plan's env (the job-wide `env:` and `agent.env`), resolved where the job starts.

The plan keeps the references: secrets never enter plans, logs or the Slurm script. The driver resolves them from
its own environment before Ray starts (`python -m runtime` exits 2 naming an unset one) and hands the values to
every actor: the job env through Ray's runtime_env, `agent.env` as the agent runners' argument. A job-env value a
launcher already resolved (the Slurm script exports `KEY="$NAME"`, `--submit` sends the submitter's values) is kept
as it is, so a restarted job gets the same values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")


class UnsetReference(ValueError):
    """A `${env:NAME}` reference whose NAME is not set where the job starts."""


def resolve(env: Mapping[str, str], environ: Mapping[str, str], section: str, *,
            launcher_resolved: bool = False) -> dict[str, str]:
    """`env` with every `${env:NAME}` replaced by `environ[NAME]`. With `launcher_resolved`, a key whose reference
    is unset here but which `environ` already holds resolved (no reference left in it) keeps that value."""
    out: dict[str, str] = {}
    for key, value in env.items():
        missing = [name for name in ENV_REF.findall(value) if name not in environ]
        if not missing:
            out[key] = ENV_REF.sub(lambda m: environ[m.group(1)], value)
        elif launcher_resolved and key in environ and not ENV_REF.search(environ[key]):
            out[key] = environ[key]
        else:
            raise UnsetReference(f"{section}.{key} refers to ${{env:{missing[0]}}}, which is not set where the job "
                                 f"starts: export {missing[0]} there (secrets stay out of recipes and plans)")
    return out


def driver_env(plan, environ: Mapping[str, str]) -> dict[str, str]:
    """The plan's job-wide env resolved from `environ` (the driver's, at start); raises `UnsetReference` naming the
    first reference that is unset, in the job env, in `agent.env` or in a role's env, before anything starts."""
    job = resolve(plan.env, environ, "env", launcher_resolved=True)
    here = {**environ, **job}
    rl = getattr(plan, "rl", None)
    if rl is not None:
        resolve(rl.agent.env, here, "agent.env", launcher_resolved=True)
    for role in plan.roles:
        resolve(role.env, here, f"env of the {role.name} actors", launcher_resolved=True)
    return job


def for_actors(env: Mapping[str, str]) -> dict[str, str]:
    """A plan env section (a role's, `agent.env`) for an actor, resolved in the driver, where `python -m runtime`
    has checked every reference and exported the job env (`driver_env`)."""
    import os

    return resolve(env, os.environ, "env", launcher_resolved=True)
