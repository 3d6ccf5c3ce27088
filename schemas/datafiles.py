"""What the compiler can learn about a local dataset source without importing datasets or pyarrow.

`source_facts(path, split)` gives a source's row count (with how it was counted) and its columns:

| source | rows from | columns from |
|---|---|---|
| `*.jsonl` | non-blank lines | the first row |
| `*.json` | the list (or the list under `split`) | the first row |
| `*.parquet` | the footer's FileMetaData.num_rows (Thrift compact protocol, `_parquet_footer`) | the footer schema |
| `*.arrow` (IPC stream or file) | the record batch lengths (`_arrow_stream`) | the schema message |
| `save_to_disk` dir (`state.json`) | its `_data_files` arrow shards | the first shard's schema |
| `DatasetDict` dir (`dataset_dict.json`) | the `split` subdirectory, as above | as above |

Only headers are read (a parquet footer, the message headers of an Arrow stream: bodies are skipped with seeks),
so counting a multi-GB dataset costs milliseconds. `dataset_info.json`'s `splits.num_examples` is not trusted: it
keeps the size of the original split after a `select` or `map`.

`scan_json_rows` checks the rows of a JSON/JSONL source (each parses, is an object, has the recipe's columns, has a
non-empty prompt) within a budget of `SCAN_BYTES` per file, and says when it stopped early. Results are cached per
(file, size, mtime), since several rules ask about the same file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

SCAN_BYTES = 4 << 20
"""Row checks parse at most this much of each JSON/JSONL file (about 30k rows, ~0.1-0.3 s on our machines);
counts read the whole file (a line count, ~3 ms per MiB)."""


@dataclass(frozen=True)
class SourceFacts:
    rows: int | None
    how: str  # how the rows were counted, or why they could not be
    columns: tuple[str, ...] | None = None  # None: unknown
    line_based: bool = False  # a JSON/JSONL file (rows can be scanned)
    first_row: object = None  # the first row of a JSON/JSONL file


def source_facts(path: str, split: str) -> SourceFacts:
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        return SourceFacts(None, "not on this machine (a hub name, or a path elsewhere)")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        return SourceFacts(None, f"not readable at compile time ({getattr(exc, 'strerror', None) or exc})")
    return _facts(str(p.resolve()), split, st.st_size, st.st_mtime_ns, p.is_dir())


@lru_cache(maxsize=128)
def _facts(path: str, split: str, size: int, mtime: int, is_dir: bool) -> SourceFacts:
    p = Path(path)
    try:
        if is_dir:
            return _dir_facts(p, split)
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            with p.open("rb") as f:
                n = sum(1 for line in f if line.strip())
            first = _first_jsonl_row(p)
            return SourceFacts(n, "jsonl lines", tuple(first) if isinstance(first, dict) else None, True, first)
        if suffix == ".json":
            rows, how = _json_rows(p, split)
            if rows is None:
                return SourceFacts(None, how, None, True)
            first = rows[0] if rows else None
            return SourceFacts(len(rows), how, tuple(first) if isinstance(first, dict) else None, True, first)
        if suffix == ".parquet":
            n, cols = _parquet_footer(p)
            return SourceFacts(n, "parquet footer num_rows", cols)
        if suffix == ".arrow":
            n, arrow_cols = _arrow_stream(p)
            return SourceFacts(n, "arrow record batches", arrow_cols)
    except (OSError, ValueError, struct.error, IndexError, KeyError, TypeError) as exc:
        return SourceFacts(None, f"cannot be read at compile time ({exc})")
    return SourceFacts(None, "not a local json/jsonl/parquet/arrow file or save_to_disk dir")


def _dir_facts(p: Path, split: str) -> SourceFacts:
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            return SourceFacts(None, f"DatasetDict has no split {split!r} (splits: {', '.join(splits)})")
        inner = _dir_facts(p / split, split)
        return SourceFacts(inner.rows, f"split {split}: {inner.how}", inner.columns)
    if not (p / "state.json").is_file():
        return SourceFacts(None, "a directory without state.json or dataset_dict.json (loaded at run time)")
    files = [f["filename"] for f in json.loads((p / "state.json").read_text())["_data_files"]]
    total, cols = 0, None
    for name in files:
        n, c = _arrow_stream(p / name)
        total += n
        cols = cols if cols is not None else c
    return SourceFacts(total, f"save_to_disk: {len(files)} arrow file(s)", cols)


# ---------------------------------------------------------------------------------------------- JSON
def _first_jsonl_row(p: Path):
    with p.open("rb") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def _json_rows(p: Path, split: str) -> tuple[list | None, str]:
    try:
        obj = json.loads(p.read_bytes())
    except ValueError:
        return None, "not valid JSON"
    if isinstance(obj, list):
        return obj, "json list"
    if isinstance(obj, dict) and isinstance(obj.get(split), list):
        return obj[split], f"json split {split}"
    return None, "json is neither a list nor a dict with the split"


@dataclass(frozen=True)
class RowIssue:
    where: str  # appended to the file's name: ":41" (JSONL line) or " row 3" (JSON list index)
    what: str


@dataclass(frozen=True)
class RowScan:
    checked: int  # rows checked
    complete: bool  # every row was checked (else the first SCAN_BYTES)
    malformed: tuple[RowIssue, ...] = ()  # not JSON / not an object (first few)
    malformed_count: int = 0
    missing: dict = field(default_factory=dict)  # column -> (first RowIssue, count) of rows without it
    empty: tuple[RowIssue, ...] = ()  # rows whose prompt is empty (first few)
    empty_count: int = 0


def scan_json_rows(path: str, split: str, columns: tuple[str, ...], prompt_key: str | None) -> RowScan | None:
    """Check the rows of a local JSON/JSONL source; None when it is not one (or cannot be read)."""
    p = Path(path)
    try:
        if p.suffix.lower() not in (".jsonl", ".json") or not p.is_file():
            return None
        st = p.stat()
        return _scan(str(p.resolve()), split, columns, prompt_key, st.st_size, st.st_mtime_ns)
    except (OSError, ValueError):  # unreadable, or a NUL byte in the path: nothing to say about its rows
        return None


@lru_cache(maxsize=64)
def _scan(path: str, split: str, columns: tuple[str, ...], prompt_key: str | None, size: int, mtime: int) -> RowScan:
    p = Path(path)
    acc = _ScanAcc(columns, prompt_key)
    if p.suffix.lower() == ".jsonl":
        read = 0
        with p.open("rb") as f:
            for line_no, line in enumerate(f, 1):
                if read >= SCAN_BYTES:
                    return acc.result(complete=False)
                read += len(line)
                if line.strip():
                    acc.add(f":{line_no}", line.rstrip(b"\r\n"))
        return acc.result(complete=True)
    if size > SCAN_BYTES:
        return acc.result(complete=False)
    try:
        obj = json.loads(p.read_bytes())
    except ValueError as exc:
        decode = exc if isinstance(exc, json.JSONDecodeError) else None
        acc.bad(f":{decode.lineno if decode else '?'}", f"not valid JSON ({decode.msg if decode else exc})")
        return acc.result(complete=True)
    rows = obj if isinstance(obj, list) else obj.get(split) if isinstance(obj, dict) else None
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        acc.check(f" row {i}", row)
    return acc.result(complete=True)


class _ScanAcc:
    KEEP = 3  # issues kept per kind (the count covers all)

    def __init__(self, columns: tuple[str, ...], prompt_key: str | None):
        self.columns, self.prompt_key = columns, prompt_key
        self.checked, self.malformed_count = 0, 0
        self.malformed: list[RowIssue] = []
        self.missing: dict[str, list] = {}
        self.empty: list[RowIssue] = []
        self.empty_count = 0

    def add(self, where: str, line: bytes) -> None:
        try:
            row = json.loads(line)
        except ValueError as exc:
            col = getattr(exc, "colno", None)
            self.bad(where, f"not valid JSON ({getattr(exc, 'msg', exc)}" + (f" at column {col})" if col else ")"))
            return
        self.check(where, row)

    def bad(self, where: str, what: str) -> None:
        self.checked += 1
        self.malformed_count += 1
        if len(self.malformed) < self.KEEP:
            self.malformed.append(RowIssue(where, what))

    def check(self, where: str, row) -> None:
        if not isinstance(row, dict):
            self.bad(where, f"a row must be a JSON object, got {type(row).__name__}")
            return
        self.checked += 1
        for col in self.columns:
            if col not in row:
                entry = self.missing.setdefault(col, [RowIssue(where, f"has {', '.join(sorted(row))}"), 0])
                entry[1] += 1
        if self.prompt_key in row and _is_empty(row[self.prompt_key]):
            self.empty_count += 1
            if len(self.empty) < self.KEEP:
                self.empty.append(RowIssue(where, "empty prompt"))

    def result(self, complete: bool) -> RowScan:
        return RowScan(
            self.checked,
            complete,
            tuple(self.malformed),
            self.malformed_count,
            {k: (v[0], v[1]) for k, v in self.missing.items()},
            tuple(self.empty),
            self.empty_count,
        )


def _is_empty(value) -> bool:
    """None, "", whitespace, [] or chat messages whose contents are all empty."""
    if value is None:
        return True
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, list):
        return all(isinstance(m, dict) and _is_empty(m.get("content")) for m in value)
    return False


# ---------------------------------------------------------------------------------------------- parquet
(
    _T_STOP,
    _T_TRUE,
    _T_FALSE,
    _T_BYTE,
    _T_I16,
    _T_I32,
    _T_I64,
    _T_DOUBLE,
    _T_BINARY,
    _T_LIST,
    _T_SET,
    _T_MAP,
    _T_STRUCT,
) = range(13)


class _Compact:
    """The subset of Thrift's compact protocol a parquet FileMetaData needs (read-only, no generated code)."""

    def __init__(self, buf: bytes):
        self.buf, self.pos = buf, 0

    def byte(self) -> int:
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = out = 0
        while True:
            b = self.byte()
            out |= (b & 0x7F) << shift
            if not b & 0x80:
                return out
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def binary(self) -> bytes:
        n = self.varint()
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def fields(self):
        """(field id, type) of a struct's fields, until its STOP; the caller reads or skips each value."""
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _T_STOP:
                return
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            yield last, kind

    def list_header(self) -> tuple[int, int]:
        head = self.byte()
        size = head >> 4
        return (self.varint() if size == 15 else size), head & 0x0F

    def skip(self, kind: int) -> None:
        if kind in (_T_TRUE, _T_FALSE):
            return
        if kind == _T_BYTE:
            self.pos += 1
        elif kind in (_T_I16, _T_I32, _T_I64):
            self.varint()
        elif kind == _T_DOUBLE:
            self.pos += 8
        elif kind == _T_BINARY:
            self.binary()
        elif kind in (_T_LIST, _T_SET):
            size, elem = self.list_header()
            for _ in range(size):
                self.pos += 1 if elem in (_T_TRUE, _T_FALSE) else 0
                if elem not in (_T_TRUE, _T_FALSE):
                    self.skip(elem)
        elif kind == _T_MAP:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4)
                    self.skip(types & 0x0F)
        elif kind == _T_STRUCT:
            for _, k in self.fields():
                self.skip(k)
        else:
            raise ValueError(f"unknown thrift type {kind}")


