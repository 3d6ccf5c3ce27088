"""The hf engine's generation core: continuous batching over a preallocated KV cache, sampling on the device.

Needs only torch and transformers (the GPU benchmark loads this file by path, without Ray or pydantic).

- KV cache: one buffer per layer of shape (slots, kv_heads, cache_len, head_dim), a slot per request in flight. It is
  handed to the transformers model as its `past_key_values` (`SlotKVCache.update` is the only method the attention
  layers call), with our attention function registered in transformers' `AttentionInterface`, so any model written
  against that interface (Llama, Qwen2/3, Mistral, ...) runs unchanged.
- Prefill: newly admitted prompts, right-padded, causal attention from position 0; their KV goes to their slots.
- Decode: every live slot advances one token per step; rows `[0, nb)` and cache positions `[0, L)` are computed, with
  `nb` and `L` rounded up to buckets, so each (nb, L) step has static shapes. On CUDA each such step is captured once
  as a CUDA graph and replayed (one launch instead of hundreds of Python-dispatched kernels: the decode step of a
  1.7B model is otherwise CPU-bound).
- Sampling: per-row temperature and top-p tensors (requests with different settings share a batch), Gumbel-max
  sampling from the processed distribution, greedy rows by argmax; no host sync inside a chunk of `chunk_steps`
  steps. Tokens and logprobs come to the host once per chunk, where EOS and length limits are checked and finished
  slots are freed; pending requests join at chunk boundaries. A chunk ends early when `yield_to()` says someone
  waits for the model (the engine's pause, a weight load, a probe's score): on CUDA the host keeps at most two steps
  queued ahead of the device, so the wait is two decode steps, not the rest of a chunk (up to 16). A request's
  `min_tokens` (vLLM's) bans its EOS ids until it has that many tokens: a per-slot countdown on the device, applied
  only while some live request has one.
- Logprobs: `processed` = log-softmax of logits / T after the top-p cut and the EOS ban (the distribution sampled
  from; greedy rows use T = 1), `raw` = log-softmax of the unprocessed logits, both in float32, as vLLM's
  `logprobs_mode`.
- VLM prompts (a `vision` prefill helper, `hf_vision.VisionPrefill`): the prefill embeds the images' features at
  their placeholders with the model's 3-D rope positions; decode positions are the cache position + the slot's delta.

The model's forward is transformers' own; only attention (matmul + softmax over the slot's cache for decode, SDPA
with `is_causal` for prefill) and the cache are ours. Models whose logits need more than `lm_head(final hidden)`
(Gemma-2 soft-capping, Cohere's logit scale) or sliding-window layers are not supported.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from runtime import moe

ATTENTION = "molt_slots"
"""Name of our attention function in transformers' AttentionInterface."""

