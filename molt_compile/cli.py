"""`molt-compile`: the command line.

    molt-compile RECIPE [--set k=v]... [--format text|json|github] [--plan-out F] [--slurm F] [--submit]
    molt-compile lint PATH...        every recipe under the paths (base fragments are not jobs)
    molt-compile schema              the JSON Schema of Recipe v1
    molt-compile explain RECIPE [KEY]...  every resolved value with where it came from, every derived value with why
    molt-compile diff A B            what changes between two recipes' plans
    molt-compile rules [CODE]        the rule catalog, or one rule's documentation
    molt-compile catalog [models|gpus]   the model and GPU catalog keys
    molt-compile init FILE           a starting recipe from a few flags or questions

A first argument that is not a subcommand is a recipe: `molt-compile recipes/x.yaml --submit` is the compile
command. Exit status: 0 no errors, 1 errors, 2 unusable input or usage. Imports stay lazy so that `--help` and a
compile are fast; nothing here imports torch, ray, vllm or transformers (`--submit` imports Ray's job client
inside `molt_compile.submit`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from molt_compile.cli_inspect import diff, explain, rules  # what a recipe resolves to, and the codes
from molt_compile.cli_more import catalog, init  # commands kept apart from the compile plumbing
from molt_compile.cli_output import FORMATS, RECIPE, RECIPE_ROOTS, SET_HELP
from molt_compile.cli_output import console as _console
from molt_compile.cli_output import print_diagnostics as _print_diagnostics

SCHEMA_ID = "urn:molt-recipes:schema:recipe:v1"
"""A URN, not a URL: nothing is served; editors find the schema through the relative `$schema=` comment. The last
part is the recipe format version (`version: 1`); `SCHEMA_IDS` names the per-kind schemas."""
SCHEMA_IDS = {None: SCHEMA_ID, "sft": "urn:molt-recipes:schema:recipe-sft:v1"}
SCHEMA_FILES = {None: "recipe.schema.json", "sft": "recipe_sft.schema.json"}


# ------------------------------------------------------------------------------------------------ helpers
def _short_summary(result: Any) -> str:
    r = result.recipe
    parts = [f"recipe `{r.name}` ({r.kind}) is valid"]
    if result.derived is not None and "cluster.used_gpus" in result.derived:
        parts.append(
            f"{result.derived.value('cluster.used_gpus')} of {result.derived.value('cluster.total_gpus')} devices used"
        )
    return "; ".join(parts)


def _drop_required(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _drop_required(v) for k, v in node.items() if k != "required"}
    if isinstance(node, list):
        return [_drop_required(v) for v in node]
    return node


def recipe_json_schema(kind: str | None = None) -> dict[str, Any]:
    """The JSON Schema of one recipe *file*, for editors (completion, hover docs, typos, bad enum values).

    Generated from the pydantic models, with one deliberate difference: no key is `required`. A file that
    `extends` a base legitimately omits `kind`, `version` or `model.path`; requiring them would paint every such
    recipe red. `molt-compile` checks the required keys after `extends` is resolved. The kind is an if/then/else:
    a file saying `kind: sft` is checked as SFT, any other as RL (so an error in one key is reported against the
    right kind, not as "matches neither"). A file that inherits `kind: sft` from a base says nothing about its
    kind: it names the SFT-only schema (`kind="sft"`, schemas/recipe_sft.schema.json) in its modeline.
    """
    from pydantic import TypeAdapter

    import schemas.recipe as recipe_module
    from schemas.recipe import Recipe

    schema = _drop_required(TypeAdapter(Recipe).json_schema(mode="validation"))
    schema.pop("discriminator", None)
    schema.pop("oneOf")
    if kind == "sft":
        schema["$ref"] = "#/$defs/SftRecipe"
    else:
        schema.update(
            {
                "if": {"properties": {"kind": {"const": "sft"}}, "required": ["kind"]},
                "then": {"$ref": "#/$defs/SftRecipe"},
                "else": {"$ref": "#/$defs/RlRecipe"},
            }
        )
    head = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_IDS[kind],
        "title": "Molt SFT recipe v1" if kind == "sft" else "Molt recipe v1",
        "description": (recipe_module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        + " This schema describes one file (keys may come from `extends`, so none is required here; molt-compile"
        " checks the merged recipe). Start a recipe with"
        f" `# yaml-language-server: $schema=../schemas/{SCHEMA_FILES[kind]}` for completion and hover docs"
        + (
            " (SFT recipes whose `kind: sft` comes from a base)."
            if kind == "sft"
            else "; an SFT recipe that inherits `kind: sft` names recipe_sft.schema.json instead."
        ),
    }
    return {**head, **schema}


# ------------------------------------------------------------------------------------------------ the group
class _RecipeOrCommand(click.Group):
    """A group whose default command is `compile`: an unknown first word is a recipe path."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names and args[0] != "--version":
            args = ["compile", *args]
        return super().parse_args(ctx, args)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        """The first word is a subcommand or a recipe: offer both (a `file` item lets the shell complete paths)."""
        from click.shell_completion import CompletionItem

        return [CompletionItem(incomplete, type="file"), *super().shell_complete(ctx, incomplete)]

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage("molt-compile", "RECIPE [OPTIONS]  |  COMMAND [ARGS]...")


