"""A packed row in the THD form nemo-automodel's DSA kernels take: its tokens without a batch axis and cu_seqlens.

`runtime.logprobs.pack` makes the b rows one (1, N) row with position ids restarting at 0 per row. nemo-automodel's
own GLM-5.2 implementation (`glm_moe_dsa`) with `BackendConfig.attn: tilelang` runs only THD (its TileLang lighting
indexer and sparse-MLA kernels take (N, ...) tensors and find the documents from `cu_seqlens`; a (1, N) row with a
4-D document mask, what `logprobs.packed_row_masks` gives its sdpa path, is refused). This module turns the packed
row into what nemo-automodel's own THD collater (`components.distributed.thd_utils.process_input_for_thd`) gives its
training recipe: (N,) input and position ids, an (N,) padding mask, int32 `cu_seqlens` of the documents, `max_seqlen`
and `qkv_format: "thd"`.

Which backends take THD is read from the built model (`backend.attn`, which `runtime.models.automodel.backend_config`
set from the plan's `model.attn`): nothing is chosen here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

THD_ATTN = ("tilelang",)
"""nemo-automodel backends (`BackendConfig.attn`) whose layers take a packed row only as THD."""


def takes_thd(model) -> bool:
    """`model` is one of nemo-automodel's own implementations built with a THD-only attention backend."""
    return getattr(getattr(model, "backend", None), "attn", None) in THD_ATTN


def document_lengths(position_ids: Tensor) -> Tensor:
    """The lengths of the documents of a (1, N) packed row: a document starts where its position id is 0."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().squeeze(1)
    return torch.diff(starts, append=torch.tensor([flat.numel()], device=flat.device))


def thd_batch(input_ids: Tensor, position_ids: Tensor) -> dict[str, Any]:
    """The (1, N) packed row `input_ids` with its position ids in nemo-automodel's THD form (its own collater's
    output): `input_ids`, `position_ids`, `padding_mask` (N,) (no padding: a packed row has none), `cu_seqlens`
    int32 (documents + 1,), `max_seqlen` and `qkv_format`."""
    from nemo_automodel.components.distributed.thd_utils import process_input_for_thd

    lengths = document_lengths(position_ids)
    batch = process_input_for_thd({"input_ids": input_ids, "labels": input_ids, "position_ids": position_ids,
                                   "seq_lens": lengths[None], "seq_lens_padded": lengths[None]})
    batch.pop("labels")
    batch["qkv_format"] = "thd"
    return batch


def decoder_hidden(backbone, input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """(1, N, hidden) decoder output of the packed row, run by nemo-automodel's backbone (`model.model`, which
    returns the hidden states and, for GLM-5.2, its last top-k selection) in THD form."""
    return hidden_states(backbone(**thd_batch(input_ids, position_ids)))[None]


def hidden_states(out) -> Tensor:
    """The hidden states a backbone returns: transformers' output's `last_hidden_state`, or nemo-automodel's own
    tensor, or its GLM-5.2's (hidden states, last top-k selection) pair."""
    if isinstance(out, tuple):
        return out[0]
    return out if isinstance(out, Tensor) else out.last_hidden_state