def _parquet_footer(p: Path) -> tuple[int, tuple[str, ...]]:
    """(FileMetaData.num_rows, top-level column names) from the footer: `<meta> <len:u32> PAR1` at the file's end."""
    with p.open("rb") as f:
        f.seek(-8, os.SEEK_END)
        length, magic = struct.unpack("<I4s", f.read(8))
        if magic != b"PAR1":
            raise ValueError("not a parquet file (no PAR1 footer)")
        f.seek(-8 - length, os.SEEK_END)
        r = _Compact(f.read(length))
    rows, schema = None, []
    for fid, kind in r.fields():  # FileMetaData: 2 schema list<SchemaElement>, 3 num_rows i64
        if fid == 2 and kind == _T_LIST:
            size, _ = r.list_header()
            for _ in range(size):
                name, children = "", 0
                for sid, skind in r.fields():  # SchemaElement: 4 name, 5 num_children
                    if sid == 4 and skind == _T_BINARY:
                        name = r.binary().decode("utf-8", "replace")
                    elif sid == 5 and skind == _T_I32:
                        children = r.zigzag()
                    else:
                        r.skip(skind)
                schema.append((name, children))
        elif fid == 3 and kind == _T_I64:
            rows = r.zigzag()
            break
        else:
            r.skip(kind)
    if rows is None:
        raise ValueError("parquet footer without num_rows")
    return rows, _top_level(schema)


