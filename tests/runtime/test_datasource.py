"""Dataset sources the runtime reads (runtime/datasource.py): every format gives the same prompts, and every bad row
is an error that names its file and line (issue 13: a malformed line used to kill the generator silently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.datasource import DataError, open_rows, read_prompts

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(5)]
WANT = [(r["prompt"], r["reward_model"], None) for r in ROWS]


def _write(tmp_path: Path, fmt: str) -> tuple[str, str]:
    """The ROWS written in `fmt`; (source, split)."""
    import datasets

    if fmt == "jsonl":
        path = tmp_path / "p.jsonl"
        path.write_text("".join(json.dumps(r) + "\n\n" for r in ROWS))
        return str(path), "train"
    if fmt == "json":
        path = tmp_path / "p.json"
        path.write_text(json.dumps({"test": ROWS}))
        return str(path), "test"
    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "parquet":
        ds.to_parquet(str(tmp_path / "p.parquet"))
        return str(tmp_path / "p.parquet"), "train"
    if fmt == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "train"), max_shard_size="1KB")  # several .arrow shards
        return str(tmp_path / "train"), "train"
    datasets.DatasetDict({"train": ds.select([0]), "eval": ds}).save_to_disk(str(tmp_path / "dd"))
    return str(tmp_path / "dd"), "eval"


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "save_to_disk", "dataset_dict"])
def test_every_format_gives_the_same_prompts(tmp_path, fmt):
    source, split = _write(tmp_path, fmt)
    assert read_prompts(source, split, "prompt", "reward_model", None, 100) == WANT
    assert read_prompts(source, split, "prompt", "reward_model", None, 2) == WANT[:2]


def test_a_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "half a row",\n' + json.dumps(ROWS[1]) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:3: not valid JSON"):
        read_prompts(str(path), "train", "prompt", "reward_model", None, 100)


def test_a_row_that_is_not_an_object_and_a_missing_column_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: a row must be a JSON object, got list"):
        read_prompts(str(path), "train", "prompt", None, None, 100)
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError, match=r"p\.jsonl:2: row has no input column 'prompt'"):
        read_prompts(str(path), "train", "prompt", None, None, 100)


def test_arrow_sources_name_the_missing_column_split_and_null_row(tmp_path):
    import datasets

    source, _ = _write(tmp_path, "save_to_disk")
    with pytest.raises(DataError, match=r"train: no column 'question'"):
        read_prompts(source, "train", "question", None, None, 100)
    source, _ = _write(tmp_path, "dataset_dict")
    with pytest.raises(DataError, match=r"no split 'validation' \(splits: \['eval', 'train'\]\)"):
        read_prompts(source, "validation", "prompt", None, None, 100)
    datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": None}]).to_parquet(str(tmp_path / "n.parquet"))
    with pytest.raises(DataError, match=r"n\.parquet row 1: the prompt \('prompt'\) is null"):
        read_prompts(str(tmp_path / "n.parquet"), "train", "prompt", None, None, 100)


def test_rows_say_where_they_are(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n" + json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = open_rows(str(path), "train", 10)
    assert [rows.where(i) for i in range(len(rows))] == [f"{path}:2", f"{path}:4"]


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file"):
        read_prompts(str(tmp_path / "nope.jsonl"), "train", "prompt", None, None, 10)
