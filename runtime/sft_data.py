"""SFT data: chat rows to token ids and loss masks, collated into right-padded micro-batches (`runtime/sft.py`).

Data (Molt `datasets/sft_dataset.py`): `input_key` holds a string (one user turn) or chat messages; `output_key`
a string (the assistant reply), one message dict, or messages; without `output_key` the assistant turns come from
the input messages. Only assistant replies (their text and the end-of-turn marker the template puts after them)
count in the loss; with `train_on_last_turn_only` only the last one. Rows are cut to `max_len` tokens. Rows with no
assistant turn, or whose replies lie wholly beyond `max_len`, are dropped and counted (Molt keeps all-zero-mask
rows with a warning; they train nothing, so dropping them changes no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime import sft_vlm
from runtime.datasource import DataError, interleave_order, open_rows
from runtime.logprobs import token_logprobs


class SftError(Exception):
    """A problem the user can fix (unsupported plan setting, unreadable data); printed as one line."""


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]   # 1 where the token is part of a supervised assistant reply
    mm: dict | None = None  # VLM rows: the images' {pixel_values, image_grid_thw} (`runtime/sft_vlm.py`)


@dataclass
class LoadedData:
    examples: list[Example]
    rows: int = 0
    dropped: dict[str, int] = field(default_factory=dict)


def _as_messages(value, role: str) -> list[dict] | None:
    """A string -> one `role` turn; a message dict -> [it]; a list of messages -> it; None/empty -> None."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        if "role" in value and "content" in value:
            return [value]
        return None
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return list(value)
    return None


def encode_conversation(tokenizer, messages: list[dict], max_len: int, last_turn_only: bool) -> Example | None:
    """Token ids and the reply-token mask of one conversation; None when no reply token is left.

    The mask is found on the rendered text, not on token counts: for every assistant turn i, the template rendered
    up to turn i with the generation prompt must be a prefix of the rendering through turn i; the characters in
    between (reply text + end-of-turn marker) are the reply. Tokens whose character span starts inside a reply are
    supervised. This stays right whatever the BPE merges do at the boundaries.
    """
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if last_turn_only:
        replies = replies[-1:]
    if not replies:
        return None
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i in replies:
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (through.startswith(before) and full.startswith(through)):
            raise SftError("the chat template does not render conversations prefix by prefix, so the assistant "
                           "reply cannot be located (Molt H15: no detectable assistant-reply opener); "
                           "set data.chat_template to a template that does")
        spans.append((len(before), len(through)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:max_len]
    mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"][:max_len]]
    if not any(mask):
        return None
    return Example(ids, mask)


def load_examples(paths: list[str], tokenizer, *, input_key: str, output_key: str | None, max_len: int,
                  max_samples: int, last_turn_only: bool, split: str, probs: list[float] | None = None,
                  seed: int = 0, images: tuple[str, int, object] | None = None) -> LoadedData:
    """Tokenized examples of every source (any format runtime/datasource.py reads), at most `max_samples` rows:
    the sources one after the other, or with `probs` interleaved as Molt blends them (`interleave_order`), each
    source first capped at `max_samples`. `images`: (image column, max images per row, processor) of a VLM run
    (`runtime/sft_vlm.py`; relative image paths are relative to the dataset file's directory)."""
    columns = [k for k in (input_key, output_key, images[0] if images else None) if k]
    out = LoadedData([])
    if probs:
        sources = [_open(path, split, max_samples, columns) for path in paths]
        order = interleave_order([len(rows) for rows in sources], probs, seed)[:max_samples]
        encoded: dict[tuple[int, int], Example | str] = {}  # a row drawn again (all_exhausted wraps) is reused
        for s, i in order:
            if (s, i) not in encoded:
                encoded[(s, i)] = _encode_row(sources[s], i, tokenizer, input_key, output_key, max_len, last_turn_only,
                                              _with_dir(images, paths[s]))
            _keep(out, encoded[(s, i)])
        return out
    for path in paths:
        rows = _open(path, split, max_samples - out.rows, columns)
        for i in range(len(rows)):
            _keep(out, _encode_row(rows, i, tokenizer, input_key, output_key, max_len, last_turn_only,
                                   _with_dir(images, path)))
        if out.rows >= max_samples:
            break
    return out


def _open(path: str, split: str, limit: int, columns: list[str]):
    try:
        return open_rows(path, split, limit, columns)
    except DataError as exc:
        raise SftError(str(exc)) from None


def _with_dir(images: tuple | None, path: str) -> tuple | None:
    from pathlib import Path

    return None if images is None else (*images, Path(path).parent if Path(path).is_file() else None)


def _encode_row(rows, i: int, tokenizer, input_key: str, output_key: str | None, max_len: int,
                last_turn_only: bool, images: tuple | None = None) -> Example | str:
    """Row i as an example, or why it is dropped (`no_reply`, `reply_beyond_max_len`; VLM rows also
    `too_many_images`, `vlm_truncation`)."""
    row = rows[i]
    if input_key not in row or row[input_key] is None:
        raise SftError(f"{rows.where(i)}: no column {input_key!r} (data.input_key); "
                       f"the row has {sorted(k for k, v in row.items() if v is not None)}")
    prompt = _as_messages(row[input_key], "user") or []
    reply = _as_messages(row.get(output_key), "assistant") if output_key else []
    messages = prompt + (reply or [])
    if not any(m["role"] == "assistant" for m in messages):
        return "no_reply"
    if images is not None:
        key, max_images, processor, base_dir = images
        try:
            out = sft_vlm.encode(processor, messages, sft_vlm.image_refs(row, key), base_dir, max_len, max_images,
                                 lambda m: encode_conversation(processor.tokenizer, m, 1 << 30, last_turn_only))
        except sft_vlm.ImageMismatch as exc:
            raise SftError(f"{rows.where(i)}: {exc}") from None
        ex = Example(*out) if isinstance(out, tuple) else out
    else:
        ex = encode_conversation(tokenizer, messages, max_len, last_turn_only)
    return "reply_beyond_max_len" if ex is None else ex


def _keep(out: LoadedData, ex: Example | str) -> None:
    out.rows += 1
    if isinstance(ex, str):
        out.dropped[ex] = out.dropped.get(ex, 0) + 1
    else:
        out.examples.append(ex)


def collate(examples: list[Example], pad_id: int, width_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """Right-padded (ids, attention_mask, loss_mask), each (B, T), T the longest rounded up to `width_multiple`."""
    width = -(-max(len(e.input_ids) for e in examples) // width_multiple) * width_multiple
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.float32)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(e.loss_mask, dtype=torch.float32)
    return ids, attn, mask


def reply_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, packed: bool = False,
                   vision: dict[str, torch.Tensor] | None = None, cp=None) -> torch.Tensor:
    """(B, T-1) log p(ids[:, t+1] | ids[:, :t+1]); the lm_head runs in chunks (`runtime/logprobs.py`), and with
    `packed` the rows run as one packed row (no padding computed; 0 past each row's end). `vision`
    (`logprobs.vision_inputs`): the rows' images, a VLM forward (never packed: the compiler refuses it, DATA002).
    `cp`: the rows' context-parallel shard (`runtime/context_parallel.py`)."""
    return token_logprobs(model, ids, attn.bool(), 1.0, packed=packed, vision=vision, cp=cp)[0]

