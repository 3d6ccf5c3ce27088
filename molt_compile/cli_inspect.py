"""`molt-compile explain`, `diff` and `rules`: what a recipe resolves to and why, what changes between two plans, and
the documentation of every diagnostic code (text tables, or `--format json`).

Added to the group in `molt_compile.cli`. Nothing here imports torch, ray, vllm or transformers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from molt_compile.cli_output import RECIPE, RECIPE_ROOTS, SET_HELP, catalog_tables, console, print_diagnostics


def _dump(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# ------------------------------------------------------------------------------------------------ explain
def _flatten(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        out: list[tuple[str, Any]] = []
        for k, v in value.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return [(prefix, value)]


def _where(result: Any, path: str) -> str:
    pos = result.source.positions.get(path)
    if pos is None:
        return "default"
    if pos.layer == "--set":
        text = "--set"
    else:
        text = f"{pos.file}:{pos.line}"
    earlier = result.loaded.overridden.get(path) if result.loaded else None
    if earlier:
        text += f" (over {earlier[-1].file}:{earlier[-1].line})"
    return text


def _input_label(result: Any, model: Any, name: str) -> str:
    """An input of a derived value: a recipe key with where it was set, or another derived value by name."""
    from molt_compile import schema_walk as sw

    segments: list[Any] = [int(s) if s.isdigit() else s for s in name.split(".")]
    is_key = name not in result.derived and sw.type_at(model, segments)[0] is not None
    return f"{name} ({_where(result, name)})" if is_key else name


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@click.command()
@click.argument("recipe", type=RECIPE)
@click.argument("keys", nargs=-1)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--smoke", is_flag=True, help="Show what the smoke pass (`RECIPE --smoke`) changes, and why.")
@click.option(
    "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True, help="Output format."
)
@RECIPE_ROOTS
def explain(
    recipe: str,
    keys: tuple[str, ...],
    sets: tuple[str, ...],
    smoke: bool,
    fmt: str = "text",
    roots: tuple[Path, ...] = (),
) -> None:
    """Print every resolved value of RECIPE with where it came from (file:line, --set, default) and what it
    means, then every derived value with its reason, then the catalog keys (`model.arch`, `cluster.gpu`;
    also `molt-compile catalog`). KEY... shows only those keys and what lies under them (globs: `*.lr`), and the
    derived values they name."""
    from rich.markup import escape
    from rich.table import Table

    from molt_compile import schema_walk as sw
    from molt_compile.compile import compile_recipe

    result = compile_recipe(Path(recipe), sets, lower=False, roots=roots)
    if result.recipe is None:
        print_diagnostics(result.diagnostics, result, "text")
        sys.exit(result.exit_status or 2)
    if smoke:
        sys.exit(_explain_smoke(result))
    out = console(pipe_width=240)  # piped: one row per line, so that grep finds a key with its source
    model = type(result.recipe)
    rows = []
    table = Table(
        title=f"{result.source.root_file if result.source else recipe}: resolved values", title_justify="left"
    )
    wide = out.width >= 160  # else (a 100-column terminal) every column folds, the meaning most
    table.add_column("key", no_wrap=wide, overflow="fold")
    table.add_column("value", overflow="fold", max_width=40 if wide else 20)
    table.add_column("source", no_wrap=wide, overflow="fold")
    table.add_column("meaning", overflow="fold", min_width=60 if wide else None)
    data = result.recipe.model_dump(mode="json", by_alias=True)
    for path, value in _flatten(data, ""):
        segments: list[Any] = [int(s) if s.isdigit() else s for s in path.split(".")]
        doc = sw.field_doc(model, segments) or sw.field_doc(model, segments[:-1])
        if matches(path, keys):
            rows.append((path, value, _where(result, path), doc))
            table.add_row(*map(escape, (path, _show(value), _where(result, path), doc or "")))
    derived_rows = [
        dv
        for dv in (result.derived.values() if result.derived is not None else [])
        if matches(dv.name, keys) or any(matches(i, keys) for i in dv.inputs) and keys
    ]
    if fmt == "json":
        explain_json(result, rows, derived_rows)
        sys.exit(result.exit_status)
    if keys and not rows and not derived_rows:
        click.echo(f"molt-compile: no recipe key or derived value matches {' '.join(keys)}", err=True)
        sys.exit(2)
    out.print(table)
    if result.derived is None:
        click.echo("derived values: the derive pass is not available in this build")
    else:
        derived = Table(title="derived values", title_justify="left")
        for column in ("name", "value", "reason", "inputs"):
            derived.add_column(column, overflow="fold")
        for dv in derived_rows:
            inputs = ", ".join(_input_label(result, model, i) for i in dv.inputs)
            derived.add_row(*map(escape, (dv.name, _show(dv.value), dv.reason, inputs)))
        out.print(derived)
    for table in catalog_tables() if not keys else ():
        out.print(table)
    # Errors and warnings in full; infos by code only (each explains a value the tables above already give with
    # its reason), so that explain stays readable at 100 columns.
    shown = [d for d in result.diagnostics if d.severity != "info"]
    if shown:
        print_diagnostics(shown, result, "text")
    infos = sorted({d.code for d in result.diagnostics if d.severity == "info"})
    if infos:
        click.echo(f"infos: {', '.join(infos)} (`molt-compile {recipe}` prints them)")
    sys.exit(result.exit_status)


def _explain_smoke(result: Any) -> int:
    from rich.markup import escape
    from rich.table import Table

    from molt_compile.smoke import smoke_plan

    sp = smoke_plan(result.recipe, result.derived, result.source)
    table = Table(title=f"{result.source.root_file}: the smoke pass (`--smoke`)", title_justify="left")
    for column in ("key", "recipe", "smoke", "why"):
        table.add_column(column, overflow="fold")
    for phase, changes in ((0, sp.changes), (1, sp.phase_changes[1]), (2, sp.phase_changes[2])):
        for c in changes:
            table.add_row(
                *map(escape, (c.key + (f" (phase {phase})" if phase else ""), _show(c.old), _show(c.new), c.why))
            )
    console(pipe_width=200).print(table)
    for note in sp.notes:
        click.echo(f"note: {note}")
    spec = sp.model_spec  # a shrunk config, a tiny VLM builder's options, or the recipe's own model (none)
    shape = spec.get("config", spec.get("options"))
    click.echo(f"model: {spec['architecture']}{'' if shape is None else ' ' + json.dumps(shape)} -> {sp.model_dir}")
    click.echo(f"outputs: {sp.work_dir}; everything else is the recipe's own")
    return 0


# ------------------------------------------------------------------------------------------------ diff
@click.command()
@click.argument("a", type=RECIPE)
@click.argument("b", type=RECIPE)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help=SET_HELP + " Applies to both A and B.")
@click.option(
    "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True, help="Output format."
)
@RECIPE_ROOTS
def diff(a: str, b: str, sets: tuple[str, ...] = (), fmt: str = "text", roots: tuple[Path, ...] = ()) -> None:
    """Show what changes between the plans of recipes A and B (exit 0 when equal, 1 when they differ).
    `--set` overrides apply to both."""
    from molt_compile.compile import compile_recipe
    from molt_compile.diff import diff_results

    results = [compile_recipe(Path(a), sets, roots=roots), compile_recipe(Path(b), sets, roots=roots)]
    for r in results:
        if r.exit_status == 2:
            print_diagnostics(r.diagnostics, r, "text")
            sys.exit(2)
    if fmt == "json":
        sys.exit(1 if diff_json(*results) else 0)
    lines, changed = diff_results(*results)
    for line in lines:
        click.echo(line)
    sys.exit(1 if changed else 0)


# ------------------------------------------------------------------------------------------------ rules
@click.command()
@click.argument("code", required=False)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    help="Output format (json: every code, or CODE's documentation).",
)
def rules(code: str | None, fmt: str = "text") -> None:
    """List every diagnostic code (loader, schema, rules, placement, capability), or print the documentation of CODE."""
    if fmt == "json":
        sys.exit(rules_json(code))
    from molt_compile.rules import catalog

    codes = catalog()
    if code:
        row = codes.get(code.upper())
        if row is None:
            from molt_compile.schema_walk import closest

            guess = closest(code.upper(), list(codes))
            click.echo(
                f"molt-compile: unknown code `{code}`" + (f"; did you mean `{guess}`?" if guess else ""), err=True
            )
            sys.exit(2)
        click.echo(f"{row.code} {row.name} ({row.severity}{', blocker' if row.blocker else ''})\n")
        click.echo(row.doc or "(no documentation)")
        if row.appendix is not None:
            click.echo(f"\n{row.appendix()}")
        return
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="diagnostic codes", title_justify="left")
    for column in ("code", "name", "severity", "checks"):
        table.add_column(column, overflow="fold")
    for row in codes.values():
        table.add_row(row.code, row.name, row.severity, escape(row.summary))  # `[low, high]` is text, not markup
    console().print(table)


# ------------------------------------------------------------------------------------------------ json views
def explain_json(result: Any, rows: list[tuple[str, Any, str, str]], derived: list[Any]) -> None:
    """`explain --format json`: {"values": [...], "derived": [...], "diagnostics": [...]}."""
    _dump(
        {
            "recipe": str(result.source.root_file),
            "values": [{"key": k, "value": v, "source": src, "meaning": doc} for k, v, src, doc in rows],
            "derived": [
                {"name": dv.name, "value": dv.value, "reason": dv.reason, "inputs": list(dv.inputs)} for dv in derived
            ],
            "diagnostics": [d.to_json() for d in result.diagnostics],
        }
    )


def diff_json(a: Any, b: Any) -> bool:
    """`diff --format json`: every changed value per section, {"changed": bool, "sections": {...}}."""
    from molt_compile.diff import diff_values

    sections, changed = diff_values(a, b)
    _dump(
        {
            "a": str(getattr(a.source, "root_file", "A")),
            "b": str(getattr(b.source, "root_file", "B")),
            "changed": changed,
            "fingerprint": [getattr(a.plan, "fingerprint", None), getattr(b.plan, "fingerprint", None)],
            "sections": sections,
        }
    )
    return changed


def rules_json(code: str | None) -> int:
    """`rules --format json`: {"codes": [{code, name, severity, kind, doc}, ...]} (one entry with CODE); exit 2 when
    CODE is unknown."""
    from molt_compile.rules import catalog

    rows = [
        {"code": c.code, "name": c.name, "severity": c.severity, "kind": c.area, "doc": c.doc}
        for c in catalog().values()
    ]
    if code:
        rows = [r for r in rows if r["code"] == code.upper()]
        if not rows:
            click.echo(f"molt-compile: unknown code `{code}`", err=True)
            return 2
    _dump({"codes": rows})
    return 0


def matches(key: str, wanted: tuple[str, ...]) -> bool:
    """`explain RECIPE KEY...`: a key is shown when it is one of KEY or lies under one (`actor.optimizer` shows
    `actor.optimizer.lr`); a KEY with `*` is a glob."""
    import fnmatch

    return not wanted or any(key == w or key.startswith(w + ".") or fnmatch.fnmatchcase(key, w) for w in wanted)
