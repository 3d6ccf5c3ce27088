"""Paths as the plan writes them and as the compiler finds them on this machine.

A recipe path is resolved against the file that set it (a base in `recipes/base/` against itself) or, for `--set`
and schema defaults, against the job root; the plan writes it relative to the job root when inside it. Derive,
the lowering, the rules and the smoke pass share these helpers (no derivation here; nothing is imported back).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from molt_compile.source import SourceMap


def resolve_path(value: str, key: str, source: SourceMap | None = None) -> str:
    """A path from the recipe as the plan writes it: relative to the job root (the recipe's project root, where the
    job runs: `SourceMap.job_root`) when inside it, else absolute. The same from any working directory.

    A value written in a file is relative to that file (a base in `recipes/base/` resolves against itself); a
    value from `--set` or a schema default is relative to the job root (the recipe's directory when the recipe is
    in no project). Absolute paths stay absolute. Without a source map (unit tests of bare recipes) the working
    directory stands in for the job root. Never touches the file system.
    """
    if os.path.isabs(value):
        return os.path.normpath(value)
    if source is None:
        return plan_path(os.path.join(os.getcwd(), value), os.getcwd())
    pos = source.pos(key)
    root = source.job_root
    if pos.layer == "file" and pos.file:
        base = os.path.dirname(os.path.abspath(pos.file))
    else:
        base = root or os.path.dirname(os.path.abspath(source.root_file or "."))
    return plan_path(os.path.join(base, value), root)


def plan_path(absolute: str, root: str | None) -> str:
    """An absolute path as the plan writes it: relative to `root` when inside it (posix), else absolute."""
    absolute = os.path.normpath(absolute)
    if root:
        rel = os.path.relpath(absolute, root)
        if rel != ".." and not rel.startswith(".." + os.sep):
            return rel.replace(os.sep, "/")
    return absolute


def local_path(plan_value: str, source: SourceMap | None = None) -> str:
    """Where the compiler finds a plan path on this machine (to count rows, or to tell a local checkpoint from a
    hub name): joined to the job root, which need not be the working directory."""
    root = source.job_root if source is not None else None
    return os.path.join(root, plan_value) if root and not os.path.isabs(plan_value) else plan_value


def resolve_sources(spec: str, key: str, source: SourceMap | None = None) -> list[str]:
    """A comma-separated dataset spec as a list of project-root-relative sources (`path@data_dir` kept)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        path, at, rest = item.partition("@")
        out.append(resolve_path(path, key, source) + (at + rest if at else ""))
    return out


def _resolved_parent(file: str) -> Path:
    # abspath as resolve_path does (no cache: a display path is relative to the working directory of the
    # moment, and tests change it)
    return Path(os.path.abspath(file)).parent


def path_base(source: SourceMap | None, key: str) -> Path | None:
    """Directory a relative path at `key` is resolved against, exactly as lowering does (`resolve_path`): the
    file that set it (a base resolves against itself), or the job root (the recipe's project root; its directory
    outside a project) for `--set` and defaults. None without a source map (a bare recipe in tests): path checks
    are skipped."""
    if source is None or not source.root_file:
        return None
    pos = source.pos(key)
    if pos.layer == "file" and pos.file:
        return _resolved_parent(pos.file)
    return Path(source.job_root) if source.job_root else _resolved_parent(source.root_file)
