"""Varlen (packed) attention on CUDA without the flash-attn package: PyTorch's own FlashAttention-2 kernel.

`model.attn: flash_attention_2` loads transformers' flash_attention_2 when the flash_attn package imports; without
it transformers would fetch a Hub kernel (no network on our machines), so on CUDA the plan's name maps to `NAME`,
registered here with transformers' attention interface: `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10,
CUDA, bf16/fp16, autograd) over cumulative sequence offsets. Offsets come from the position ids of a packed row
(restarting at 0 per sequence, as `runtime.logprobs.pack` writes them) or from a right-padded row's 2-D mask (the
padding is dropped before the kernel and zeros come back in its place). Its mask function is transformers' own
`flash_attention_mask` (None without padding), so a packed row's documents never see each other.

A packed row never carries a 2-D attention mask: with one, transformers 5.18's sdpa/flex/eager masks fall back to
plain causal attention across the documents, silently (`runtime.logprobs` asserts it; so does `NAME`).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

NAME = "molt_varlen"  # no "flash" in it: transformers 5.17 would look for such a name on the Hub
PACKED_ROW_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # `packed_row_kwargs`' names
_registered: set[str] = set()  # NAME, and a CPU test's name for the reference kernel
_offsets_cache: list = [None, None]  # [the tensor the offsets were computed from, (cu_seqlens, max_len, index)]


def implementation(attn: str, device: torch.device) -> str:
    """transformers' attention name for the plan's `model.attn` on `device` (registering `NAME` when it is the one)."""
    if attn == "flex":
        return "flex_attention"
    if attn == "flash_attention_2" and device.type == "cuda" and importlib.util.find_spec("flash_attn") is None:
        register()
        return NAME
    return attn


def register(name: str = NAME, kernel: Callable | None = None) -> None:
    """Register `name` with transformers' attention and mask interfaces. `kernel` (torch's `varlen_attn` unless
    given: a CPU test passes a reference, the kernel being CUDA-only) takes varlen_attn's arguments."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    kernel = kernel or _torch_kernel()

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        return varlen_attention_forward(kernel, module, query, key, value, attention_mask, scaling, dropout,
                                        **kwargs)

    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    _registered.add(name)


def is_varlen(model) -> bool:
    """`model` (a transformers model) attends through `register`'s varlen attention."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in _registered


def _torch_kernel() -> Callable:
    from torch.nn.attention.varlen import varlen_attn

    gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch >= 2.12; 2.11 wants K/V repeated

    def kernel(q, k, v, cu, max_len, scale):
        if k.shape[1] != q.shape[1] and not gqa:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        extra = {"enable_gqa": True} if gqa and k.shape[1] != q.shape[1] else {}
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0), **extra)

    return kernel


def is_packed(position_ids: Tensor | None) -> bool:
    """Position ids that restart at 0 inside a row: several sequences packed in it."""
    return position_ids is not None and bool((position_ids[:, 1:] == 0).any())


def _offsets(attention_mask: Tensor | None, position_ids: Tensor | None, b: int, s: int, device):
    """(cu_seqlens int32, max length, kept-token index or None) of the (b, s) rows, computed once per forward (the
    layers share the same mask / position tensor)."""
    source = attention_mask if attention_mask is not None else position_ids
    if source is not None and _offsets_cache[0] is source:
        return _offsets_cache[1]
    index = None
    if attention_mask is not None:  # right-padded rows: drop the padding
        keep = attention_mask.bool()
        lengths = keep.sum(-1)
        lengths = lengths[lengths > 0]  # a filler row of padding alone is no sequence
        index = keep.reshape(-1).nonzero().squeeze(1)
    elif position_ids is not None:  # a sequence starts wherever the position is 0
        # (1, s) positions shared by b unmasked padded rows (`key_padding_mask` gives them no mask)
        flat = position_ids.expand(b, s).reshape(-1)
        starts = torch.cat([(flat == 0).nonzero().squeeze(1), torch.tensor([flat.numel()], device=flat.device)])
        lengths = starts.diff()
    else:
        lengths = torch.full((b,), s, device=device)
    cu = torch.nn.functional.pad(lengths.cumsum(0).to(torch.int32), (1, 0)).to(device)
    out = (cu, int(lengths.max()), index)
    _offsets_cache[:] = [source, out]
    return out


def packed_row_kwargs(position_ids: Tensor) -> dict[str, Tensor | int]:
    """A packed (1, N) row's sequence offsets as transformers' varlen keyword arguments, computed once per forward
    and handed through the model to every layer's attention. Computed inside a compiled layer instead, their
    data-dependent `nonzero` broke the graph, and a break inside the checkpointed layer runs it eager."""
    cu, max_len, _ = _offsets(None, position_ids, *position_ids.shape, position_ids.device)
    return dict(zip(PACKED_ROW_KWARGS, (cu, cu, max_len, max_len), strict=True))


def varlen_attention_forward(kernel: Callable, module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             position_ids: Tensor | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, cu_seq_lens_q: Tensor | None = None,
                             max_length_q: int | None = None, **_) -> tuple[Tensor, None]:
    """transformers' attention call: (b, heads, s, d) query/key/value -> ((b, s, heads, d), no weights). A packed
    row's offsets come as `cu_seq_lens_q` / `max_length_q` (`packed_row_kwargs`) or from its position ids."""
    if sliding_window is not None or softcap is not None or (dropout and module.training):
        raise NotImplementedError("varlen attention here is causal full attention without dropout or softcap")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"varlen attention takes a 2-D padding mask, got {tuple(attention_mask.shape)}")
    if attention_mask is not None and (cu_seq_lens_q is not None or is_packed(position_ids)):
        raise ValueError("a packed row carries a 2-D attention mask: its documents would attend to each other")
    b, h, s, d = query.shape
    if cu_seq_lens_q is not None and max_length_q is not None:
        cu, max_len, index = cu_seq_lens_q, max_length_q, None
    else:
        cu, max_len, index = _offsets(attention_mask, position_ids, b, s, query.device)
    q, k, v = (x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value))
    if index is not None:
        q, k, v = q[index], k[index], v[index]
    out = kernel(q, k, v, cu, max_len, scaling)
    if index is not None:
        out = out.new_zeros(b * s, h, d).index_copy(0, index, out)
    return out.reshape(b, s, h, d), None


def _reference(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scale: float | None) -> Tensor:
    out = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])[0].transpose(0, 1))
    return torch.cat(out)


@torch.library.custom_op("molt::varlen_reference", mutates_args=())
def reference_kernel(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scale: float | None) -> Tensor:
    """What `varlen_attn` computes, one sequence at a time with causal sdpa: for CPU tests (the kernel is CUDA-only).
    An opaque op with an int `max_len`, as torch's kernel is, so compiled layers trace and guard on it the same way."""
    return _reference(q, k, v, cu, scale)


@reference_kernel.register_fake
def _(q, k, v, cu, max_len, scale):
    return torch.empty_like(q)


def _reference_context(ctx, inputs, output):
    q, k, v, cu, _, scale = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale = scale


def _reference_backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        dq, dk, dv = torch.autograd.grad(_reference(q, k, v, cu, ctx.scale), (q, k, v), grad)
    return dq, dk, dv, None, None, None


reference_kernel.register_autograd(_reference_backward, setup_context=_reference_context)
