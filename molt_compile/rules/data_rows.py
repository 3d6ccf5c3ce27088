"""The rows of local data files (molt_rules.md L2, A4; issue 13): they parse, hold the recipe's columns, and have
prompts.

Files are read with `schemas/datafiles.py` (no datasets/pyarrow): JSON/JSONL rows are parsed within a budget of
`SCAN_BYTES` per file (the message says when a check stopped early); parquet, arrow and save_to_disk sources give
their columns from their headers. Files that are not visible here (cluster paths, hub datasets) are not read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.paths import path_base
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.datafiles import SCAN_BYTES, scan_json_rows, source_facts
from schemas.recipe import RlRecipe, SftData, SftRecipe


def _row_sources(recipe, source) -> list[tuple[str, str, str, str]]:
    """(recipe key, source as written, local path, split) of the row files the trainer or generator reads."""
    d = recipe.data
    keys = [("data.dataset", d.dataset, d.split)] if recipe.kind == "sft" else [("data.prompts", d.prompts, d.split)]
    if recipe.eval.dataset:
        keys.append(("eval.dataset", recipe.eval.dataset, recipe.eval.split))
    out = []
    for key, spec, split in keys:
        base = path_base(source, key)
        for src in (s.strip().split("@", 1)[0] for s in (spec or "").split(",") if s.strip()):
            p = Path(src)
            local = p if p.is_absolute() or base is None else base / p
            out.append((key, src, str(local), split))
    return out


def _scan(recipe, local: str, split: str):
    return scan_json_rows(local, split, (recipe.data.input_key,), recipe.data.input_key)


def _scanned(scan) -> str:
    return f"{scan.checked} rows checked" + ("" if scan.complete else f", the first {SCAN_BYTES >> 20} MiB")


def chat_rows_without_chat_template(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    RL: when the first row of a local prompt file holds a list of chat messages under `data.input_key`,
    `data.apply_chat_template` is true.

    ## Why it matters
    Message lists must be rendered with the tokenizer's chat template; Molt raises "Dataset rows are chat messages:
    pass --data.apply_chat_template" when the generator reads the first row, after the cluster is up.

    ## Example
    ```yaml
    data: {prompts: data/chat_prompts.jsonl, input_key: messages, apply_chat_template: false}
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/chat_prompts.jsonl, input_key: messages, apply_chat_template: true}
    ```

    ## References
    molt_rules.md L2
    """
    if recipe.data.apply_chat_template:
        return
    for key, src, local, split in _row_sources(recipe, source):
        first = source_facts(local, split).first_row
        if isinstance(first, dict) and isinstance(first.get(recipe.data.input_key), list):
            yield diag(
                source,
                "data.apply_chat_template",
                f"{src}: rows hold chat messages under "
                f"{recipe.data.input_key!r}, but data.apply_chat_template is false",
                "set data.apply_chat_template: true",
                [key, "data.input_key"],
            )
            return


