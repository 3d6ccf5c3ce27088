"""Token log-probs and entropy of a causal LM, padded or packed, without a (tokens x vocabulary) fp32 tensor.

The decoder runs once; the lm_head, the temperature, the log-softmax and the entropy then run over chunks of
`LOGPROB_CHUNK_TOKENS` positions. Under autograd each chunk is activation-checkpointed, so what stays alive for the
backward is the (tokens x hidden) decoder output, not logits: peak logits memory is one chunk's, in the forward and
in the backward alike. The numbers are those of the full-logits formula (same operations per position).

Two layouts of the same rows:
- padded: (b, w) right-padded `sequences` with their `attention_mask`, positions 0..w-1 (a causal text decoder
  runs them without the mask, which changes none of their real positions: `key_padding_mask`);
- packed: the b rows concatenated into one (1, N) row, N = sum of lengths, `position_ids` restarting at 0 per row and
  no attention mask. transformers' mask builder then detects the packed format from the position ids
  (`masking_utils.find_packed_sequence_indices`, used only when attention_mask is None and there is no cache) and
  makes the mask block-diagonal causal: sdpa/eager get that explicit mask (CPU), flash_attention_2 goes through its
  varlen kernel from the same position ids (`modeling_flash_attention_utils._is_packed_sequence`). No padding token is
  computed. nemo-automodel's own implementations read no boundaries from position ids: they get the block-diagonal
  mask explicitly (`document_mask`; their sdpa takes a 4-D boolean mask), or, built with a THD-only attention,
  the row as THD with its documents' cumulative lengths, made by nemo-automodel's own conversion: tilelang
  (GLM-5.2's DSA kernels) and te (its te path takes no 4-D mask), both through `runtime/packed_thd.py`.
Both return (b, w-1) tensors aligned like `Experience` (position t scores token t+1), zero past each row's end.
Score centering (`token_top_logprobs`) also gathers, in the same chunks, the log-probs of the sampler's top-k ids of
each position ((b, w-1, k) `rollout_top_ids`, packed like the labels): k more numbers per position, no extra pass.

Vision-language rows (padded only: the compiler turns packing off for VLM runs, Molt's B5) run the whole multimodal
backbone (`model.model`: vision tower, features scattered into the image placeholders, M-RoPE positions) instead of
the text decoder; `vision_inputs` concatenates the rows' `pixel_values` / `image_grid_thw` in row order, which is
the order the backbone fills placeholders in. nemo-automodel's Nemotron-Omni runs its own forward instead (its media
encoders and splice inside it, `splices_in_forward`). Under context parallelism the images are spliced into the
whole rows' embeddings before the cut, as nemo-automodel's VLMs do (`_vlm_shard_hidden`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from runtime import moe, packed_attention, packed_thd, vlm

if TYPE_CHECKING:
    from runtime.context_parallel import CpRows

LOGPROB_CHUNK_TOKENS = 1024
"""Positions per lm_head chunk: at vocabulary 152k and fp32 that is 0.6 GB of logits, not tokens x 0.6 MB.
A memory/speed knob of this module only; the numbers do not depend on it."""


def _chunk(head, hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
           top_ids: Tensor | None = None) -> tuple[Tensor, ...]:
    logits = head(hidden)
    if hasattr(logits, "full_tensor"):  # tensor parallelism's vocab-parallel head: the chunk's whole vocabulary
        logits = logits.full_tensor()
    logits = logits.float() / temperature          # (n, V): one chunk only
    logz = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    out = [picked]
    if with_entropy:
        out.append(logz - (torch.softmax(logits, dim=-1) * logits).sum(-1))
    if top_ids is not None:  # (n, k) score centering: the same log-softmax, gathered at the sampler's top-k ids
        out.append(logits.gather(-1, top_ids) - logz[:, None])
    return tuple(out)


@functools.cache
def _compiled_chunk():
    """`_chunk` under `torch.compile` (GPUs): its fp32 cast, log-softmax, gathers and their backward become a few
    fused kernels instead of a dozen passes over (chunk x vocabulary) fp32 logits. Measured on an H200 (Qwen3-1.7B
    shape, 4 x 4096 tokens, tests/gpu/profile_trainer.py): the trainer step 7 % faster. Static shapes: every chunk is
    `LOGPROB_CHUNK_TOKENS` rows (`head_logprobs` pads the last one), so one graph per grad mode serves every batch
    and every rank compiles it at the first step. With dynamic sizes it recompiled mid-run when a last chunk of
    another size broke a guard (inductor's matmul-padding range `301 <= rows <= 2047`, in the RL loop's log): 2.4 s
    and 0.8 s on an idle H200 (tests/gpu/check_compile_shapes.py, 2026-12-05), more beside a generating engine. The
    padding costs the chunk 11 % of its steady time at the loop's shapes, under 1 % of a training step."""
    return torch.compile(_chunk, dynamic=False)