@click.group(cls=_RecipeOrCommand, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="molt-recipes", prog_name="molt-compile")
def cli() -> None:
    """Check a Molt recipe for every illegal combination and lower it to a fingerprinted Ray job plan.

    \b
      molt-compile recipes/demo_math.yaml                 validate and summarise
      molt-compile recipes/glm5_ep256.yaml --submit       ... and run it on Ray
      molt-compile lint recipes/                          check every recipe (CI)
      molt-compile explain recipes/x.yaml --set a.b=1     where every value comes from
      molt-compile explain recipes/x.yaml actor.optimizer  ... only these keys
      molt-compile init my.yaml --arch qwen3-4b           a starting recipe
      molt-compile catalog models                         the model.arch keys

    \b
    Exit status:
      0  no errors (warnings and infos allowed)
      1  the recipe has errors: a rule or the schema rejects it (all are reported: an unknown or
         mistyped key is reported and dropped, and the rules run on the rest)
      2  unusable input or usage: a missing or unparsable file, a bad option or `--set`, a loader
         error (YAML syntax, an `extends` that cannot be read) after which no rule can run

    \b
    Shell completion (click): add to ~/.bashrc (zsh, fish: replace `bash`)
      eval "$(_MOLT_COMPILE_COMPLETE=bash_source molt-compile)"
    """


@cli.command("compile")
@click.argument("recipe", type=RECIPE)
@click.option(
    "--set",
    "sets",
    multiple=True,
    metavar="KEY=VALUE",
    help=SET_HELP,
)
@click.option("--format", "fmt", type=FORMATS, default="text", show_default=True, help="Output format.")
@click.option("--plan-out", type=click.Path(dir_okay=False, path_type=Path), help="Write the plan JSON here.")
@click.option(
    "--slurm",
    "slurm_out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Render the Slurm sbatch script for the plan here.",
)
@click.option("--submit", is_flag=True, help="Submit the plan as a Ray job (a local cluster without --address).")
@click.option("--address", metavar="URL", help="Ray Jobs address (http://HOST:8265). Default: launch.ray.address.")
@click.option("--follow", is_flag=True, help="With --submit: stream the job's logs until it ends.")
@click.option(
    "--smoke",
    is_flag=True,
    help="Run the recipe shrunk to this machine's CPUs: a random small model of "
    "its architecture, 2 steps, an eval, a checkpoint and a resume (`explain --smoke` shows the changes).",
)
@RECIPE_ROOTS
def compile_cmd(
    recipe: str,
    sets: tuple[str, ...],
    fmt: str,
    plan_out: Path | None,
    slurm_out: Path | None,
    submit: bool,
    address: str | None,
    follow: bool,
    smoke: bool,
    roots: tuple[Path, ...] = (),
) -> None:
    """Validate RECIPE, print its diagnostics and a summary of its plan."""
    from molt_compile.compile import compile_recipe
    from molt_compile.render import count_line, render_json, summary_dict

    if smoke or submit:
        _stays()  # a smoke run or a job submission goes on after the compile
    if smoke:
        if plan_out or slurm_out or submit:
            raise click.UsageError("--smoke runs the smoke recipe here; it takes no --plan-out, --slurm or --submit")
        sys.exit(_smoke(Path(recipe), sets, fmt))
    result = compile_recipe(Path(recipe), sets, roots=roots)
    plan = result.plan
    status = result.exit_status
    if fmt == "json":
        summary = summary_dict(
            result.diagnostics, status, recipe=recipe, fingerprint=getattr(plan, "fingerprint", None)
        )
        sys.stdout.write(render_json(result.diagnostics, plan.to_json() if plan is not None else None, summary))
    else:
        _print_diagnostics(result.diagnostics, result, fmt)
        if fmt == "text":
            if plan is not None:
                from molt_compile.memory import memory_report
                from molt_compile.render_plan import render_summary

                _console().print(render_summary(plan, memory_report(result.recipe, result.derived, result.source)))
            elif result.recipe is not None and status == 0:
                click.echo(_short_summary(result))
            click.echo(count_line(result.diagnostics, (result.source.root_file if result.source else None) or recipe))
    if status != 0:
        sys.exit(status)
    if plan_out:
        plan_out.parent.mkdir(parents=True, exist_ok=True)
        plan_out.write_text(plan.to_json())
        click.echo(f"plan written to {plan_out}", err=fmt != "text")
    if slurm_out:
        from molt_compile.slurm import render_sbatch, submit_hint

        try:
            script = render_sbatch(plan)
        except ValueError as err:  # SlurmRenderError: a value that no Slurm script can carry (names the key)
            click.echo(f"molt-compile: error: cannot write the Slurm script: {err}", err=True)
            sys.exit(2)
        slurm_out.parent.mkdir(parents=True, exist_ok=True)
        slurm_out.write_text(script)
        click.echo(f"Slurm script written to {slurm_out}", err=fmt != "text")
        unset = [k for k in ("account", "partition") if not getattr(result.recipe.launch.slurm, k)]
        if unset:  # legal, but on a shared cluster usually a mistake: say which defaults the job gets
            keys = " and ".join(f"launch.slurm.{k}" for k in unset)
            click.echo(
                f"warning: {keys} {'are' if len(unset) > 1 else 'is'} unset: the job gets the cluster's "
                f"default {' and '.join(unset)}",
                err=fmt != "text",
            )
        click.echo(submit_hint(slurm_out), err=fmt != "text")
    if submit:
        from molt_compile.submit import submit as submit_fn

        job_root = result.source.job_root if result.source else None  # the plan's paths are relative to it
        sys.exit(
            submit_fn(
                plan,
                address=address or result.recipe.launch.ray.address,
                follow=follow,
                root=Path(job_root) if job_root else None,
            )
        )


