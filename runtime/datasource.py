"""Dataset rows for the generator, the post-sync probe and the SFT trainer, in every format a recipe may name.

A source (one item of `data.prompts` / `data.dataset` / `eval.dataset`, `path@data_dir` allowed) is opened as:

| source | read with |
|---|---|
| `*.jsonl`, `*.json` (a list of rows, or a dict holding `split`) | the standard `json` module, one row at a time |
| a `save_to_disk` directory (`state.json`), or a `DatasetDict` one (`dataset_dict.json`, then `split`) | `datasets.load_from_disk` |
| `*.parquet`, `*.arrow`, `*.csv` | `datasets.load_dataset(<builder>, data_files=...)` |
| any other directory or a hub name | `datasets.load_dataset(path, data_dir=..., split=split)` |

JSON rows are parsed by hand rather than through `datasets`' JSON builder for two reasons: a malformed line must be
reported with its file and line (issue 13: the generator used to die on a bare `JSONDecodeError` and the run hung),
and Arrow's schema inference merges struct fields across rows (a tool schema or a chat message gains the other rows'
keys as nulls), which would change what the chat template renders.

Every problem with a row raises `DataError` whose message names the source and the line (JSON) or the row index
(Arrow-backed formats), so the driver's actor-death report points at the data.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ARROW_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


class DataError(ValueError):
    """A dataset source or row the runtime cannot use; the message names the source and the row."""


class Rows(Sequence):
    """The first rows of one source, indexable; `where(i)` says where row i is (`file:line`, or `source row i`).

    `table` is the `datasets.Dataset` of an Arrow-backed source (None for JSON, whose rows are a list of dicts).
    """

    def __init__(self, source: str, rows: Any, lines: list[int] | None, table: Any = None):
        self.source, self.table, self._rows, self._lines = source, table, rows, lines

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):
        return self._rows[i]

    def where(self, i: int) -> str:
        return f"{self.source}:{self._lines[i]}" if self._lines is not None else f"{self.source} row {i}"


def open_rows(source: str, split: str, limit: int, columns: list[str] | None = None) -> Rows:
    """The first `limit` rows of `source` as dicts (only `columns` when given: images are not decoded otherwise)."""
    path_str, _, data_dir = source.partition("@")
    path = Path(path_str)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        if not path.is_file():
            raise DataError(f"{path_str}: no such file (working directory {Path.cwd()})")
        if suffix == ".jsonl":
            return Rows(path_str, *_read_jsonl(path, limit))
        return Rows(path_str, _read_json(path, split, limit), None)
    table = _open_with_datasets(path, suffix, split, data_dir or None)
    if columns is not None:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(f"{path_str}: no column {', '.join(map(repr, missing))}; "
                            f"the dataset has {sorted(table.column_names)}")
        table = table.select_columns(columns)
    if len(table) > limit:
        table = table.select(range(limit))
    return Rows(path_str, table, None, table)


def _read_jsonl(path: Path, limit: int) -> tuple[list[dict], list[int]]:
    rows, lines = [], []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{line_no}: not valid JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_no}: a row must be a JSON object, got {type(row).__name__}")
            rows.append(row)
            lines.append(line_no)
    return rows, lines


def _read_json(path: Path, split: str, limit: int) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(data, dict) and isinstance(data.get(split), list):
        data = data[split]
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json dataset must be a list of rows or a dict holding the split {split!r}")
    rows = data[:limit]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i} must be a JSON object, got {type(row).__name__}")
    return rows  # a JSON array's rows are named by index: line numbers would need a second parser


def _open_with_datasets(path: Path, suffix: str, split: str, data_dir: str | None):
    import datasets

    try:
        if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"{path}: no split {split!r} (splits: {sorted(loaded)})")
                loaded = loaded[split]
            return loaded
        if path.is_file() and suffix in ARROW_BUILDERS:
            return datasets.load_dataset(ARROW_BUILDERS[suffix], data_files=str(path), split="train")
        return datasets.load_dataset(str(path), data_dir=data_dir, split=split)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types; the message must name the source
        raise DataError(f"{path}: cannot be read as a dataset ({type(exc).__name__}: {exc})") from exc


def read_images(source: str, split: str, image_key: str, limit: int) -> list:
    """The image column of the first `limit` rows (None where a row has none), as the dataset holds it: paths,
    bytes, `{bytes, path}` dicts, or PIL images (an HF `Image` feature decodes to them). `runtime.vlm` loads them."""
    rows = open_rows(source, split, limit)
    if rows.table is not None:
        if image_key not in rows.table.column_names:
            return [None] * len(rows)
        return rows.table.select_columns([image_key]).to_dict()[image_key]
    return [row.get(image_key) for row in rows]


def read_prompts(source: str, split: str, input_key: str, label_key: str | None, tools_key: str | None,
                 limit: int) -> list[tuple[object, object, list | None]]:
    """(prompt, label, tools) of the first `limit` rows; label and tools None when their key is unset or absent.

    A row without the input column, or whose prompt is null, raises `DataError` naming its file and line.
    """
    optional = [k for k in (label_key, tools_key) if k]
    rows = open_rows(source, split, limit)
    table = rows.table
    if table is not None:  # Arrow-backed: read the needed columns at once (images are never decoded)
        if input_key not in table.column_names:
            raise DataError(f"{rows.source}: no column {input_key!r} (data.input_key); the dataset has "
                            f"{sorted(table.column_names)}")
        present = [k for k in optional if k in table.column_names]
        cols = table.select_columns([input_key, *present]).to_dict()
        prompts = cols[input_key]
        for i, p in enumerate(prompts):
            if p is None:
                raise DataError(f"{rows.where(i)}: the prompt ({input_key!r}) is null")
        n = len(prompts)
        labels = cols.get(label_key, [None] * n) if label_key else [None] * n
        tools = cols.get(tools_key, [None] * n) if tools_key else [None] * n
        return list(zip(prompts, labels, tools, strict=True))
    out = []
    for i, row in enumerate(rows):
        if input_key not in row:
            raise DataError(f"{rows.where(i)}: row has no input column {input_key!r} (data.input_key; the row has "
                            f"{sorted(row)})")
        if row[input_key] is None:
            raise DataError(f"{rows.where(i)}: the prompt ({input_key!r}) is null")
        out.append((row[input_key], row.get(label_key) if label_key else None,
                    row.get(tools_key) if tools_key else None))
    return out


def derive_at_start(plan, *, quiet: bool = False):
    """The plan with the values its compiler deferred to the job's start (DATA010: the data was not on the compiling
    machine) filled in by the compiler's own function (`schemas/schedule.py`), each printed with its reason; the plan
    itself when the compiler counted the rows. A source the header reader cannot count (a hub name) is counted by
    loading it, as the generator and the SFT trainer will."""
    from schemas.schedule import at_job_start

    plan, lines = at_job_start(plan, count_other=lambda source, split, limit: len(open_rows(source, split, limit)))
    for line in [] if quiet else lines:
        print(line, flush=True)
    return plan


def interleave_order(lengths: list[int], probs: list[float], seed: int) -> list[tuple[int, int]]:
    """(source, row) of each row of `datasets.interleave_datasets` over sources of `lengths` with `probs`, `seed`
    and `stopping_strategy="all_exhausted"` (Molt's blend, molt_rules.md §1.1): sources are drawn at random until
    every one has been drawn through, the shorter ones wrapping around. datasets interleaves (source, row) index
    tables here, so the rows themselves never go through Arrow (runtime/datasource.py says why). The compiler
    counts the same rows (`schemas.schedule.interleaved_rows`). RL prompts (`data.prompt_probs`) and SFT rows
    (`data.dataset_probs`) are blended alike."""
    import datasets

    tables = [datasets.Dataset.from_dict({"source": [s] * n, "row": list(range(n))}) for s, n in enumerate(lengths)]
    mixed = datasets.interleave_datasets(tables, probabilities=probs, seed=seed, stopping_strategy="all_exhausted")
    rows = mixed[:]  # one Arrow take of both columns (a column iterated row by row is slow)
    return list(zip(rows["source"], rows["row"], strict=True))