def _compiles(hidden: Tensor) -> bool:
    """Whether the chunk runs compiled: on GPUs (on CPUs inductor's compile time outweighs what it saves)."""
    return hidden.is_cuda


def _padded(t: Tensor | None, rows: int) -> Tensor | None:
    """`t` with zero rows appended up to `rows` (differentiable: the padding's gradient is dropped)."""
    if t is None or t.shape[0] == rows:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, rows - t.shape[0]))


def _aligned(t: Tensor | None) -> Tensor | None:
    """`t`, copied when its data does not start on a 16-byte boundary. A packed row's targets are the view
    `input_ids[0, 1:]` (8 bytes in): the compiled chunk's Triton kernels load 16-byte aligned and died on it with
    "CUDA driver error: misaligned address" on an H200 (the RL loop with `actor.packing`, 2026-12-04)."""
    if t is None or (t.storage_offset() * t.element_size()) % 16 == 0:
        return t
    return t.clone()


def head_logprobs(head, hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool,
                  chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                  top_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(n,) log π(targets), entropy (or None) and (n, k) log π(top_ids) (or None) from (n, hidden) states, chunk
    by chunk over the n positions."""
    picked, entropy, top = [], [], []
    compiled = _compiles(hidden)
    for s in range(0, hidden.shape[0], chunk_tokens):
        rows = min(chunk_tokens, hidden.shape[0] - s)
        parts = [hidden[s:s + chunk_tokens], targets[s:s + chunk_tokens],
                 None if top_ids is None else top_ids[s:s + chunk_tokens]]
        # the compiled chunk's one static shape; 16-byte aligned starts (its Triton kernels', checked on CPUs too)
        parts = [_aligned(_padded(p, chunk_tokens) if compiled else p) for p in parts]
        args = (head, parts[0], parts[1], temperature, with_entropy, parts[2])
        chunk = _compiled_chunk() if compiled else _chunk
        out = checkpoint(chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else chunk(*args)
        out = tuple(o[:rows] for o in out)
        picked.append(out[0])
        if with_entropy:
            entropy.append(out[1])
        if top_ids is not None:
            top.append(out[-1])
    return (torch.cat(picked), torch.cat(entropy) if with_entropy else None,
            torch.cat(top) if top_ids is not None else None)


_IMAGE_KEYS = ("pixel_values", *vlm.GRID_KEYS)
"""A row's image inputs: the processor's patches and, per image, its grid."""


def vision_inputs(mm_inputs, input_ids: Tensor, image_token_id: int, device) -> dict[str, Tensor]:
    """The backbone's image kwargs for a micro-batch: rows' pixel values and grids (or sizes) concatenated in row
    order."""
    rows = [m for m in mm_inputs if m is not None]
    out = {"mm_token_type_ids": (input_ids == image_token_id).int()}
    for key in _IMAGE_KEYS:
        if rows and key in rows[0]:
            out[key] = torch.cat([m[key] for m in rows]).to(device)
    return out


def splices_in_forward(model) -> bool:
    """nemo-automodel's Nemotron-Omni: its own forward embeds the rows, runs the media encoders and splices their
    features in, then (under CP, its `cp_mesh` set) cuts the spliced embeddings itself; `_media_hidden` drives it."""
    return hasattr(model, "extract_feature_dynamic")


def _media_hidden(model, input_ids: Tensor, attention_mask: Tensor | None, vision: dict[str, Tensor],
                  **cp_inputs: Tensor) -> Tensor:
    """The decoder output of a model that `splices_in_forward`, from its own forward: images given as pixel values
    and sizes (its dynamic-resolution path, vLLM's; `omni_processor.model_images` makes them from the processor's
    patches), the lm_head skipped (`compute_logits=False`: this module's chunks score the final hidden states).
    `cp_inputs`: the cut's padding mask and positions (its language model is
    RoPE-free; the positions go to its MTP head only)."""
    media = {}
    if "pixel_values" in vision:  # the processor's patches as whole images (nemo-automodel's dynamic resolution)
        from runtime.omni_processor import model_images

        media = dict(zip(("pixel_values", "imgs_sizes"),
                         model_images(vision["pixel_values"], vision["image_grid_hw"], model.patch_size), strict=True))
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, compute_logits=False,
                output_hidden_states=True, **media, **cp_inputs)
    return out.hidden_states[-1]


def mrope_positions(backbone, input_ids: Tensor, attention_mask: Tensor | None,
                    vision: dict[str, Tensor]) -> dict[str, Tensor]:
    """The (3, b, w) M-RoPE position ids of rows with images, from the backbone's own `get_rope_index`: the ones
    transformers' backbone derives itself, given explicitly because nemo-automodel's own VLM implementations hand
    transformers' forward embeddings without ids, from which it cannot derive them (it would fall back to text
    positions). Rows without images need none (text positions, in both)."""
    if "image_grid_thw" not in vision or not hasattr(backbone, "get_rope_index"):
        return {}
    positions, _ = backbone.get_rope_index(input_ids, mm_token_type_ids=vision["mm_token_type_ids"],
                                           image_grid_thw=vision["image_grid_thw"], attention_mask=attention_mask)
    return {"position_ids": positions}


def _decoder_logprobs(model, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
                      temperature: float, with_entropy: bool, chunk_tokens: int,
                      vision: dict[str, Tensor] | None = None, top_ids: Tensor | None = None,
                      labels: Tensor | None = None, padding_mask: Tensor | None = None,
                      cp: CpRows | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Flat (B * (L-1),) log-probs of input_ids[:, 1:] (and entropy, and (B * (L-1), k) log-probs of `top_ids`,
    given as (B, L-1, k)): decoder once, lm_head in chunks.

    With `labels` (a context-parallel shard, `runtime/context_parallel.py`): (B * L,) log-probs of `labels` (B, L),
    the next token of every local position, with `top_ids` (B, L, k); no attention mask (torch's ring attention is
    causal), `padding_mask` for nemo-automodel's routers. A VLM's shard (`vision` and `cp` given) takes the whole
    (B, W) rows and their mask instead (`_vlm_shard_hidden`); a packed THD row's (`cp` without `vision`,
    runtime/packed_cp.py) its model's own sharded THD inputs.

    Flat, not (B, L-1): under FSDP2 this is a forward whose outputs carry the pre-backward hook, and a view output
    could lose it to a later in-place op; the caller reshapes."""
    if labels is not None:
        hidden = None
        if cp is not None:  # a VLM's shard, or a packed THD row's (its model's own CP: its sharded THD inputs)
            hidden = (_vlm_shard_hidden(model, input_ids, attention_mask, vision, cp) if vision is not None
                      else cp.decoder_hidden(model))
        return _shard_logprobs(model, input_ids, position_ids, labels, padding_mask, temperature, with_entropy,
                               chunk_tokens, top_ids, hidden)
    if position_ids is not None and attention_mask is not None:
        # transformers builds the per-document mask only without one: with it, documents attend to each other
        raise ValueError("a packed row never carries a 2-D attention mask")
    if splices_in_forward(model) and (vision is not None or position_ids is None):  # text rows too: its backbone
        hidden = _media_hidden(model, input_ids, attention_mask, vision or {})  # (`model.model`) is no module
    elif vision is not None:  # a VLM: the multimodal backbone (vision tower + language model)
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                             **mrope_positions(model.model, input_ids, attention_mask, vision), **vision
                             ).last_hidden_state
    else:
        # nemo-automodel's own implementations have no get_decoder, and their backbone returns the hidden states
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        if position_ids is not None and packed_thd.takes_thd(model):  # tilelang, te: a packed row as THD only
            hidden = packed_thd.decoder_hidden(decoder, input_ids, position_ids)
        else:
            masks = packed_row_masks(model, input_ids, position_ids) if position_ids is not None else {}
            inputs = {"input_ids": input_ids, "position_ids": position_ids, "attention_mask": attention_mask,
                      **masks}  # a packed row's document mask replaces the padding mask
            hidden = packed_thd.hidden_states(decoder(use_cache=False, **inputs))
    hidden = _all_positions(hidden)  # sequence parallelism: the final norm's output is cut over tp by positions
    b, length = input_ids.shape
    hidden = hidden.view(b, length, hidden.shape[-1])  # THD: (N, hidden) of the (1, N) row
    flat_hidden = hidden[:, :-1].reshape(b * (length - 1), hidden.shape[-1])
    flat_top = None if top_ids is None else top_ids.reshape(b * (length - 1), top_ids.shape[-1])
    return head_logprobs(model.get_output_embeddings(), flat_hidden, input_ids[:, 1:].reshape(-1), temperature,
                         with_entropy, chunk_tokens, flat_top)


