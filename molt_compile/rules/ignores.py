"""The recipe's `ignore:` table: unknown codes, missing reasons, and ignores that suppress nothing."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe


def unknown_code_in_ignore(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap, *, known: frozenset[str]
) -> Iterator[Diagnostic]:
    """## What it checks
    Every code under `ignore:` is a rule code of the catalog (`molt-compile rules` lists them).

    ## Why it matters
    A typo in a suppression silently suppresses nothing while the author believes the finding is handled.

    ## Example
    ```yaml
    ignore: {PLACE077: "GPUs kept free on purpose"}
    ```

    ## Use instead
    ```yaml
    ignore: {}
    ```

    ## References
    DESIGN.md §3 (`ignore:`)
    """
    for code in recipe.ignore:
        if code not in known:
            import difflib  # a did-you-mean only: not imported by every compile

            close = difflib.get_close_matches(code, sorted(known), n=1)
            yield diag(
                source,
                f"ignore.{code}",
                f"ignore: {code} is not a rule code",
                f"did you mean {close[0]}?" if close else "see `molt-compile rules` for the codes",
            )


def ignore_without_reason(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Every suppression under `ignore:` gives a reason (a non-empty string).

    ## Why it matters
    A suppression is a decision; the next reader needs to know why the finding does not apply.

    ## Example
    ```yaml
    cluster: {nodes: 2}
    ignore: {PLACE007: ""}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2}
    ignore: {PLACE007: "second node kept for an eval server"}
    ```

    ## References
    DESIGN.md §3 (`ignore:`)
    """
    for code, reason in recipe.ignore.items():
        if not str(reason).strip():
            yield diag(
                source, f"ignore.{code}", f"ignore: {code} has no reason", f'write why: ignore: {{{code}: "<reason>"}}'
            )


def unused_ignore(
    recipe: RlRecipe | SftRecipe,
    derived: Derived,
    source: SourceMap,
    *,
    known: frozenset[str],
    fired: frozenset[str] = frozenset(),
) -> Iterator[Diagnostic]:
    """## What it checks
    Every code under `ignore:` suppressed at least one diagnostic of this recipe. `run_rules` calls this check last,
    with the codes that fired; an unknown code is reported by IGNORE001 instead.

    ## Why it matters
    A stale suppression hides the next real finding of that rule (mypy's `warn-unused-ignores`).

    ## Example
    ```yaml
    ignore: {PLACE007: "GPUs kept free on purpose"}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2}
    ignore: {PLACE007: "GPUs kept free on purpose"}
    ```

    ## References
    DESIGN.md §3
    """
    for code in recipe.ignore:
        if code in known and code not in fired:
            yield diag(
                source, f"ignore.{code}", f"ignore: {code} suppresses nothing in this recipe", f"remove ignore.{code}"
            )
