"""What every rule module shares: the finding builder and small lookups (the row type is `codes.Code`).

A check is `check(recipe, derived, source) -> Iterable[Diagnostic]`. It never raises and never prints. It sets
`path` (the key that is wrong), `message` (with the numbers), `help` (the smallest fix) and `related` (the other
keys involved); `run_rules` stamps the row's `code`, `name` and `severity`, so a rule never repeats its code and one
code has one severity.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from molt_compile.codes import Code
from molt_compile.diagnostics import Diagnostic
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


def _resolved_parent(file: str) -> Path:
    # abspath as derive.resolve_path does (no cache: a display path is relative to the working directory of the
    # moment, and tests change it)
    return Path(os.path.abspath(file)).parent


def path_base(source: SourceMap | None, key: str) -> Path | None:
    """Directory a relative path at `key` is resolved against, exactly as lowering does (`derive.resolve_path`): the
    file that set it (a base resolves against itself), or the job root (the recipe's project root; its directory
    outside a project) for `--set` and defaults. None without a source map (a bare recipe in tests): path checks
    are skipped."""
    if source is None or not source.root_file:
        return None
    pos = source.pos(key)
    if pos.layer == "file" and pos.file:
        return _resolved_parent(pos.file)
    return Path(source.job_root) if source.job_root else _resolved_parent(source.root_file)


def _facts(path: str | None, arch: str | None, base: str | None):
    from molt_compile.model_facts import resolve_model

    return resolve_model({"path": path, "arch": arch}, base)


def model_facts(recipe: Any, source: SourceMap | None):
    """Facts of the trained model (`model.arch`, else `model.path/config.json`), or None."""
    base = path_base(source, "model.path")
    return _facts(recipe.model.path, recipe.model.arch, str(base) if base else None)


def role_facts(recipe: Any, source: SourceMap | None, role: str):
    """Facts of a role's checkpoint: ref/critic `path` when set and readable, else the policy's (B9)."""
    section = getattr(recipe, role, None) if role != "actor" else None
    own_path = getattr(section, "path", None) if section is not None else None
    if own_path and own_path != recipe.model.path:
        base = path_base(source, f"{role}.path")
        found = _facts(own_path, None, str(base) if base else None)
        if found is not None:
            return found
        if role == "ref":
            return None  # a teacher of unknown architecture: nothing to check
    return model_facts(recipe, source)


def hf_fallback(recipe: Any, facts: Any) -> bool:
    """True when the trained models run on HF transformers: `model.backend: hf`, or no AutoModel custom class (H9)."""
    if recipe.model.backend == "hf":
        return True
    return facts is not None and not facts.native_automodel


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


def moe_dispatcher(recipe: Any) -> str:
    """The MoE token dispatcher, `model.moe_dispatcher` (Molt's env MOLT_MOE_DISPATCHER, B19; MOE015 moves it)."""
    return recipe.model.moe_dispatcher
