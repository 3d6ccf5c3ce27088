"""Diagnostics: the compiler's only way to report a problem.

A diagnostic is a record; text, JSON and GitHub annotations are renderings of it (`render.py`). Every pass
returns diagnostics instead of raising; `compile()` collects them all, sorts them and decides the exit status:
0 no errors (warnings allowed), 1 errors, 2 unusable input or usage (a *blocker*: nothing after it can run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass(frozen=True)
class Related:
    """Another recipe key involved in a diagnostic, with where it was set."""

    path: str
    file: str | None = None
    line: int | None = None
    col: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Diagnostic:
    """One finding of the compiler.

    `path` is the dotted recipe key that is wrong (`actor.mesh.ep`); `file:line:col` is where its value was
    written (1-based), or None when the value is a default or came from `--set`. `help` is the smallest fix.
    `blocker` marks input the compiler cannot go on with (unreadable file, YAML syntax, `extends`, `--set`):
    exit status 2 instead of 1.
    """

    code: str
    severity: Severity
    message: str
    path: str = ""
    file: str | None = None
    line: int | None = None
    col: int | None = None
    help: str = ""
    related: tuple[Related, ...] = ()
    name: str = ""
    blocker: bool = False
    origin: str = ""
    """Where the value came from when it was not written in a file: `--set`, `default`, or `derived`."""

    def sort_key(self) -> tuple:
        return (self.file or "~", self.line or 0, self.col or 0, SEVERITY_ORDER[self.severity], self.code, self.path)

    def to_json(self) -> dict:
        return {
            "code": self.code,
            "name": self.name,
            "severity": self.severity,
            "message": self.message,
            "path": self.path,
            "file": self.file,
            "line": self.line,
            "col": self.col,
            "help": self.help,
            "origin": self.origin,
            "related": [r.__dict__ for r in self.related],
        }


@dataclass
class Diagnostics:
    """An ordered, de-duplicated collection of diagnostics."""

    items: list[Diagnostic] = field(default_factory=list)

    def add(self, *diags: Diagnostic) -> None:
        for d in diags:
            if d not in self.items:
                self.items.append(d)

    def extend(self, diags) -> None:
        self.add(*diags)

    def sorted(self) -> list[Diagnostic]:
        return sorted(self.items, key=Diagnostic.sort_key)

    @property
    def has_errors(self) -> bool:
        return any(d.severity == "error" for d in self.items)

    @property
    def has_blockers(self) -> bool:
        return any(d.blocker for d in self.items)

    def exit_status(self) -> int:
        if self.has_blockers:
            return 2
        return 1 if self.has_errors else 0
