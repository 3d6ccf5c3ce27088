"""SFT data and loss, fast: which tokens the loss sees (assistant replies only), drops, truncation, and the
global token mean across micro-batches. Uses the committed demo tokenizer/model (recipes/data/demo_sft/model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loop_support import ROOT

from runtime.algo.losses import sft_loss
from runtime.sft_data import Example, SftError, collate, encode_conversation, load_examples, reply_logprobs

MODEL = ROOT / "recipes/data/demo_sft/model"
END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def supervised_text(tok, ex: Example) -> list[str]:
    """The decoded runs of consecutive supervised tokens."""
    runs, cur = [], []
    for i, m in zip(ex.input_ids, ex.loss_mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_only_the_reply_and_its_end_marker_are_supervised(tok) -> None:
    msgs = [{"role": "user", "content": "spell 47"}, {"role": "assistant", "content": "forty seven"}]
    ex = encode_conversation(tok, msgs, max_len=64, last_turn_only=False)
    assert supervised_text(tok, ex) == ["forty seven" + END]
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(msgs, tokenize=False)


def test_every_assistant_turn_or_only_the_last(tok) -> None:
    msgs = [{"role": "system", "content": "Answer in words."}, {"role": "user", "content": "spell 3"},
            {"role": "assistant", "content": "three"}, {"role": "user", "content": "spell 12"},
            {"role": "assistant", "content": "twelve"}]
    all_turns = encode_conversation(tok, msgs, max_len=128, last_turn_only=False)
    assert supervised_text(tok, all_turns) == ["three" + END, "twelve" + END]
    last = encode_conversation(tok, msgs, max_len=128, last_turn_only=True)
    assert supervised_text(tok, last) == ["twelve" + END]
    assert last.input_ids == all_turns.input_ids


def test_truncation_keeps_the_head_and_a_cut_off_reply_is_none(tok) -> None:
    msgs = [{"role": "user", "content": "spell 99 " * 10}, {"role": "assistant", "content": "ninety nine"}]
    full = encode_conversation(tok, msgs, max_len=10_000, last_turn_only=False)
    n_prompt = full.loss_mask.index(1)
    cut = encode_conversation(tok, msgs, max_len=n_prompt + 1, last_turn_only=False)
    assert cut.input_ids == full.input_ids[: n_prompt + 1] and sum(cut.loss_mask) == 1
    assert encode_conversation(tok, msgs, max_len=n_prompt, last_turn_only=False) is None


def test_load_examples_counts_what_it_drops(tok, tmp_path: Path) -> None:
    rows = [
        {"prompt": "spell 1", "response": "one"},                                            # string + string
        {"prompt": [{"role": "user", "content": "spell 2"}], "response": "two"},             # messages + string
        {"prompt": "spell 3", "response": {"role": "assistant", "content": "three"}},        # string + message
        {"prompt": "spell 4", "response": ""},                                               # no reply
        {"prompt": "spell 5"},                                                               # no reply column
        {"prompt": "spell 6 " * 40, "response": "six"},                                      # reply beyond max_len
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    data = load_examples([str(path)], tok, input_key="prompt", output_key="response", max_len=40,
                         max_samples=100, last_turn_only=False, split="train")
    assert data.rows == 6
    assert data.dropped == {"no_reply": 2, "reply_beyond_max_len": 1}
    assert [supervised_text(tok, e) for e in data.examples] == [["one" + END], ["two" + END], ["three" + END]]
    capped = load_examples([str(path)], tok, input_key="prompt", output_key="response", max_len=40,
                           max_samples=2, last_turn_only=False, split="train")
    assert capped.rows == 2 and len(capped.examples) == 2


def test_a_missing_input_column_names_file_and_line(tok, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"question": "a"}) + "\n")
    with pytest.raises(SftError, match=r"d\.jsonl:2: no column 'prompt'"):
        load_examples([str(path)], tok, input_key="prompt", output_key="response", max_len=40, max_samples=10,
                      last_turn_only=False, split="train")


def test_a_malformed_line_names_file_and_line(tok, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n\n" + '{"prompt": "a", "response": \n')
    with pytest.raises(SftError, match=r"d\.jsonl:3: not valid JSON"):
        load_examples([str(path)], tok, input_key="prompt", output_key="response", max_len=40, max_samples=10,
                      last_turn_only=False, split="train")


@pytest.mark.parametrize("fmt", ["parquet", "save_to_disk", "dataset_dict"])
def test_arrow_backed_formats_give_the_same_examples_as_jsonl(tok, tmp_path: Path, fmt: str) -> None:
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"spell {i}"}],
             "response": [{"role": "assistant", "content": word}]} for i, word in enumerate(["zero", "one", "two"])]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    if fmt == "parquet":
        path, split = tmp_path / "d.parquet", "train"
        ds.to_parquet(str(path))
    elif fmt == "save_to_disk":
        path, split = tmp_path / "d", "train"
        ds.save_to_disk(str(path))
    else:
        path, split = tmp_path / "dd", "validation"
        datasets.DatasetDict({"train": ds.select([0]), "validation": ds}).save_to_disk(str(path))
    kw = dict(input_key="prompt", output_key="response", max_len=40, max_samples=10, last_turn_only=False)
    want = load_examples([str(jsonl)], tok, split="train", **kw)
    got = load_examples([str(path)], tok, split=split, **kw)
    assert got.rows == 3 and [e.input_ids for e in got.examples] == [e.input_ids for e in want.examples]
    assert [supervised_text(tok, e) for e in got.examples] == [["zero" + END], ["one" + END], ["two" + END]]


def test_prompt_tokens_get_no_gradient_and_micro_batching_keeps_the_token_mean(tok) -> None:
    """One window split in micro-batches with the window's token count = the token mean of the whole window."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    exs = [encode_conversation(tok, [{"role": "user", "content": f"spell {n}"},
                                     {"role": "assistant", "content": "x " * (n % 5 + 1)}], 64, False)
           for n in range(6)]
    ids, attn, mask = collate(exs, tok.pad_token_id)
    lp = reply_logprobs(model, ids, attn).detach().requires_grad_(True)
    loss = sft_loss(lp, mask[:, 1:], global_num_tokens=mask[:, 1:].sum())
    loss.backward()
    assert torch.all(lp.grad[mask[:, 1:] == 0] == 0) and torch.all(lp.grad[mask[:, 1:] == 1] != 0)
    # the same window as 3 micro-batches of 2 rows, each divided by the window's token count, each padded to a
    # multiple of 8 positions as GPU plans pad them (`width_multiple`)
    total = mask[:, 1:].sum()
    parts = []
    for m in range(0, 6, 2):
        i, a, k = collate(exs[m:m + 2], tok.pad_token_id, 8)
        assert i.shape[1] % 8 == 0 and i.shape[1] - 8 < a.sum(-1).max() <= i.shape[1]
        parts.append(sft_loss(reply_logprobs(model, i, a), k[:, 1:], global_num_tokens=total))
    whole = -(reply_logprobs(model, ids, attn) * mask[:, 1:]).sum() / total
    assert torch.allclose(sum(parts), whole, rtol=1e-5)


def test_packed_sft_micro_batch_has_the_padded_loss_and_gradients(tok) -> None:
    """`actor.packing` in SFT: the rows of a micro-batch as one packed row give the padded NLL and gradients."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="sdpa")
    exs = [encode_conversation(tok, [{"role": "user", "content": f"spell {n} " * (1 + n % 3)},
                                     {"role": "assistant", "content": "x " * (n % 5 + 1)}], 64, False)
           for n in range(5)]
    ids, attn, mask = collate(exs, tok.pad_token_id)
    assert len({int(n) for n in attn.sum(-1)}) > 1  # rows of different lengths: padding to skip

    def loss_and_grads(packed: bool):
        model.zero_grad()
        loss = sft_loss(reply_logprobs(model, ids, attn, packed=packed), mask[:, 1:],
                        global_num_tokens=mask[:, 1:].sum())
        loss.backward()
        return float(loss), [p.grad.clone() for p in model.parameters()]

    padded_loss, padded_grads = loss_and_grads(False)
    packed_loss, packed_grads = loss_and_grads(True)
    assert abs(packed_loss - padded_loss) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(packed_grads, padded_grads, strict=True)) < 1e-5
