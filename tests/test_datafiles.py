"""schemas/datafiles.py: row counts and columns from file headers (no datasets/pyarrow in the compiler), checked
against what `datasets` itself loads, and the bounded row scan of JSON/JSONL files."""

from __future__ import annotations

import json
import struct

import pytest

from schemas import datafiles
from schemas.datafiles import scan_json_rows, source_facts

ROWS = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": str(i), "style": "rule"},
         "n": i, "flags": [True, False, i % 2 == 0], "meta": {"tags": ["a"] * (i % 3)}} for i in range(500)]
COLUMNS = ("prompt", "reward_model", "n", "flags", "meta")


@pytest.fixture(scope="module")
def ds():
    import datasets

    return datasets.Dataset.from_list(ROWS)


def test_parquet_footer_with_many_row_groups_and_compression(tmp_path, ds):
    import pyarrow.parquet as pq

    for name, kw in (("one.parquet", {}), ("many.parquet", {"row_group_size": 37, "compression": "zstd"})):
        pq.write_table(ds.data.table, tmp_path / name, **kw)
        assert source_facts(str(tmp_path / name), "train") == datafiles.SourceFacts(500, "parquet footer num_rows",
                                                                                    COLUMNS)


def test_save_to_disk_shards_dataset_dict_and_ipc_file(tmp_path, ds):
    import datasets
    import pyarrow as pa

    ds.save_to_disk(str(tmp_path / "disk"), max_shard_size="8KB")
    facts = source_facts(str(tmp_path / "disk"), "train")
    assert facts.rows == 500 == len(datasets.load_from_disk(str(tmp_path / "disk"))) and facts.columns == COLUMNS
    assert "arrow file(s)" in facts.how and int(facts.how.split()[1]) > 1   # really several shards
    datasets.DatasetDict({"train": ds, "eval": ds.select(range(9))}).save_to_disk(str(tmp_path / "dd"))
    assert source_facts(str(tmp_path / "dd"), "eval").rows == 9
    assert "no split 'test'" in source_facts(str(tmp_path / "dd"), "test").how
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, ds.data.table.schema) as w:
        for batch in ds.data.table.to_batches(max_chunksize=64):
            w.write_batch(batch)
    assert source_facts(str(tmp_path / "f.arrow"), "train") == datafiles.SourceFacts(500, "arrow record batches",
                                                                                    COLUMNS)


def test_a_select_then_map_is_counted_from_the_data_not_the_stale_info(tmp_path, ds):
    """`dataset_info.json` keeps the original split's size after `select`; the arrow files are the truth."""
    ds.select(range(11)).map(lambda r: {"extra": 1}).save_to_disk(str(tmp_path / "sel"))
    facts = source_facts(str(tmp_path / "sel"), "train")
    assert facts.rows == 11 and facts.columns == (*COLUMNS, "extra")


def test_image_rows_are_counted_without_decoding(tmp_path):
    import datasets
    from PIL import Image

    feats = datasets.Features({"images": datasets.Sequence(datasets.Image()), "prompt": datasets.Value("string")})
    img = Image.new("RGB", (8, 8), (255, 0, 0))
    datasets.Dataset.from_dict({"images": [[img]] * 6, "prompt": ["p"] * 6}, features=feats) \
        .save_to_disk(str(tmp_path / "img"))
    assert source_facts(str(tmp_path / "img"), "train").rows == 6


def test_broken_and_unknown_sources_say_why(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    assert source_facts(str(tmp_path / "bad.parquet"), "train").how.startswith("cannot be read")
    assert source_facts(str(tmp_path / "nope.parquet"), "train").how.startswith("not on this machine")
    (tmp_path / "plain").mkdir()
    assert source_facts(str(tmp_path / "plain"), "train").rows is None
    (tmp_path / "x.csv").write_text("a\n1\n")
    assert "not a local json" in source_facts(str(tmp_path / "x.csv"), "train").how


def test_json_scan_finds_bad_rows_missing_columns_and_empty_prompts(tmp_path):
    lines = [json.dumps({"prompt": "a"}), "", '{"prompt": "b"', "[1]", json.dumps({"q": "c"}), json.dumps({"prompt": " "}),
             json.dumps({"prompt": [{"role": "user", "content": ""}]})]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    scan = scan_json_rows(str(path), "train", ("prompt",), "prompt")
    assert scan.complete and scan.checked == 6 and scan.malformed_count == 2
    assert [(i.where, i.what.split(" (")[0]) for i in scan.malformed] == [
        (":3", "not valid JSON"), (":4", "a row must be a JSON object, got list")]
    assert scan.missing["prompt"][0].where == ":5" and scan.missing["prompt"][1] == 1
    assert scan.empty_count == 2 and [i.where for i in scan.empty] == [":6", ":7"]
    (tmp_path / "a.json").write_text('{"train": [{"prompt": "x"}, {"prompt": ""}]}')
    scan = scan_json_rows(str(tmp_path / "a.json"), "train", ("prompt",), "prompt")
    assert scan.checked == 2 and [i.where for i in scan.empty] == [" row 1"]


def test_json_scan_is_bounded_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(datafiles, "SCAN_BYTES", 1000)
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(1000)) + "{broken\n")
    scan = scan_json_rows(str(path), "train", ("prompt",), "prompt")
    assert not scan.complete and 40 < scan.checked < 100 and scan.malformed_count == 0
    assert source_facts(str(path), "train").rows == 1001  # counting still reads the whole file


def test_footer_reader_rejects_a_truncated_file(tmp_path, ds):
    ds.to_parquet(str(tmp_path / "t.parquet"))
    data = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "t.parquet").write_bytes(data[:-8] + struct.pack("<I", 10**6) + b"PAR1")
    assert source_facts(str(tmp_path / "t.parquet"), "train").rows is None