def _top_level(schema: list[tuple[str, int]]) -> tuple[str, ...]:
    """Names of the root's children in a depth-first flattened parquet schema."""
    names, i = [], 1

    def skip_subtree(j: int) -> int:
        n = schema[j][1]
        j += 1
        for _ in range(n):
            j = skip_subtree(j)
        return j

    for _ in range(schema[0][1] if schema else 0):
        names.append(schema[i][0])
        i = skip_subtree(i)
    return tuple(names)


# ---------------------------------------------------------------------------------------------- arrow IPC
_SCHEMA, _RECORD_BATCH = 1, 3


def _arrow_stream(p: Path) -> tuple[int, tuple[str, ...] | None]:
    """(rows, column names) of an Arrow IPC stream (what `save_to_disk` writes) or IPC file: the sum of the
    RecordBatch `length`s, read from each message's flatbuffer header; bodies are skipped."""
    rows, cols = 0, None
    with p.open("rb") as f:
        if f.read(6) == b"ARROW1":
            f.seek(8)  # IPC file: magic + padding, then a stream
        else:
            f.seek(0)
        while True:
            head = f.read(4)
            if len(head) < 4:
                break
            (size,) = struct.unpack("<i", head)
            if size == -1:  # continuation marker (format >= 0.15), then the length
                head = f.read(4)
                if len(head) < 4:
                    break
                (size,) = struct.unpack("<i", head)
            if size == 0:  # end of stream
                break
            meta = f.read(size)
            kind, header, body = _message(meta)
            if kind == _SCHEMA and cols is None:
                cols = _schema_names(meta, header)
            elif kind == _RECORD_BATCH:
                rows += _table_field(meta, header, 0, "<q", 0)
            f.seek(body, os.SEEK_CUR)
    return rows, cols


