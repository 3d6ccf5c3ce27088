"""What every rule module shares: the finding builder and small lookups (the row type is `codes.Code`).

A check is `check(recipe, derived, source) -> Iterable[Diagnostic]`. It never raises and never prints. It sets
`path` (the key that is wrong), `message` (with the numbers), `help` (the smallest fix) and `related` (the other
keys involved); `run_rules` stamps the row's `code`, `name` and `severity`, so a rule never repeats its code and one
code has one severity.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molt_compile.codes import Code
from molt_compile.diagnostics import Diagnostic
from molt_compile.paths import path_base
from molt_compile.source import SourceMap

GROUP_ESTIMATORS = frozenset({"rloo", "reinforce_baseline", "grpo", "dr_grpo"})
"""Estimators whose baseline is the group of rollouts of one prompt (C1, C7)."""


FINDING = Code("", "", "error")
"""The row a check's diagnostics are built with; `run_rules` stamps the rule's own code, name and severity."""


def diag(
    source: SourceMap, path: str, message: str, help: str = "", related: Iterable[str | tuple[str, str]] = ()
) -> Diagnostic:
    """A finding of the running rule at `path`'s position; `related` are other keys (`"a.b"` or `("a.b", "note")`).
    The rule's code is not written here: `run_rules` stamps the row's."""
    return FINDING.at(source, path, message, help, related)


def dv(derived: Any, name: str, default: Any = None) -> Any:
    """A derived value, or `default` when derive did not produce it (derive tolerates partial recipes)."""
    if derived is None:
        return default
    try:
        return derived.value(name, default)
    except Exception:  # a missing derived name must not crash the rule pass
        return default


def fsdp_roles(recipe: Any, derived: Any) -> list[str]:
    """FSDP roles that are built: actor, plus ref and critic when they exist (none under eval.only)."""
    if recipe.kind == "sft":
        return ["actor"]
    if recipe.eval.only:
        return []
    roles = ["actor"]
    roles += [r for r in ("ref", "critic") if dv(derived, f"{r}.exists", False)]
    return roles


def role_size_keys(role: str) -> tuple[str, str]:
    """The recipe keys that size a role's world (the critic is always actor-sized, J3)."""
    if role == "ref":
        return ("ref.nodes", "ref.gpus_per_node")
    return ("actor.nodes", "actor.gpus_per_node")


def is_set(source: SourceMap | None, path: str) -> bool:
    return bool(source is not None and source.is_set(path))


def runs_on_hf(derived: Any, facts: Any) -> bool:
    """True when a role's model runs on HF transformers: the plan's one backend (derived `model.backend`, from the
    policy's model) is `hf`, or it is `automodel` and this role's checkpoint (a reference or critic may be another
    architecture) has no AutoModel custom class, which nemo-automodel then loads through HF transformers (H9)."""
    return dv(derived, "model.backend") == "hf" or (facts is not None and not facts.native_automodel)


def agent_file_path(recipe: Any, source: SourceMap) -> Path | None:
    """The agent file as the compiler reads it: `agent.path` joined to the directory of the file that set it."""
    agent = recipe.agent
    if agent is None:
        return None
    p = Path(agent.path)
    base = path_base(source, "agent.path")
    return p if p.is_absolute() or base is None else base / p