def _all_positions(hidden: Tensor) -> Tensor:
    """`hidden` as it is, unless a DTensor. Sequence parallelism (nemo-automodel's plan with its sequence-parallel styles, `actor.sequence_parallel`):
    the decoder's output is a (b, w, hidden) DTensor cut over the tp ranks by positions (Shard(1), uneven when w is
    not a multiple of tp). The vocab-parallel head needs every position on every tp rank, as the plan's own lm_head
    style gathers its Shard(1) input: gathered here once, before the rows are flattened and chunked. It stays a
    (replicated) DTensor, which the head's input style takes as it is, and DTensor's backward of the gather sums
    the head's partial input gradients (one per vocabulary shard) over tp and cuts them back by positions."""
    if not isinstance(hidden, DTensor):
        return hidden
    return hidden.redistribute(placements=[Replicate()] * len(hidden.placements))


def _shard_logprobs(model, input_ids: Tensor, position_ids: Tensor | None, labels: Tensor,
                    padding_mask: Tensor | None, temperature: float, with_entropy: bool, chunk_tokens: int,
                    top_ids: Tensor | None,
                    hidden: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`_decoder_logprobs` of a context-parallel shard: every local position scores its label (`hidden`: the
    shard's decoder output, when already computed). Under tensor parallelism the tp ranks of a cp rank share its
    shard; with sequence parallelism its decoder output comes cut over them by positions, gathered before the
    vocab-parallel head as without CP (`_all_positions`)."""
    if hidden is not None:
        out = hidden
    elif hasattr(model, "get_decoder"):  # transformers-style layers: nemo-automodel's CP hooks make them causal
        out = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                  use_cache=False)
    else:
        out = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, attention_mask=None,
                          padding_mask=padding_mask)
    hidden = out if isinstance(out, Tensor) else out.last_hidden_state
    hidden = _all_positions(hidden)
    n = labels.numel()
    flat_top = None if top_ids is None else top_ids.reshape(n, top_ids.shape[-1])
    return head_logprobs(model.get_output_embeddings(), hidden.reshape(n, hidden.shape[-1]), labels.reshape(-1),
                         temperature, with_entropy, chunk_tokens, flat_top)


def _vlm_shard_hidden(model, sequences: Tensor, attention_mask: Tensor, vision: dict[str, Tensor],
                      cp: CpRows) -> Tensor:
    """A VLM's decoder output on this cp rank's positions, in the order nemo-automodel's own VLM forward takes under
    CP (Qwen3.5/3.6-MoE's `forward`, its `prepare_model_inputs_for_cp` hook): the M-RoPE positions of the whole rows
    (its hook: `get_rope_index`, images or not), the embeddings of the whole rows with the image features spliced
    in (`_embed_and_splice_for_cp`: the vision tower runs outside the ring attention), then both cut like the tokens
    (the sharder's head-tail chunks, its differentiable index_select: gradients reach the embeddings and the tower),
    and the language model on the cut embeddings. A model that `splices_in_forward` (Nemotron-Omni) does the same
    in its own forward: the whole rows embedded and spliced, cut by nemo-automodel's in-forward sharder
    (`shard_sequence_for_cp_round_robin`, the same head-tail chunks as this sharder), its language model on the cut."""
    if splices_in_forward(model):
        hidden = _media_hidden(model, sequences, None, vision, padding_mask=cp.padding_mask,
                               position_ids=cp.position_ids)
        if hidden.shape[:2] != cp.labels.shape:  # its cut and this sharder's disagree: the labels would not align
            raise RuntimeError(f"{type(model).__name__} cut its rows to {tuple(hidden.shape[:2])} positions, the "
                               f"sharder to {tuple(cp.labels.shape)}")
        return hidden
    grid = {"image_grid_thw": vision["image_grid_thw"]} if "image_grid_thw" in vision else {}
    positions = model.prepare_model_inputs_for_cp({"input_ids": sequences, "attention_mask": attention_mask.long(),
                                                   **grid})["position_ids"]
    embeds = model._embed_and_splice_for_cp(sequences, pixel_values=vision.get("pixel_values"),
                                            pixel_values_videos=None, video_grid_thw=None, **grid)
    out = model.model(inputs_embeds=cp.shard(embeds), position_ids=cp.shard(positions, seq_dim=2),
                      padding_mask=cp.padding_mask, attention_mask=None, use_cache=False)
    return out.last_hidden_state


def packed_row_masks(model, input_ids: Tensor, position_ids: Tensor) -> dict[str, Tensor | int]:
    """What a packed row needs besides its position ids: for transformers' models nothing (they find the documents
    from the position ids) but torch's varlen kernel's offsets (`packed_attention.packed_row_kwargs`);
    nemo-automodel's own implementations read no document boundaries from position ids (without a mask their sdpa
    runs causal over the whole packed row), so they take an explicit block-diagonal mask and no padding; built with
    a THD-only attention (tilelang, te) they take the row as THD (`runtime.packed_thd`)."""
    if hasattr(model, "get_decoder"):  # torch's varlen kernel: the offsets once, outside the (compiled) layers
        return packed_attention.packed_row_kwargs(position_ids) if packed_attention.is_varlen(model) else {}
    if packed_thd.takes_thd(model):
        return packed_thd.thd_row(input_ids, position_ids)
    return {"attention_mask": document_mask(position_ids),
            "padding_mask": torch.zeros_like(input_ids, dtype=torch.bool)}


def uses_te(model) -> bool:
    """nemo-automodel built the model's attention as transformer_engine's (its `BackendConfig.attn`, the plan's
    `model.attn`)."""
    return getattr(getattr(model, "backend", None), "attn", None) == "te"


def document_mask(position_ids: Tensor) -> Tensor:
    """(1, 1, N, N) bool mask of a packed row: a position attends to the positions up to it in its own row (a row
    starts where its position id is 0)."""
    doc = torch.cumsum(position_ids[0] == 0, 0)
    causal = torch.ones(doc.numel(), doc.numel(), dtype=torch.bool, device=doc.device).tril()
    return (causal & (doc[:, None] == doc[None, :]))[None, None]


def attach(model) -> None:
    """Give `model` a `lean_logprobs` method that FSDP2 treats as a forward (all-gathers the root's parameters,
    embeddings and lm_head, around it: `register_fsdp_forward_method`; a no-op for a plain module)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    model.lean_logprobs = functools.partial(_decoder_logprobs, model)
    register_fsdp_forward_method(model, "lean_logprobs")


def _call(model, *args):
    fn = getattr(model, "lean_logprobs", None)
    return fn(*args) if fn is not None else _decoder_logprobs(model, *args)


def pack(sequences: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(1, N) concatenated rows and their (1, N) per-row position ids (0..L_i-1 for row i)."""
    keep = torch.arange(sequences.shape[1], device=sequences.device)[None, :] < lengths[:, None]
    flat = sequences[keep]
    starts = torch.cumsum(lengths, 0) - lengths
    positions = torch.arange(flat.numel(), device=sequences.device) - torch.repeat_interleave(starts, lengths)
    return flat[None, :], positions[None, :]


def unpack(flat: Tensor, lengths: Tensor, width: int) -> Tensor:
    """(1, N-1, ...) packed next-token values -> (b, width-1, ...) padded layout, 0 past each row's last scored token.

    Row i's values sit at flat[off_i : off_i + L_i - 1]; the position off_i + L_i - 1 scores the next row's first
    token across a boundary and is dropped.
    """
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(width - 1, device=flat.device)[None, :]
    valid = cols < (lengths[:, None] - 1)
    index = (starts[:, None] + cols).clamp(max=flat.shape[1] - 1)
    values = flat[0][index]
    valid = valid.view(*valid.shape, *([1] * (values.dim() - 2)))
    return torch.where(valid, values, torch.zeros((), dtype=flat.dtype, device=flat.device))


def pack_top_ids(top_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(b, w-1, k) per-position ids -> (1, N-1, k) in the packed row's position order: row i's position t goes where
    its token t sits (as `pack` places tokens); each row's last position (a boundary in the packed row) gets id 0."""
    padded = torch.nn.functional.pad(top_ids, (0, 0, 0, 1))  # (b, w, k): column w-1 is the row-end filler
    return padded[attention_mask.bool()][None, :-1]


def key_padding_mask(model, attention_mask: Tensor, vision: dict[str, Tensor] | None) -> Tensor | None:
    """The 2-D mask a padded micro-batch's decoder gets (the policy's, the reference's, the critic's): none for a
    causal text decoder. Its rows are right-padded, so every key a real position attends to is real and the mask
    changes no value the runtime reads (every consumer masks the positions past a row's end). Without it
    transformers runs sdpa `is_causal` (on GPUs its flash kernel, not the masked memory-efficient one) and every
    micro-batch hands the compiled layers the same inputs: with it, a micro-batch without padding (transformers
    drops an all-ones mask) compiled a second graph mid-run (13.8 s for the demo's tiny model on a CPU). Kept where
    the model reads it beyond attention: a VLM's M-RoPE positions and image splice, routers (nemo-automodel's take
    it as their token mask), and models without transformers' decoder (nemo-automodel's own)."""
    if vision is None and hasattr(model, "get_decoder") and not splices_in_forward(model) and not moe.is_moe(model):
        return None
    return attention_mask.long()


def token_logprobs(model, sequences: Tensor, attention_mask: Tensor, temperature: float, with_entropy: bool = False,
                   packed: bool = False, chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
                   vision: dict[str, Tensor] | None = None, cp: CpRows | None = None) -> tuple[Tensor, Tensor | None]:
    """(b, w-1) log π(sequences[:, t+1] | sequences[:, :t+1]) at logits / temperature, and optionally the entropy.

    `sequences` is right-padded (b, w) with its bool `attention_mask`; `packed` runs the rows as one packed row;
    `vision` (`vision_inputs`) makes it a VLM forward (padded only); `cp`: their context-parallel shard.
    """
    lp, ent, _ = token_top_logprobs(model, sequences, attention_mask, temperature, None, with_entropy, packed,
                                    chunk_tokens, vision, cp)
    return lp, ent


def token_top_logprobs(model, sequences: Tensor, attention_mask: Tensor, temperature: float,
                       top_ids: Tensor | None, with_entropy: bool = False, packed: bool = False,
                       chunk_tokens: int = LOGPROB_CHUNK_TOKENS, vision: dict[str, Tensor] | None = None,
                       cp: CpRows | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`token_logprobs`, plus (b, w-1, k) log π(top_ids[:, t, j] | sequences[:, :t+1]) when `top_ids` (b, w-1, k)
    is given (score centering): gathered from the same chunked log-softmax, so no extra lm_head pass.

    `cp`: these rows' context-parallel shard (`runtime/context_parallel.py`, the block it comes from open; packed:
    their packed THD row's, `runtime/packed_cp.py`): each cp rank scores its positions and the results come back in
    row order on every cp rank."""
    b, width = sequences.shape
    if cp is not None and packed:  # one packed THD row cut by its model's own CP (runtime/packed_cp.py)
        lengths = attention_mask.sum(-1)
        local_top = None if top_ids is None else cp.shard(pack_top_ids(top_ids, attention_mask)[0])
        outs = _call(model, cp.input_ids[None], None, None, temperature, with_entropy, chunk_tokens, None,
                     local_top, cp.labels[None], None, cp)
        # the packed row's last position scores no token: dropped, as `unpack` expects (N-1) values
        lp, ent, top = (None if x is None else unpack(cp.gather(x)[None, :-1], lengths, width) for x in outs)
        return lp, ent, top
    if cp is not None:
        local_top = None if top_ids is None else cp.shard(torch.nn.functional.pad(top_ids, (0, 0, 0, 1)))
        n = cp.input_ids.shape[1]
        if vision is not None:  # a VLM: the whole rows go in, its images spliced in before the cut
            outs = _call(model, sequences, attention_mask, None, temperature, with_entropy, chunk_tokens, vision,
                         local_top, cp.labels, cp.padding_mask, cp)
        else:
            outs = _call(model, cp.input_ids, None, cp.position_ids, temperature, with_entropy, chunk_tokens, None,
                         local_top, cp.labels, cp.padding_mask)
        # position w-1 scores no token (its label is a filler): dropped, as `Experience` aligns them
        lp, ent, top = (None if x is None else cp.gather(x.view(b, n, *x.shape[1:]))[:, :-1] for x in outs)
        return lp, ent, top
    if vision is not None and packed:
        raise ValueError("VLM rows are never packed (the compiler forces actor.packing off, B5)")
    if not packed:
        mask = key_padding_mask(model, attention_mask, vision)
        lp, ent, top = _call(model, sequences, mask, None, temperature, with_entropy, chunk_tokens, vision, top_ids)
        return (lp.view(b, width - 1), None if ent is None else ent.view(b, width - 1),
                None if top is None else top.view(b, width - 1, -1))
    lengths = attention_mask.sum(-1)
    flat, positions = pack(sequences, lengths)
    flat_top = None if top_ids is None else pack_top_ids(top_ids, attention_mask)
    lp, ent, top = _call(model, flat, None, positions, temperature, with_entropy, chunk_tokens, None, flat_top)
    return (unpack(lp[None], lengths, width), None if ent is None else unpack(ent[None], lengths, width),
            None if top is None else unpack(top[None], lengths, width))