def _table_field(buf: bytes, table: int, index: int, fmt: str, default):
    """Scalar field `index` of the flatbuffer table at `table` (the default when the vtable omits it)."""
    off = _field_offset(buf, table, index)
    return default if off == 0 else struct.unpack_from(fmt, buf, table + off)[0]


def _field_offset(buf: bytes, table: int, index: int) -> int:
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vsize = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    return struct.unpack_from("<H", buf, vtable + slot)[0] if slot < vsize else 0


def _indirect(buf: bytes, table: int, index: int) -> int | None:
    """Position of the table/vector/string that field `index` points to (None when absent)."""
    off = _field_offset(buf, table, index)
    if off == 0:
        return None
    at = table + off
    return at + struct.unpack_from("<I", buf, at)[0]


def _message(meta: bytes) -> tuple[int, int, int]:
    """(header type, header table position, body length) of an IPC Message flatbuffer
    (fields: 0 version, 1 header_type, 2 header, 3 bodyLength)."""
    root = struct.unpack_from("<I", meta, 0)[0]
    kind = _table_field(meta, root, 1, "<B", 0)
    header = _indirect(meta, root, 2)
    return kind, header if header is not None else 0, _table_field(meta, root, 3, "<q", 0)


def _schema_names(meta: bytes, schema: int) -> tuple[str, ...]:
    """Top-level field names of a Schema table (field 1: [Field]; Field field 0: name)."""
    vec = _indirect(meta, schema, 1)
    if vec is None:
        return ()
    names = []
    for i in range(struct.unpack_from("<I", meta, vec)[0]):
        at = vec + 4 + 4 * i
        field_table = at + struct.unpack_from("<I", meta, at)[0]
        s = _indirect(meta, field_table, 0)
        n = struct.unpack_from("<I", meta, s)[0] if s is not None else 0
        names.append(meta[s + 4 : s + 4 + n].decode("utf-8", "replace") if s is not None else "")
    return tuple(names)
