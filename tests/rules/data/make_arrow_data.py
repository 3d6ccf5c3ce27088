"""Writes prompts.parquet and prompts_disk/ (a `save_to_disk` directory): the rows of prompts.jsonl in the binary
formats, for the rule tests that count rows and read columns from headers (DATA007, BATCH009). Deterministic; run
from anywhere: `python tests/rules/data/make_arrow_data.py`."""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).parent

rows = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().splitlines() if line.strip()]
ds = datasets.Dataset.from_list(rows)
ds.to_parquet(str(HERE / "prompts.parquet"))
ds.save_to_disk(str(HERE / "prompts_disk"))