def _smoke(recipe: Path, sets: tuple[str, ...], fmt: str) -> int:
    from molt_compile.smoke_run import run_smokes

    (verdict,) = run_smokes([(recipe, sets)], say=lambda line: click.echo(line, err=True), announce=False)
    result = verdict.compile_result
    if result is not None and result.diagnostics:
        _print_diagnostics([d for d in result.diagnostics if d.severity != "info"], result, fmt)
    click.echo("\n".join(verdict.lines()))
    return 0 if verdict.ok else 1


# ------------------------------------------------------------------------------------------------ lint
def _recipe_files(paths: tuple[str, ...]) -> tuple[list[Path], list[str]]:
    files: list[Path] = []
    missing: list[str] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.suffix in (".yaml", ".yml") and f.is_file()))
        elif p.exists() or p.suffix in (".yaml", ".yml"):
            files.append(p)
        else:
            missing.append(str(p))
    return files, missing


@cli.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@click.option("--format", "fmt", type=FORMATS, default="text", show_default=True, help="Output format.")
@click.option(
    "--capabilities/--no-capabilities",
    default=True,
    show_default=True,
    help="Check each recipe against what this runtime implements (CAP001). --no-capabilities checks Molt's "
    "rules only (recipes meant for another runtime build).",
)
@RECIPE_ROOTS
def lint(paths: tuple[str, ...], fmt: str, capabilities: bool = True, roots: tuple[Path, ...] = ()) -> None:
    """Check every recipe under PATHS (*.yaml, recursively). Base fragments (files under a `base/` directory, and
    files that another recipe extends and that lack `kind` or `name`) are checked as YAML, not as jobs. No recipe
    under PATHS is a usage error (exit 2)."""
    import os

    from molt_compile.compile import compile_recipe
    from molt_compile.render import count_line, render_json, summary_dict

    files, missing = _recipe_files(paths)
    if missing:
        raise click.UsageError(f"no such file or directory: {', '.join(missing)}")
    if not files:  # an empty or mistyped directory would otherwise pass CI having checked nothing
        raise click.UsageError(f"no *.yaml or *.yml recipe under {', '.join(paths)}")
    results = [compile_recipe(f, roots=roots, capabilities=capabilities) for f in files]
    extended = {t for r in results if r.loaded for t in r.loaded.extends_targets}
    seen: set[tuple] = set()
    all_diags: list[Any] = []
    checked = fragments = 0
    lines: dict[str, list[str]] = {}
    for f, r in zip(files, results, strict=True):
        loaded = r.loaded
        own = loaded.own_keys if loaded else frozenset()
        fragment = loaded is not None and (
            loaded.is_fragment or (Path(os.path.realpath(f)) in extended and not {"kind", "name"} <= own)
        )
        if fragment and loaded is not None:
            fragments += 1
            diags = [d for d in loaded.diagnostics if d.code.startswith(("YAML", "LOAD"))]
        else:
            checked += 1
            diags = r.diagnostics
        if r.source:
            lines.update(r.source.lines)
        for d in diags:
            key = (d.code, d.file, d.line, d.col, d.message, d.path)
            if key not in seen:
                seen.add(key)
                all_diags.append(d)
    from molt_compile.diagnostics import Diagnostics

    bag = Diagnostics()
    bag.extend(all_diags)
    ordered = bag.sorted()
    status = 1 if bag.has_errors else 0
    label = f"checked {checked} recipe{'s' if checked != 1 else ''}"
    if fmt == "json":
        sys.stdout.write(
            render_json(ordered, None, summary_dict(ordered, status, recipes=checked, fragments=fragments))
        )
    else:
        from molt_compile import render

        if fmt == "github":
            sys.stdout.write(render.render_github(ordered))
        elif sys.stdout.isatty():
            render.print_rich(_console(), ordered, lines)
        else:
            text = render.render_text(ordered, lines)
            sys.stdout.write(text + ("\n" if text else ""))
        suffix = f" ({fragments} base fragment{'s' if fragments != 1 else ''} not linted as jobs)" if fragments else ""
        click.echo(count_line(ordered, label) + suffix)
    sys.exit(status)


