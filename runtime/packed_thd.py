"""A packed row in the THD form nemo-automodel's THD attentions take (GLM-5.2's DSA kernels, te): its tokens without a
batch axis and cu_seqlens.

`runtime.logprobs.pack` makes the b rows one (1, N) row with position ids restarting at 0 per row. nemo-automodel's
own GLM-5.2 implementation (`glm_moe_dsa`) with `BackendConfig.attn: tilelang` runs only THD (its TileLang lighting
indexer and sparse-MLA kernels take (N, ...) tensors and find the documents from `cu_seqlens`; a (1, N) row with a
4-D document mask, what `logprobs.packed_row_masks` gives its sdpa path, is refused), and its te attention takes no
4-D mask. This module turns the packed row into what nemo-automodel's own THD collater
(`components.distributed.thd_utils.process_input_for_thd`) gives its training recipe (`thd_row`), then into what its
causal LMs' forward hands the backbone (`backbone_inputs`, its `squeeze_input_for_thd`): (N,) input and position ids,
an (N,) padding mask, int32 `cu_seqlens` of the documents, `max_seqlen` and `qkv_format: "thd"`.

Which backends take THD is read from the built model (`backend.attn`, which `runtime.models.automodel.backend_config`
set from the plan's `model.attn`): nothing is chosen here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

THD_ATTN = ("tilelang", "te")
"""nemo-automodel backends (`BackendConfig.attn`) whose layers take a packed row only as THD."""


def takes_thd(model) -> bool:
    """`model` is one of nemo-automodel's own implementations built with a THD-only attention backend."""
    return getattr(getattr(model, "backend", None), "attn", None) in THD_ATTN


def document_lengths(position_ids: Tensor) -> Tensor:
    """The lengths of the documents of a (1, N) packed row: a document starts where its position id is 0."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().squeeze(1)
    return torch.diff(starts, append=torch.tensor([flat.numel()], device=flat.device))


def thd_row(input_ids: Tensor, position_ids: Tensor) -> dict[str, Any]:
    """What a packed (1, N) row needs besides its ids and positions, as nemo-automodel's causal LMs take a THD row:
    `qkv_format="thd"`, the documents' cumulative lengths (`cu_seqlens`), their longest (`max_seqlen`) and no padding,
    made by its own collater's `process_input_for_thd` from the documents' lengths (no document is padded: without CP
    neither kernel needs a multiple), each with the row's batch dim 1 (`backbone_inputs` squeezes them as those
    forwards do before their backbone)."""
    from nemo_automodel.components.distributed.thd_utils import process_input_for_thd

    lengths = document_lengths(position_ids)[None]
    thd = process_input_for_thd({"input_ids": input_ids, "labels": input_ids, "position_ids": position_ids,
                                 "seq_lens": lengths, "seq_lens_padded": lengths})
    return {"qkv_format": "thd", "cu_seqlens": thd["cu_seqlens"][None], "max_seqlen": thd["max_seqlen"][None],
            "padding_mask": thd["padding_mask"][None], "attention_mask": None}


def backbone_inputs(inputs: dict) -> dict:
    """A THD row's backbone keywords as nemo-automodel's causal LMs hand them to their backbone (te's and GLM-5.2's
    alike): the batch dim squeezed off every tensor, `max_seqlen` a number (its `squeeze_input_for_thd`), no attention
    mask."""
    from nemo_automodel.components.utils.model_utils import squeeze_input_for_thd

    attn = {k: v for k, v in inputs.items() if k not in ("input_ids", "position_ids", "padding_mask", "attention_mask")}
    input_ids, position_ids, padding_mask, attn = squeeze_input_for_thd(
        inputs["input_ids"], inputs["position_ids"], inputs["padding_mask"], attn)
    return {"input_ids": input_ids, "position_ids": position_ids, "padding_mask": padding_mask,
            "attention_mask": None, **attn}


def decoder_hidden(backbone, input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """(1, N, hidden) decoder output of the packed row, run by nemo-automodel's backbone (`model.model`, which
    returns the hidden states and, for GLM-5.2, its last top-k selection) in THD form."""
    inputs = {"input_ids": input_ids, "position_ids": position_ids, **thd_row(input_ids, position_ids)}
    return hidden_states(backbone(**backbone_inputs(inputs)))[None]


def hidden_states(out) -> Tensor:
    """The hidden states a backbone returns: transformers' output's `last_hidden_state`, or nemo-automodel's own
    tensor, or its GLM-5.2's (hidden states, last top-k selection) pair."""
    if isinstance(out, tuple):
        return out[0]
    return out if isinstance(out, Tensor) else out.last_hidden_state