def data_key_missing_from_rows(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The columns the recipe names (`data.input_key`, and `label_key` for RL or `output_key` for SFT) exist in each
    local data file: in the first row of a .jsonl/.json file (and `input_key` in every checked row), in the schema
    of a parquet, arrow or save_to_disk source.

    ## Why it matters
    A misspelled column is a `KeyError` when the first batch is built — after allocation, model loading and engine
    start-up. Files that are not local (cluster paths, hub datasets) are not read.

    ## Example
    ```yaml
    data: {prompts: data/prompts.jsonl, input_key: question}
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/prompts.jsonl, input_key: prompt}
    ```

    ## References
    molt_rules.md L2, A4
    """
    d = recipe.data
    wanted: list[tuple[str, str | None]] = [("data.input_key", d.input_key)]
    wanted.append(("data.output_key", d.output_key) if isinstance(d, SftData) else ("data.label_key", d.label_key))
    for key, src, local, split in _row_sources(recipe, source):
        facts = source_facts(local, split)
        if facts.columns is None:
            continue
        where = "first row has" if facts.line_based else "columns:"
        for k, col in wanted:  # the eval file is what differs when the training file has the column
            path, other = (k, key) if key.startswith("data.") else (key, k)
            if col and col not in facts.columns:
                yield diag(
                    source,
                    path,
                    f"{k} {col!r} is not a column of {src} ({where} {', '.join(sorted(facts.columns))})",
                    f"set {k} to one of the columns, or fix {key}",
                    [other],
                )
                continue
            scan = _scan(recipe, local, split) if facts.line_based and k == "data.input_key" else None
            if scan is not None and col in scan.missing:
                (first, count) = scan.missing[col]
                yield diag(
                    source,
                    path,
                    f"{count} row(s) of {src} have no {k} {col!r} (first: "
                    f"{src}{first.where}, which {first.what}; {_scanned(scan)})",
                    f"give every row the {col!r} column, or fix {key}",
                    [other],
                )


def data_row_malformed(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Every row of a local .jsonl/.json data file (prompts, SFT dataset, eval dataset) parses as a JSON object, and a
    local parquet/arrow/save_to_disk source has readable headers. Each file is checked up to its first 4 MiB.

    ## Why it matters
    The generator parses the rows when it starts; one bad line used to kill it with a bare `JSONDecodeError` that
    named neither the file nor the line, and the run hung (issue 13). The runtime now names the line too, but only
    after the cluster and the models are up.

    ## Example
    ```yaml
    data: {prompts: data/bad_rows.jsonl}
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/prompts.jsonl}
    ```

    ## References
    molt_rules.md A4, L2; DESIGN.md §4
    """
    for key, src, local, split in _row_sources(recipe, source):
        facts = source_facts(local, split)
        if facts.how.startswith("cannot be read"):
            yield diag(source, key, f"{src}: {facts.how}", "fix or regenerate the data file")
            continue
        scan = _scan(recipe, local, split) if facts.line_based else None
        if scan is None or not scan.malformed:
            continue
        first = scan.malformed[0]
        more = f"; {scan.malformed_count} malformed of {_scanned(scan)}" if scan.malformed_count > 1 else ""
        yield diag(
            source,
            key,
            f"{src}{first.where}: {first.what}{more}",
            "fix the row (one JSON object per line in .jsonl files)",
        )


def data_prompt_empty(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Rows of a local .jsonl/.json data file whose prompt (`data.input_key`) is empty: null, blank text, no messages,
    or messages with only blank contents. Each file is checked up to its first 4 MiB.

    ## Why it matters
    An empty prompt still costs a rollout group (or an SFT row) but teaches nothing; usually it is a broken
    export. It is a warning: a few empty rows can be deliberate.

    ## Example
    ```yaml
    data: {prompts: data/empty_prompts.jsonl}
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/prompts.jsonl}
    ```

    ## References
    molt_rules.md L2; DESIGN.md §4
    """
    for key, src, local, split in _row_sources(recipe, source):
        scan = _scan(recipe, local, split) if source_facts(local, split).line_based else None
        if scan is not None and scan.empty_count:
            yield diag(
                source,
                key,
                f"{src}: {scan.empty_count} row(s) with an empty prompt "
                f"{recipe.data.input_key!r} (first: {src}{scan.empty[0].where}; {_scanned(scan)})",
                "drop or fill those rows",
                ["data.input_key"],
            )


def data_counted_at_job_start(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The training data (RL `data.prompts`, SFT `data.dataset`) cannot be counted on the compiling machine: a path
    that exists only on the cluster, or a hub dataset name. The recipe compiles; this warning names what is
    deferred to the job's start.

    ## Why it matters
    The run's step count and its LR schedule's length (warmup and decay steps) follow from the number of rows
    (Molt B10, B11, M6), and the checks DATA006-DATA009 and BATCH009 read the rows. The plan carries what the job
    needs (`data.count_at_start`): at start the job counts the rows and derives those values with the compiler's own
    function (`schemas/schedule.py`), prints them, and refuses 0 steps (BATCH009); a bad row is reported, with its
    line, when the job reads it.
    Compiling where the data is (for example `--submit` from a machine that holds it) derives them here instead.

    ## Example
    ```yaml
    data: {prompts: /lustre/datasets/math/train.jsonl}   # only on the cluster
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/prompts.jsonl}   # or compile where the data is: counted and checked now
    ```

    ## References
    molt_rules.md B10, B11, M6; issue 30
    """
    if dv(derived, "data.count_at_start") is None:
        return
    key, count = (
        ("data.dataset", "data.sample_count") if recipe.kind == "sft" else ("data.prompts", "data.prompt_count")
    )
    why = derived[count].reason
    yield diag(
        source,
        key,
        f"{why}: the job counts the rows at its start; deferred until then: the step count (train.total_steps), "
        "the LR schedule's length (warmup and scheduler steps) and the checks that read the rows "
        "(DATA006-DATA009, BATCH009)",
        "nothing to do when the data is on the cluster (the job derives and prints these values at start); to check "
        "them now, compile where the data is",
    )


def data_rows_not_all_scanned(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A local .jsonl/.json data file larger than the row checks' budget (its first 4 MiB): says that the rows past it
    were not scanned.

    ## Why it matters
    DATA007, DATA008 and DATA009 read each file only up to 4 MiB, to keep compiling fast. Without this note a
    malformed row past that point compiled as clean as a file that was read whole; it is found only when the
    generator reaches it, on the cluster.

    ## Example
    ```yaml
    data: {prompts: big/rows_past_scan.jsonl}   # 4 MiB and a few rows more
    ```

    ## Use instead
    Validate a new large file once offline, or store it as parquet (its columns and types are read whole from
    the file's header):
    ```yaml
    data: {prompts: data/prompts_40gb.parquet}
    ```

    ## References
    DESIGN.md §4 (compiling stays fast); DATA008
    """
    for key, src, local, split in _row_sources(recipe, source):
        scan = _scan(recipe, local, split) if source_facts(local, split).line_based else None
        if scan is not None and not scan.complete:
            yield diag(
                source,
                key,
                f"{src}: only the first {SCAN_BYTES >> 20} MiB were scanned ({scan.checked} rows); the rows after "
                "them were not checked",
                "a malformed row there stops the generator when it reaches it: validate the file once offline",
            )