# ------------------------------------------------------------------------------------------------ schema
@cli.command()
@click.option("--kind", type=click.Choice(["sft"]), help="The SFT-only schema (schemas/recipe_sft.schema.json).")
def schema(kind: str | None = None) -> None:
    """Print the JSON Schema of Recipe v1 (committed as schemas/recipe.schema.json; `--kind sft`:
    schemas/recipe_sft.schema.json, for SFT recipes that inherit `kind: sft` from a base)."""
    click.echo(json.dumps(recipe_json_schema(kind), indent=2))


# ------------------------------------------------------------------------------------------------ explain
def _no_pydantic_plugin_loader() -> None:
    """With every plugin disabled, pydantic's plugin loader still imports `importlib.metadata` (email, zipfile, csv:
    ~13 ms of a cold compile) when the first validator is built, only to read PYDANTIC_DISABLE_PLUGINS and return no
    plugins. Hand it a loader module whose `get_plugins` gives that answer at once (pydantic imports nothing else
    from it). Only when the variable disables them all; a user's own plugin setting keeps pydantic's loader."""
    import os
    import types

    if os.environ.get("PYDANTIC_DISABLE_PLUGINS") not in ("__all__", "1", "true"):
        return
    loader = types.ModuleType("pydantic.plugin._loader", "No plugins: PYDANTIC_DISABLE_PLUGINS disables them all.")
    loader.get_plugins = tuple  # type: ignore[attr-defined]  # () as pydantic's loader returns when disabled
    sys.modules.setdefault(loader.__name__, loader)


def main() -> None:
    import os

    # pydantic scans every installed distribution's entry points for plugins on first use; in an environment
    # with the runtime's hundreds of packages that costs more than validating a recipe. The compiler uses none.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    _no_pydantic_plugin_loader()
    try:
        cli(prog_name="molt-compile")
    except BrokenPipeError:
        # The reader went away (`molt-compile lint recipes/ | head`): stop quietly, as other CLI tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


_STAYS = False
"""Set by a command that goes on working after its output (`--submit`, `--smoke`): `run` then ends the process the
ordinary way, with the garbage collector back on."""


def _stays() -> None:
    global _STAYS
    import gc

    _STAYS = True
    gc.enable()


def run() -> None:
    """The `molt-compile` program: `main` in a process that ends when it does. The garbage collector stays off (a
    compile makes few cycles: `lint recipes/` peaks 1.4 MiB higher without it; it cost ~10 ms a cold compile), and
    the process exits at once, without tearing down its modules (~20 ms) once its output is flushed; its files are
    closed by then. `main` itself returns (or raises SystemExit) as any click program does, for in-process callers."""
    import gc
    import os

    gc.disable()
    try:
        main()
        code: str | int | None = 0
    except SystemExit as e:
        code = e.code
    if _STAYS or isinstance(code, str):  # a message: Python prints it and exits 1
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BrokenPipeError:  # as in main: the reader went away
        code = 1
    os._exit(code or 0)


for command in (explain, diff, rules, catalog, init):
    cli.add_command(command)

if __name__ == "__main__":
    run()
