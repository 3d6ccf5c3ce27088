"""Console output shared by the `molt-compile` commands (`cli.py`, `cli_inspect.py`, `cli_more.py`): a rich console that does not
depend on $COLUMNS when piped, diagnostics in the chosen format, and the model and GPU catalog tables."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

FORMATS = click.Choice(["text", "json", "github"])
SET_HELP = (
    "Override a recipe key (dotted path; the value is read as YAML; a relative path is relative to the project root, "
    "not the working directory). Repeatable."
)
RECIPE_ROOTS = click.option(
    "--recipe-root",
    "roots",
    multiple=True,
    metavar="DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="A directory of trusted recipes that `extends` may read, besides the recipe's own repository "
    "(also $MOLT_RECIPERECIPE_ROOTS, `:`-separated). Repeatable.",
)

RECIPE = click.Path()
"""A recipe argument: typed as a path so that shell completion offers file names (no existence check here: the
loader reports a missing file as a diagnostic)."""


def console(stderr: bool = False, pipe_width: int = 140) -> Any:
    """A rich console: colour only on a TTY; a fixed width when piped, so that output does not depend on $COLUMNS."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(
        file=stream,
        highlight=False,
        soft_wrap=False,
        width=None if tty else pipe_width,
        force_terminal=tty,
        no_color=not tty,
    )


def print_diagnostics(diags: list[Any], result: Any, fmt: str) -> None:
    from molt_compile import render

    lines = result.source.lines if result.source else {}
    root = result.source.root_file if result.source else None
    if fmt == "github":
        sys.stdout.write(render.render_github(diags))
    elif sys.stdout.isatty():
        render.print_rich(console(), diags, lines, root)
    else:
        text = render.render_text(diags, lines, root)
        sys.stdout.write(text + ("\n" if text else ""))


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def catalog_tables() -> list[Any]:
    """The model and GPU catalogs (schemas/catalog.py) as rich tables: the keys `model.arch` and `cluster.gpu` take."""
    from rich.table import Table

    from schemas.catalog import GPUS, MODELS

    models = Table(
        title="model catalog: keys for model.arch (else <model.path>/config.json is read)", title_justify="left"
    )
    for column in ("model.arch", "checkpoint", "params (active)", "heads / kv", "experts", "notes"):
        models.add_column(column, overflow="fold")
    for m in MODELS.values():
        params = _count(m.params_total) + (f" ({_count(m.params_active)})" if m.is_moe else "")
        notes = ", ".join(
            n for n, on in (("VLM", m.is_vlm), ("MTP", m.has_mtp_head), ("AutoModel", m.native_automodel)) if on
        )
        models.add_row(
            m.key,
            m.hf_name,
            params,
            f"{m.heads} / {m.kv_heads}",
            f"{m.experts} top-{m.experts_per_token}" if m.is_moe else "-",
            notes,
        )
    gpus = Table(title="GPU catalog: keys for cluster.gpu", title_justify="left")
    for column in ("cluster.gpu", "memory GiB", "GPUs per node", "CPUs per node"):
        gpus.add_column(column)
    for g in GPUS.values():
        gpus.add_row(g.key, f"{g.memory_gib:g}", str(g.gpus_per_node), str(g.cpus_per_node or "-"))
    return [models, gpus]
