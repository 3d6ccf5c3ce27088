"""Interleaved SFT datasets (`data.dataset_probs`): the SFT job mixes its sources through
`datasets.interleave_datasets` (all_exhausted, seeded with `train.seed`; runtime/sft_data.py), and the compiler's
count of the mix (`schemas.schedule.interleaved_rows`, numpy drawing as datasets does) is the job's.

- the mix follows the probabilities and is reproducible: the same seed gives the same order, another seed another;
- every source is drawn through (all_exhausted), the shorter ones wrapping around;
- the compiled demo plan with two sources counts exactly the rows the job loads, and those rows come in the
  interleaved order.
"""

from __future__ import annotations

import os

import pytest
from loop_support import ROOT, compile_plan

from runtime.datasource import interleave_order, open_rows
from runtime.sft_data import _encode_row, load_examples
from schemas.schedule import interleaved_rows


@pytest.mark.parametrize(("lengths", "probs", "seed"), [
    ([2000, 2000], [0.7, 0.3], 0),
    ([300, 100, 50], [0.5, 0.3, 0.2], 42),
    ([1, 800], [0.9, 0.1], 7),
    ([1500, 1200], [0.25, 0.75], 123),
])
def test_mix_follows_the_probabilities_and_the_compiler_counts_it(lengths, probs, seed):
    order = interleave_order(lengths, probs, seed)
    assert len(order) == interleaved_rows(lengths, probs, seed)[0]
    drawn = [sum(1 for s, _ in order if s == k) for k in range(len(lengths))]
    assert all(d >= n for d, n in zip(drawn, lengths, strict=True))  # every source drawn through
    for k, n in enumerate(lengths):  # a source's rows in order, wrapping around once drawn through
        assert [i for s, i in order if s == k] == [j % n for j in range(drawn[k])]
    if len(order) > 2000:
        for k, p in enumerate(probs):
            assert abs(drawn[k] / len(order) - p) < 0.03, (k, drawn[k] / len(order), p)
    assert interleave_order(lengths, probs, seed) == order
    assert interleave_order(lengths, probs, seed + 1) != order


def test_the_job_loads_the_rows_the_plan_counted(tmp_path):
    from transformers import AutoTokenizer

    train, other = ROOT / "recipes/data/demo_sft/train.jsonl", ROOT / "recipes/data/demo_sft/eval.jsonl"
    plan = compile_plan("recipes/demo_sft.yaml", f"data.dataset={train},{other}", "data.dataset_probs=[0.6, 0.4]",
                        "data.max_samples=40", "train.seed=3")
    d = plan.sft.data
    tok = AutoTokenizer.from_pretrained(str(ROOT / "recipes/data/demo_sft/model"))
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        loaded = load_examples(d.dataset, tok, input_key=d.input_key, output_key=d.output_key, max_len=d.max_len,
                               max_samples=d.max_samples, last_turn_only=False, split=d.split, probs=d.probs,
                               seed=plan.sft.trainer.seed)
        sources = [open_rows(src, d.split, d.max_samples) for src in d.dataset]
        kw = dict(input_key=d.input_key, output_key=d.output_key, max_len=d.max_len, last_turn_only=False)
        order = interleave_order([len(rows) for rows in sources], d.probs, 3)[:40]
        expected = [_encode_row(sources[s], i, tok, **kw) for s, i in order]
    finally:
        os.chdir(cwd)
    assert d.sample_count == loaded.rows == 40  # the per-source caps (40, 40) mix to more: the blend cap holds
    assert plan.sft.schedule.steps_per_epoch == 40 // 32
    assert [len(rows) for rows in sources] == [40, 40]
    assert [e.input_ids for e in loaded.examples] == [e.input_ids for e in expected if not isinstance(e, str)]
    assert sum(isinstance(e, str) for e in expected) == sum(loaded.dropped.values())
