"""Renderings of diagnostics: compiler-style text, JSON for tools, GitHub workflow annotations.

Text copies ruff's layout:

    error[SCHEMA001] unknown-key: unknown key `coeff` in `algo.kl`
      --> recipes/x.yaml:11:8  (algo.kl.coeff; set in recipes/x.yaml)
       |
    11 |   kl: {coeff: 1}
       |        ^^^^^
       = help: did you mean `coef`?
       = docs: molt-compile rules SCHEMA001

Rendering is pure (strings in, strings out); colour is added by the CLI with rich, and only on a TTY.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from molt_compile.diagnostics import Diagnostic

_STOP = set(" \t,:]}#")


def _caret_width(line: str, col: int) -> int:
    """Width of the token that starts at `col` (1-based): a quoted string, or a run up to a delimiter."""
    i = col - 1
    if i >= len(line):
        return 1
    if line[i] in "\"'":
        end = line.find(line[i], i + 1)
        return (end - i + 1) if end > i else len(line) - i
    if line[i] in "[{":
        depth, j = 0, i
        while j < len(line):
            depth += line[j] in "[{"
            depth -= line[j] in "]}"
            if depth == 0:
                return j - i + 1
            j += 1
        return len(line) - i
    j = i
    while j < len(line) and line[j] not in _STOP:
        j += 1
    return max(1, j - i)


def _origin(d: Diagnostic, root_file: str | None) -> str:
    if d.origin == "--set":
        return "set by --set"
    if d.origin in ("default", "derived"):
        return d.origin
    if d.file and d.line and d.path:
        return f"set in {d.file}"
    return ""


def diagnostic_lines(d: Diagnostic, lines: dict[str, list[str]], root_file: str | None = None) -> list[tuple[str, str]]:
    """One diagnostic as (text, style) lines; style names: header-error/-warning/-info, arrow, gutter, source,
    caret, help, note."""
    out: list[tuple[str, str]] = []
    name = f" {d.name}" if d.name else ""
    out.append((f"{d.severity}[{d.code}]{name}: {d.message}", f"header-{d.severity}"))
    source = lines.get(d.file or "", [])
    gutter = len(str(d.line)) if d.line else 1
    pad = " " * gutter
    where = d.file or ""
    if d.file and d.line:
        where += f":{d.line}" + (f":{d.col}" if d.col else "")
    detail = "; ".join(x for x in (d.path, _origin(d, root_file)) if x)
    if where or detail:
        loc = f"{pad}--> {where}" if where else f"{pad}--> "
        out.append((loc + (f"  ({detail})" if detail else ""), "arrow"))
    if d.line and 0 < d.line <= len(source):
        text = source[d.line - 1].replace("\t", " ")
        out.append((f"{pad} |", "gutter"))
        out.append((f"{d.line} | {text}", "source"))
        if d.col:
            # A key or value gets a caret under the whole token; a point in the text (a syntax error) gets one.
            width = _caret_width(text, d.col) if d.path else 1
            out.append((f"{pad} | " + " " * (d.col - 1) + "^" * width, "caret"))
    for r in d.related:
        at = f"{r.file}:{r.line}" + (f":{r.col}" if r.col else "") if r.file and r.line else (r.file or "")
        note = f" {r.note}" if r.note else ""
        what = f"`{r.path}`{note}" if r.path else note.strip()
        out.append((f"{pad} = note: {what}" + (f" --> {at}" if at else ""), "note"))
    if d.help:
        out.append((f"{pad} = help: {d.help}", "help"))
    if d.code:
        out.append((f"{pad} = docs: molt-compile rules {d.code}", "note"))
    return out


def count_line(diags: Iterable[Diagnostic], prefix: str) -> str:
    diags = list(diags)
    errors = sum(d.severity == "error" for d in diags)
    warnings = sum(d.severity == "warning" for d in diags)
    return f"{prefix}: {_plural(errors, 'error')}, {_plural(warnings, 'warning')}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def render_text(diags: Iterable[Diagnostic], lines: dict[str, list[str]], root_file: str | None = None) -> str:
    """Plain text of all diagnostics, a blank line between them."""
    blocks = ["\n".join(t for t, _ in diagnostic_lines(d, lines, root_file)) for d in diags]
    return "\n\n".join(blocks) + ("\n" if blocks else "")


_STYLES = {
    "header-error": "bold red",
    "header-warning": "bold yellow",
    "header-info": "bold cyan",
    "arrow": "blue",
    "gutter": "blue",
    "source": "",
    "caret": "bold red",
    "help": "green",
    "note": "dim",
}


def print_rich(
    console: Any, diags: Iterable[Diagnostic], lines: dict[str, list[str]], root_file: str | None = None
) -> None:
    """Print diagnostics with colour through a rich Console (the CLI uses this only on a TTY)."""
    from rich.text import Text

    for d in diags:
        for text, style in diagnostic_lines(d, lines, root_file):
            console.print(Text(text, style=_STYLES.get(style, "")), soft_wrap=True)
        console.print()


def summary_dict(diags: list[Diagnostic], exit_status: int, **extra: Any) -> dict[str, Any]:
    return {
        "errors": sum(d.severity == "error" for d in diags),
        "warnings": sum(d.severity == "warning" for d in diags),
        "infos": sum(d.severity == "info" for d in diags),
        "exit_status": exit_status,
        **extra,
    }


def render_json(diags: list[Diagnostic], plan_json: str | None, summary: dict[str, Any]) -> str:
    """`{"diagnostics": [...], "plan": {...} | null, "summary": {...}}`, the plan embedded as an object."""
    doc = {
        "diagnostics": [d.to_json() for d in diags],
        "plan": json.loads(plan_json) if plan_json else None,
        "summary": summary,
    }
    return json.dumps(doc, indent=2, sort_keys=False) + "\n"


def _gh_escape_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_escape_prop(s: str) -> str:
    return _gh_escape_data(s).replace(":", "%3A").replace(",", "%2C")


def render_github(diags: Iterable[Diagnostic]) -> str:
    """GitHub Actions workflow commands: `::error file=F,line=L,col=C,title=CODE::message`."""
    level = {"error": "error", "warning": "warning", "info": "notice"}
    out = []
    for d in diags:
        props = []
        if d.file:
            props.append(f"file={_gh_escape_prop(d.file)}")
        if d.line:
            props.append(f"line={d.line}")
        if d.col:
            props.append(f"col={d.col}")
        props.append(f"title={_gh_escape_prop(d.code)}")
        message = d.message + (f" ({d.path})" if d.path and d.path not in d.message else "")
        if d.help:
            message += f"\nhelp: {d.help}"
        out.append(f"::{level[d.severity]} {','.join(props)}::{_gh_escape_data(message)}")
    return "\n".join(out) + ("\n" if out else "")
