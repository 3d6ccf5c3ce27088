"""Counting rows at compile time (schemas/datafiles.py: file headers only, no datasets/pyarrow) against the
libraries a user would otherwise call, on the same files: a 200k-row parquet file (many row groups), a 200k-row
save_to_disk directory (several shards) and a 200k-line JSONL file; plus the bounded row scan of that JSONL.

Baselines: `pyarrow.parquet.read_metadata(...).num_rows`, `len(datasets.load_from_disk(...))`, and for JSONL a
plain `sum(1 for line in f if line.strip())`. Import time of the libraries is reported apart (a compile pays it
once, cold, if it imports them)."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

ROWS = 200_000


def _best(fn, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def run() -> dict:
    t = time.perf_counter()
    import datasets
    import pyarrow.parquet as pq
    import_s = time.perf_counter() - t

    from schemas import datafiles

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Think step by step."}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(ROWS)]
    out: dict = {"rows": ROWS, "import_datasets_pyarrow_s": round(import_s, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ds = datasets.Dataset.from_list(rows)
        pq.write_table(ds.data.table, d / "p.parquet", row_group_size=10_000)
        ds.save_to_disk(str(d / "disk"), max_shard_size="4MB")
        (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out["jsonl_mb"] = round((d / "p.jsonl").stat().st_size / 2**20, 1)

        def ours(path: Path):
            datafiles._facts.cache_clear()
            facts = datafiles.source_facts(str(path), "train")
            assert facts.rows == ROWS, facts

        def plain_lines():
            with open(d / "p.jsonl", "rb") as f:
                assert sum(1 for line in f if line.strip()) == ROWS

        for name, path, base_name, base in (
            ("parquet", d / "p.parquet", "pyarrow_read_metadata", lambda: pq.read_metadata(d / "p.parquet").num_rows),
            ("save_to_disk", d / "disk", "datasets_load_from_disk_len", lambda: len(datasets.load_from_disk(str(d / "disk")))),
            ("jsonl", d / "p.jsonl", "plain_line_count", plain_lines),
        ):
            mine, theirs = _best(lambda p=path: ours(p)), _best(base)
            out[f"{name}_count_ms"] = round(mine * 1e3, 2)
            out[f"{name}_{base_name}_ms"] = round(theirs * 1e3, 2)
            out[f"{name}_ratio_vs_baseline"] = round(mine / theirs, 2)

        def scan():
            datafiles._scan.cache_clear()
            return datafiles.scan_json_rows(str(d / "p.jsonl"), "train", ("prompt",), "prompt")

        out["jsonl_scan_ms"] = round(_best(scan, 3) * 1e3, 1)
        result = scan()
        out["jsonl_scan_rows_checked"] = result.checked
        out["jsonl_scan_complete"] = result.complete
    return out