MIN_LEN_BUCKET = 64
"""Smallest attended cache length; buckets double from here up to the cache length."""


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over the slot cache. query (B, Hq, T, D); key/value (B, Hkv, S, D) -> (B, T, Hq, D).

    Decode (T == 1, additive mask (B, 1, 1, S)): grouped-query attention as two batched matmuls with each KV head's
    query heads as its query rows, so K/V are read once (transformers' SDPA path first copies them to Hq heads);
    on the H200 this ran at ~73% of memory bandwidth, faster than SDPA (cuDNN) on the same layout. Prefill and
    full-sequence scoring (T > 1): SDPA with a causal mask, rows right-padded from position 0.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    b, hq, t, d = query.shape
    if t == 1 and attention_mask is not None:
        hkv = key.shape[1]
        q = query.reshape(b, hkv, hq // hkv, d)  # a KV head's query heads as its query rows: no K/V copy per head
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale + attention_mask
        out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
        return out.reshape(b, 1, hq, d), None
    out = F.scaled_dot_product_attention(query, key, value, is_causal=t > 1, scale=scale,
                                         enable_gqa=key.shape[1] != hq)
    return out.transpose(1, 2).contiguous(), None


def use_slot_attention(model) -> None:
    """Register `slot_attention` and make the model use it (also for plain forwards: causal SDPA, no mask). A VLM's
    vision tower keeps SDPA: its attention is bidirectional and never cached."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, slot_attention)
    vision = getattr(model.config, "vision_config", None) is not None
    model.set_attn_implementation({"": ATTENTION, "text_config": ATTENTION, "vision_config": "sdpa"} if vision
                                  else ATTENTION)


class SlotKVCache:
    """KV buffers per layer, (slots, kv_heads, cache_len, head_dim); duck-types the transformers Cache the attention
    layers call (`update`), in one of two modes set before each forward:

    - prefill (`prefill_slots` set): the new keys of rows `prefill_slots` go to positions `[0, T)`; attention uses the
      new keys themselves (the prompt is the whole context).
    - decode: row i's one new key goes to position `pos[i]`; attention reads rows `[0, nb)`, positions `[0, L)`.
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, cache_len: int, dtype, device):
        shape = (slots, kv_heads, cache_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.rows = torch.arange(slots, device=device)
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)
        self.prefill_slots: torch.Tensor | None = None
        self.view = (slots, cache_len)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill_slots is not None:
            t = key_states.shape[2]
            k[self.prefill_slots, :, :t] = key_states
            v[self.prefill_slots, :, :t] = value_states
            return key_states, value_states
        nb, length = self.view
        rows, pos = self.rows[:nb], self.pos[:nb]
        k[rows, :, pos] = key_states[:, :, 0]
        v[rows, :, pos] = value_states[:, :, 0]
        return k[:nb, :, :length], v[:nb, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always passed explicitly

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-p nucleus, as transformers' TopPLogitsWarper and vLLM do:
    drop the least likely tokens whose cumulative probability is <= 1 - top_p, always keeping the most likely."""
    sorted_logits, order = torch.sort(logits, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(-1)
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def sample(logits, temperature, top_p, greedy, *, filter_top_p: bool, raw_logprobs: bool, top_k: int = 0,
           ban=None):
    """Next token and its logprob per row; logits (n, V) float32, temperature/top_p (n,) (1 for greedy rows).
    With `top_k` > 0 also the (n, top_k) ids and log-probs of the most likely tokens of the same log-softmax the
    sampled token's log-prob is taken from (score centering); else None. `ban` (n, V) bool: tokens no row may
    sample (EOS before a request's `min_tokens`), a processing step like top-p (raw log-probs ignore it)."""
    allowed = logits if ban is None else logits.masked_fill(ban, float("-inf"))
    processed = allowed / temperature.unsqueeze(-1)
    if filter_top_p:
        processed = top_p_filter(processed, top_p)
    logp = torch.log_softmax(processed, dim=-1)
    # Gumbel-max: argmax(logp - log E), E ~ Exp(1), is a sample of softmax(processed); no host sync.
    noise = torch.empty_like(logp).exponential_().clamp_min_(1e-30).log_()
    sampled = (logp - noise).argmax(dim=-1)
    tokens = torch.where(greedy, allowed.argmax(dim=-1), sampled)
    source = torch.log_softmax(logits, dim=-1) if raw_logprobs else logp
    top = torch.topk(source, top_k, dim=-1) if top_k else None
    return tokens, source.gather(1, tokens.unsqueeze(-1)).squeeze(-1), top


def buckets(limit: int, start: int) -> list[int]:
    """start, 2 start, 4 start, ... below limit, then limit."""
    out = []
    b = start
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def bucket_of(n: int, sizes: list[int]) -> int:
    return next(s for s in sizes if s >= n)


@dataclass
class Request:
    """One generation request; `handle` is the caller's (e.g. a future), returned with the result."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    handle: Any = None
    min_tokens: int = 0  # EOS is banned until this many tokens (vLLM's `min_tokens`)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the core's `version` when each token was sampled
    finish_reason: str | None = None
    limit: int = 0  # tokens it may generate: max_tokens, cut to the context length
    routed: list = field(default_factory=list)  # (n, L, k) int16 numpy chunks of routing (R3), prompt first
    top_k: int = 0  # score centering: also record each generated token's top-k ids and log-probs
    top: list = field(default_factory=list)  # ((n, top_k) int64 ids, (n, top_k) float32 log-probs) numpy chunks
    mm: dict | None = None  # VLM: the prompt's images as model inputs (pixel_values, image_grid_thw), `hf_vision`

    def routed_experts(self):
        """(prompt + generated - 1, L, k) routing of every token a forward saw, or None when not recorded."""
        return np.concatenate(self.routed) if self.routed else None

    def top_arrays(self):
        """((A, top_k) ids, (A, top_k) log-probs) aligned with token_ids, or (None, None) when top_k is 0."""
        if not self.top_k:
            return None, None
        return np.concatenate([i for i, _ in self.top]), np.concatenate([v for _, v in self.top])


class DecodeCore:
    """Continuous-batching generator over one model. One thread calls `run_chunk`; `submit` may be called from any
    thread."""

    def __init__(self, model, *, slots: int, max_model_len: int, eos_ids, pad_id: int, raw_logprobs: bool,
                 cuda_graphs: bool, chunk_steps: int = 16, prefill_tokens: int = 16384, record_routing: bool = False,
                 vision=None, yield_to=None):
        cfg = model.config.get_text_config()
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.slots = slots
        self.max_model_len = max_model_len
        self.eos_ids = set(eos_ids)
        self.pad_id = pad_id
        self.raw_logprobs = raw_logprobs
        self.chunk_steps = chunk_steps
        self.prefill_tokens = prefill_tokens
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.yield_to = yield_to  # () -> bool: end the running chunk after the steps already queued
        self.step_events = ([torch.cuda.Event() for _ in range(chunk_steps)]
                            if yield_to is not None and self.device.type == "cuda" else [])
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = SlotKVCache(cfg.num_hidden_layers, slots, kv_heads, head_dim, max_model_len, self.dtype,
                                 self.device)
        use_slot_attention(model)
        dev = self.device
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=dev)  # next input token per slot
        self.temperature = torch.ones(slots, device=dev)
        self.top_p = torch.ones(slots, device=dev)
        self.greedy = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.eos_left = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens until EOS may be sampled
        self.eos_mask = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=dev)
        self.eos_mask[[i for i in self.eos_ids if i < cfg.vocab_size]] = True
        self.logits = torch.zeros((slots, cfg.vocab_size), device=dev)  # decode-step output, float32
        self.columns = torch.arange(max_model_len, device=dev)
        self.batch_buckets = buckets(slots, 1)
        self.len_buckets = buckets(max_model_len, MIN_LEN_BUCKET)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.graph_weights: list[int] = []  # parameter addresses the graphs were captured with
        self.graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        self.pending: list[Request] = []
        self.pending_lock = threading.Lock()
        self.active: dict[int, Request] = {}  # slot -> request
        self.free = list(range(slots))
        # VLM (`hf_vision.VisionPrefill`): image prompts prefill with the tower's features and 3-D rope positions;
        # decode positions are the cache position plus the slot's rope delta.
        self.vision = vision
        self.rope_delta = torch.zeros(slots, dtype=torch.long, device=dev)
        self.version = 0  # weights version of the model, set by the engine after each load (between chunks)
        # R3: each decode step's routers copy their top-k into this fixed buffer (a CUDA graph replays the copy).
        layers, top_k = moe.shape_of(model)
        self.record_routing = record_routing and layers > 0
        self.route_buf = torch.full((layers, slots, top_k), -1, dtype=torch.int16, device=dev)

    # ------------------------------------------------------------------ requests
    def submit(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if not 0 < n < self.max_model_len:
            raise ValueError(f"prompt of {n} tokens: the engine takes 1 to {self.max_model_len - 1}")
        request.limit = min(request.max_tokens, self.max_model_len - n)
        if request.limit < 1:
            raise ValueError(f"max_tokens {request.max_tokens} < 1")
        with self.pending_lock:
            self.pending.append(request)

    def busy(self) -> bool:
        return bool(self.pending or self.active)

    def abort_all(self) -> list[Request]:
        """Drop every request (after a failed step); their slots are free again."""
        with self.pending_lock:
            dropped = list(self.active.values()) + self.pending
            self.active, self.pending, self.free = {}, [], list(range(self.slots))
        return dropped

    @torch.inference_mode()
    def run_chunk(self) -> list[Request]:
        """Admit pending requests into free slots, decode up to `chunk_steps` steps; return the requests finished."""
        finished = self._admit()
        if self.active:
            finished += self._decode_chunk()
        return finished

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= 1, temperature 1: one causal forward, no cache."""
        n = len(token_ids)
        ids = torch.tensor([token_ids], device=self.device)
        # a 4D mask is used as given (no mask building for our attention name); slot_attention runs causal SDPA
        causal = torch.full((n, n), float("-inf"), device=self.device).triu(1).view(1, 1, n, n)
        hidden = self.decoder(input_ids=ids, position_ids=torch.arange(n, device=self.device).unsqueeze(0),
                              attention_mask=causal, use_cache=False).last_hidden_state
        logits = self.lm_head(hidden[0, :-1]).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()

    # ------------------------------------------------------------------ prefill
    def _admit(self) -> list[Request]:
        with self.pending_lock:
            take = min(len(self.free), len(self.pending))
            new, self.pending = self.pending[:take], self.pending[take:]
        if take == 0:
            return []
        self.free.sort()
        slots, self.free = self.free[:take], self.free[take:]
        self.active.update(zip(slots, new, strict=True))  # from here on `abort_all` answers them if a step fails
        order = sorted(range(take), key=lambda i: len(new[i].prompt_ids))
        finished: list[Request] = []
        group: list[int] = []
        for i in order:  # ascending length: a group's padded size is its count x its last prompt's length
            if group and (len(group) + 1) * len(new[i].prompt_ids) > self.prefill_tokens:
                finished += self._prefill([new[j] for j in group], [slots[j] for j in group])
                group = []
            group.append(i)
        return finished + self._prefill([new[j] for j in group], [slots[j] for j in group])

    def _prefill(self, reqs: list[Request], slots: list[int]) -> list[Request]:
        dev = self.device
        lens = [len(r.prompt_ids) for r in reqs]
        width = max(lens)
        ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)
        for row, r in enumerate(reqs):
            ids[row, : lens[row]] = torch.tensor(r.prompt_ids)
        ids = ids.to(dev)
        slot_t = torch.tensor(slots, device=dev)
        positions = torch.arange(width, device=dev).expand(len(reqs), width)
        causal = torch.full((width, width), float("-inf"), device=dev).triu(1).expand(len(reqs), 1, width, width)
        inputs = {"input_ids": ids, "position_ids": positions}
        if self.vision is not None:
            embeds, positions, deltas = self.vision.inputs(ids, lens, [r.mm for r in reqs])
            inputs = {"inputs_embeds": embeds, "position_ids": positions}
            self.rope_delta[slot_t] = deltas
        self.cache.prefill_slots = slot_t
        try:
            with self._recording() as routed:
                hidden = self.decoder(**inputs, attention_mask=causal, past_key_values=self.cache,
                                      use_cache=True).last_hidden_state
        finally:
            self.cache.prefill_slots = None
        if self.record_routing:  # (L, rows * width, k) -> each row's (len, L, k) prompt routing
            per_row = torch.stack(routed).view(len(routed), len(reqs), width, -1).to(torch.int16).cpu().numpy()
            for row, r in enumerate(reqs):
                r.routed.append(per_row[:, row, :lens[row]].transpose(1, 0, 2))
        last = hidden[torch.arange(len(reqs), device=dev), torch.tensor(lens, device=dev) - 1]
        logits = self.lm_head(last).float()
        greedy = torch.tensor([r.temperature <= 0 for r in reqs], device=dev)
        temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in reqs], device=dev)
        top_p = torch.tensor([r.top_p if r.temperature > 0 else 1.0 for r in reqs], device=dev)
        top_k = max(r.top_k for r in reqs)
        ban = None
        if any(r.min_tokens for r in reqs):
            ban = torch.tensor([r.min_tokens > 0 for r in reqs], device=dev).unsqueeze(1) & self.eos_mask
        self.eos_left[slot_t] = torch.tensor([max(r.min_tokens - 1, 0) for r in reqs], device=dev)
        tokens, logprobs, top = sample(logits, temperature, top_p, greedy, filter_top_p=bool((top_p < 1).any()),
                                       raw_logprobs=self.raw_logprobs, top_k=top_k, ban=ban)
        host_top = None if top is None else (top.indices.cpu().numpy(), top.values.cpu().numpy())
        self.tokens[slot_t] = tokens
        self.cache.pos[slot_t] = torch.tensor(lens, device=dev)
        self.temperature[slot_t], self.top_p[slot_t], self.greedy[slot_t] = temperature, top_p, greedy
        finished = []
        for row, (r, s, tok, lp) in enumerate(zip(reqs, slots, tokens.tolist(), logprobs.tolist(), strict=True)):
            done = self._append(r, [tok], [lp])
            if r.top_k:
                r.top.append((host_top[0][row:row + 1, :r.top_k], host_top[1][row:row + 1, :r.top_k]))
            if done:
                finished.append(self._release(s))
        return finished

    # ------------------------------------------------------------------ decode
    def _decode_chunk(self) -> list[Request]:
        live = sorted(self.active)
        remaining = {s: self.active[s].limit - len(self.active[s].token_ids) for s in live}
        steps = min(self.chunk_steps, max(remaining.values()))
        # highest position fed in this chunk by a row still live: prompt + generated - 1 + min(steps, remaining) - 1
        reach = max(len(self.active[s].prompt_ids) + len(self.active[s].token_ids) - 1 + min(steps, remaining[s])
                    for s in live)
        nb = bucket_of(live[-1] + 1, self.batch_buckets)
        length = bucket_of(reach, self.len_buckets)
        filter_top_p = any(self.active[s].top_p < 1 and self.active[s].temperature > 0 for s in live)
        min_tokens = any(self.active[s].min_tokens for s in live)  # else the countdowns are all 0: no ban
        if self.graphs and [p.data_ptr() for p in self.model.parameters()] != self.graph_weights:
            self.graphs.clear()  # weights were loaded into new tensors, not copied into the captured ones
        out_tokens = torch.empty((nb, steps), dtype=torch.long, device=self.device)
        out_logprobs = torch.empty((nb, steps), device=self.device)
        out_routing = torch.empty((steps, *self.route_buf[:, :nb].shape), dtype=torch.int16, device=self.device)
        top_k = max(self.active[s].top_k for s in live)
        out_top_ids = torch.empty((nb, steps, top_k), dtype=torch.long, device=self.device)
        out_top_lps = torch.empty((nb, steps, top_k), device=self.device)
        ran = steps
        for k in range(steps):
            if k and self._should_yield(k):
                ran = k
                break
            with self._recording(self.route_buf):
                logits = self._step(nb, length)
            if self.record_routing:
                out_routing[k] = self.route_buf[:, :nb]
            ban = None
            if min_tokens:
                ban = (self.eos_left[:nb] > 0).unsqueeze(1) & self.eos_mask
                self.eos_left[:nb] = (self.eos_left[:nb] - 1).clamp_(min=0)
            tokens, logprobs, top = sample(logits, self.temperature[:nb], self.top_p[:nb], self.greedy[:nb],
                                           filter_top_p=filter_top_p, raw_logprobs=self.raw_logprobs, top_k=top_k,
                                           ban=ban)
            out_tokens[:, k], out_logprobs[:, k] = tokens, logprobs
            if top is not None:
                out_top_ids[:, k], out_top_lps[:, k] = top.indices, top.values
            self.tokens[:nb] = tokens
            # finished rows may run on until the chunk ends: keep their writes inside the cache
            self.cache.pos[:nb] = (self.cache.pos[:nb] + 1).clamp_(max=self.max_model_len - 1)
            if self.step_events:
                self.step_events[k].record()
        if ran < steps:
            out_tokens, out_logprobs, out_routing = out_tokens[:, :ran], out_logprobs[:, :ran], out_routing[:ran]
            out_top_ids, out_top_lps = out_top_ids[:, :ran], out_top_lps[:, :ran]
            steps = ran
        host_tokens, host_logprobs = out_tokens.tolist(), out_logprobs.tolist()  # the chunk's one sync
        host_routing = out_routing.cpu().numpy() if self.record_routing else None  # (steps, L, nb, k)
        host_top = (out_top_ids.cpu().numpy(), out_top_lps.cpu().numpy()) if top_k else None  # (nb, steps, top_k)
        finished = []
        for s in live:
            r, n = self.active[s], min(steps, remaining[s])
            before = len(r.token_ids)
            done = self._append(r, host_tokens[s][:n], host_logprobs[s][:n])
            if host_routing is not None:  # step j fed the token generated before it: one row per appended token
                r.routed.append(host_routing[:len(r.token_ids) - before, :, s].copy())
            if r.top_k:  # one row per appended token, the request's own k of the chunk's largest
                added = len(r.token_ids) - before
                r.top.append((host_top[0][s, :added, :r.top_k].copy(), host_top[1][s, :added, :r.top_k].copy()))
            if done:
                finished.append(self._release(s))
        return finished

    def _should_yield(self, k: int) -> bool:
        """Before decode step k >= 1 (each chunk makes progress): end the chunk if someone waits for the model. On
        CUDA the host first waits for step k - 2, so at most two steps are queued when it ends."""
        if self.yield_to is None:
            return False
        if k >= 2 and self.step_events:
            self.step_events[k - 2].synchronize()  # releases the GIL: the actor's event loop runs meanwhile
        return self.yield_to()

    def _recording(self, into: torch.Tensor | None = None):
        return moe.record(self.model, into) if self.record_routing else contextlib.nullcontext([])

    def _forward_decode(self, nb: int, length: int) -> None:
        """One decode step of rows [0, nb) over cache positions [0, length): logits into `self.logits[:nb]`."""
        self.cache.view = (nb, length)
        pos = self.cache.pos[:nb]
        mask = torch.zeros((nb, length), device=self.device).masked_fill_(
            self.columns[:length].unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
        rope = pos if self.vision is None else pos + self.rope_delta[:nb]
        hidden = self.decoder(input_ids=self.tokens[:nb].unsqueeze(1), position_ids=rope.unsqueeze(1),
                              attention_mask=mask.view(nb, 1, 1, length), past_key_values=self.cache,
                              use_cache=True).last_hidden_state
        self.logits[:nb] = self.lm_head(hidden[:, 0]).float()

    def _step(self, nb: int, length: int) -> torch.Tensor:
        if not self.cuda_graphs:
            self._forward_decode(nb, length)
            return self.logits[:nb]
        graph = self.graphs.get((nb, length))
        if graph is None:
            graph = self.graphs[(nb, length)] = self._capture(nb, length)
        self.cache.view = (nb, length)
        graph.replay()
        return self.logits[:nb]

    def _capture(self, nb: int, length: int) -> torch.cuda.CUDAGraph:
        """Capture the decode step; its inputs (tokens, positions, KV, weights) and output (logits) are fixed
        buffers, updated in place between replays. The warm-up runs write only positions the next real step
        overwrites (the KV at `pos`) and the logits buffer."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward_decode(nb, length)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.graph_weights = [p.data_ptr() for p in self.model.parameters()]
        with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
            self._forward_decode(nb, length)
        return graph

    # ------------------------------------------------------------------ bookkeeping
    def _append(self, r: Request, tokens: list[int], logprobs: list[float]) -> bool:
        """Add generated tokens up to the first EOS or the limit; True when the request is done."""
        for tok, lp in zip(tokens, logprobs, strict=True):
            r.token_ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self.version)  # a chunk runs under one version: loads happen only between chunks
            if tok in self.eos_ids:
                r.finish_reason = "stop"
                return True
            if len(r.token_ids) >= r.limit:
                r.finish_reason = "length"
                return True
        return False

    def _release(self, slot: int) -> Request:
        self.free.append(slot)
        return self.active.pop(slot)

    def memory_bytes(self) -> int:
        return self.cache.nbytes() + self.logits.numel() * 4

