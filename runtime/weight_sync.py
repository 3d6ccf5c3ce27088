"""Streamed weight sync: trainer shards -> fixed-size buckets in the engine dtype -> broadcast to every engine worker.

One dedicated process group (the plan's `weight_sync`) holds trainer rank 0 (group rank 0, the sender) and every
engine worker (ranks `engine_rank_offsets[i] + j`). It is built from a TCPStore that trainer rank 0 hosts, without
touching either side's default world: the trainer ranks have their FSDP world, each vLLM worker its own. Each engine
joins with the driver's `JoinMessage`. The buckets travel by the plan's method, a `Transport`: a gloo broadcast on
CPU (so CI runs this exact code path), an NCCL broadcast on GPUs (`Broadcast`), or CUDA IPC
(`runtime.weight_sync_ipc.IpcChannel`) when every member shares one GPU; `send` and `receive` are the same for all
three.

The sender and the receivers agree on the stream without exchanging anything per bucket: both sides hold the same
`TensorMeta` list (names, wire dtypes, full shapes; taken once from rank 0's DTensor global shapes, no gather) and
cut it into buckets with the same `bucket_layout`. Per sync:

- rank 0 casts its own piece of each of one bucket's parameters straight into the bucket and every other trainer
  rank sends its pieces point to point, received directly into their place (`ShardGather`; which rank holds which
  box of a tensor is `runtime/shard_layout.py`'s, for FSDP2, HSDP and expert parallelism at any ep): the gather
  moves wire-dtype bytes, writes each byte once (a piece that is not one run of its tensor, an expert's ep_shard
  columns, is copied once more, from a piece-sized buffer), and no rank holds more than two buckets (never the
  whole model, never fp32 unless the engine runs fp32);
- rank 0 copies each full parameter into the current bucket and broadcasts a full bucket asynchronously, so the next
  bucket's gather overlaps the previous bucket's transfer (at most two buckets alive);
- each receiver posts the next bucket's receive before loading the current one (again two buffers), and loads each
  bucket as it arrives (vLLM: `model.load_weights` inside the layer-wise reload; hf: `param.copy_`).

Kept free of Ray and of vLLM: the vLLM worker extension and the hf engine import it as well.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from runtime import shard_layout
from runtime.weight_sync_ipc import IpcChannel, broadcast_from_rank0

# A tied lm_head is one parameter in the trainer (named_parameters lists it once, as the embedding) but vLLM must
# receive it under its own name too (environment.md §3): the receiver aliases it, no extra bytes cross the wire.
LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
VLM_EMBED = "model.language_model.embed_tokens.weight"  # a VLM's language model (transformers 5 module names)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str              # torch dtype name on the wire, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass
class SyncStats:
    """One side's share of one sync (seconds, bytes). The driver merges the sender's and the receivers'."""

    gather_s: float = 0.0      # sender: cast + pack + gather of the shards
    transfer_s: float = 0.0    # time blocked on the broadcast (sender: waiting for sends, receiver: for data)
    load_s: float = 0.0        # receiver: loading buckets into the model
    bytes: int = 0
    buckets: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"gather_s": self.gather_s, "transfer_s": self.transfer_s, "load_s": self.load_s,
                "bytes": float(self.bytes), "buckets": float(self.buckets)}


def wire_metas(sources: list[tuple[str, torch.Tensor]], dtype: str) -> list[TensorMeta]:
    """What the sender will stream, at the full (global) shapes: `sources` are the model backend's
    (`ModelBackend.hf_weights`: the engine's names and layouts, in stream order)."""
    return [TensorMeta(name, dtype, tuple(p.shape)) for name, p in sources]


def bucket_layout(metas: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Cut the stream into consecutive buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, m in enumerate(metas):
        if current and size + m.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += m.nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class JoinMessage:
    """What an engine needs to join the weight-sync group, built once by the driver from the plan's `weight_sync`
    (`WeightSyncLink.connect`); each engine gets it with its own `rank_offset` (and, vLLM, the tied `aliases`). The
    vLLM worker extension takes it as its init info (vLLM passes it as a dict and rebuilds it here)."""

    method: str                        # the plan's weight_sync.method: gloo_broadcast | nccl_broadcast | cuda_ipc
    master_address: str                # trainer rank 0's node: it hosts the group's store
    master_port: int
    world_size: int
    timeout_s: float
    bucket_bytes: int
    metas: tuple[tuple[str, str, tuple[int, ...]], ...]   # (name, wire dtype, full shape): the sender's stream order
    check_unassigned: bool             # train.check_weight_update_equal: report parameters a sync did not assign
    rank_offset: int = 0               # this engine's first group rank
    aliases: dict[str, str] = field(default_factory=dict)  # vLLM: tied names the receiver adds (`tied_aliases`)

    def tensor_metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, d, tuple(s)) for n, d, s in self.metas]


class Transport(Protocol):
    """How buckets go from group rank 0 (the sender) to every other member. `send` and `receive` drive any of them:
    per sync `start`; the sender takes a `buffer` per bucket, fills it and `publish`es it (asynchronously; the
    handle's `wait` also gives the buffer back); a receiver `post`s the next bucket, `collect`s it (its bytes), loads
    them and `release`s it; `finish` ends the sync on either side."""

    def start(self, capacity: int, device: torch.device) -> None: ...
    def buffer(self, size: int, device: torch.device, bucket_bytes: int) -> torch.Tensor: ...
    def publish(self, buf: torch.Tensor, base: torch.Tensor) -> Any: ...
    def post(self, size: int, device: torch.device, bucket_bytes: int) -> Any: ...
    def collect(self, posted: Any) -> torch.Tensor: ...
    def release(self, posted: Any) -> None: ...
    def finish(self) -> None: ...


class Broadcast:
    """Buckets broadcast over a process group (gloo on CPU, NCCL on GPUs), in buffers of this process's pool; a
    receiver's next receive is posted before it loads the current bucket."""

    def __init__(self, group) -> None:
        self.group = group

    def start(self, capacity: int, device: torch.device) -> None:
        pass

    def buffer(self, size: int, device: torch.device, bucket_bytes: int) -> torch.Tensor:
        return POOL.take(size, device, at_least=bucket_bytes)

    def publish(self, buf: torch.Tensor, base: torch.Tensor) -> _Sent:
        return _Sent(broadcast_from_rank0(self.group, buf), base)

    def post(self, size: int, device: torch.device, bucket_bytes: int) -> tuple[Any, int, torch.Tensor]:
        base = POOL.take(size, device, at_least=bucket_bytes)
        return broadcast_from_rank0(self.group, base[:size]), size, base

    def collect(self, posted: tuple[Any, int, torch.Tensor]) -> torch.Tensor:
        work, size, base = posted
        work.wait()
        return base[:size]

    def release(self, posted: tuple[Any, int, torch.Tensor]) -> None:
        POOL.give(posted[2])  # handed out again only once the loader keeps no view of it

    def finish(self) -> None:
        pass


@dataclass
class _Sent:
    """A bucket in flight; its buffer goes back to the pool when it has left."""

    work: Any
    base: torch.Tensor

    def wait(self) -> None:
        self.work.wait()
        POOL.give(self.base)


def join_group(method: str, host: str, port: int, rank: int, world: int, timeout_s: float) -> Transport:
    """The weight-sync group's transport, independent of any default world; rank 0 hosts the store. `method` is the
    plan's `weight_sync.method`; `cuda_ipc` is a gloo group for the hand-shakes plus the CUDA IPC buckets (sender
    and receivers share one GPU)."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = PrefixStore("molt-weight-sync", TCPStore(host, port, world, is_master=rank == 0, timeout=timeout,
                                                     wait_for_workers=False))
    if method in ("gloo_broadcast", "cuda_ipc"):
        from torch.distributed import ProcessGroupGloo

        group = ProcessGroupGloo(store, rank, world, timeout)
        if method == "cuda_ipc":
            return IpcChannel(group)
        return Broadcast(group)
    if method == "nccl_broadcast":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return Broadcast(ProcessGroupNCCL(store, rank, world, opts))
    raise ValueError(f"unknown weight-sync method {method!r}")  # the plan allows gloo_broadcast|nccl_broadcast|cuda_ipc


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_SOLE_OWNER = _use_count(torch.empty(1))  # a tensor nothing else views (the probe itself adds one)


class BufferPool:
    """Byte buffers kept across buckets and syncs. A fresh large CPU allocation is mmap'ed and pays a page fault per
    4 KiB on first touch — measured here as the largest single cost of a sync (a 400 MiB copy into new memory took
    longer than broadcasting it). CUDA's caching allocator already reuses memory, so there the pool is a pass-through.
    A buffer given back may still be viewed by someone else (vLLM's layer-wise reload keeps the views of a layer's
    weights until the layer is complete, and a layer may straddle two buckets): it is handed out again only once
    nothing else views it, so a bucket that is held a little longer is not lost to the pool."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self._kept: list[torch.Tensor] = []

    def take(self, nbytes: int, device: torch.device, at_least: int = 0) -> torch.Tensor:
        """A byte buffer of `max(nbytes, at_least)` or more; use `[:nbytes]` of it."""
        if device.type == "cpu":
            for i, b in enumerate(self._kept):
                if b.numel() >= nbytes and _use_count(b) == _SOLE_OWNER:
                    return self._kept.pop(i)
        # Headroom over the bucket size: bucket sizes vary around it (a bucket closes before the tensor that would
        # overflow it), so one buffer fits most of them.
        return torch.empty(max(nbytes, at_least + at_least // 8), dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Keep `buf` for a later `take` (even if it is still viewed elsewhere); beyond `keep` buffers, drop it."""
        if buf.device.type != "cpu":
            return
        if len(self._kept) >= self.keep:  # full: make room by dropping a buffer nobody uses, else this one
            idle = next((i for i, b in enumerate(self._kept) if _use_count(b) == _SOLE_OWNER), None)
            if idle is None:
                return
            self._kept.pop(idle)
        self._kept.append(buf)


POOL = BufferPool()
"""This process's buffers (a trainer rank, an hf engine actor or a vLLM worker is one sender or receiver)."""


# ----------------------------------------------------------------------------------------------------- sender
class ShardGather:
    """Fills one bucket from the trainer's shards, each byte written once: rank 0 casts its own piece of every
    parameter into the bucket, every other rank sends its pieces (cast to the wire dtype; in the wire dtype
    already, the local shard itself, no copy) point to point and rank 0 receives them straight into their place in
    the bucket, or, for a piece that is not one run of the whole tensor (an expert's ep_shard columns), into a
    piece-sized buffer it then copies into place. Which rank holds which piece is `shard_layout`'s (FSDP2, HSDP,
    expert parallelism at any ep). No gather buffer and no reorder pass: the collective gather copied every byte
    twice more on rank 0 (gloo's flat temporary, then rank-major to full tensors), which on CPU cost more than the
    broadcast. Every rank must call it for every bucket, in order."""

    def __init__(self, sources: list[tuple[str, torch.Tensor]], metas: list[TensorMeta], gather_group, rank: int,
                 world: int, device: torch.device, bucket_bytes: int):
        self.params = [p for _, p in sources]
        if len(self.params) != len(metas):
            raise RuntimeError(f"weight sync: {len(self.params)} parameters, {len(metas)} declared")
        self.metas, self.group, self.rank, self.world, self.device = metas, gather_group, rank, world, device
        self.bucket_bytes = bucket_bytes
        self.dtype = getattr(torch, metas[0].dtype)
        self._sends: list = []  # a non-zero rank's sends in flight: (works, cast buffer, sent tensors)

    def _pieces(self, bucket: list[int]):
        """(index, this rank's piece in the engine layout or None when it sends none, every rank's boxes) of each
        parameter of the bucket."""
        for i in bucket:
            p = self.params[i]
            boxes = shard_layout.pieces(p, self.world)
            mine = next((b for b in boxes if b.rank == self.rank), None)
            if mine is None:
                yield i, None, boxes
                continue
            local = p.local() if hasattr(p, "local") else p.detach()  # an engine view, or the parameter
            local = local.to_local() if hasattr(local, "to_local") else local
            if tuple(local.shape) != mine.shape:
                raise RuntimeError(f"weight sync: {self.metas[i].name} piece is {tuple(local.shape)} here, its "
                                   f"placement makes it {mine.shape}")
            yield i, local, boxes

    @torch.no_grad()
    def __call__(self, bucket: list[int], buf: torch.Tensor | None) -> None:
        import torch.distributed as dist

        if self.rank != 0:
            self._send(bucket, dist)
            return
        scratch = None
        if buf is None:  # no engine to send to (no group): receive the other ranks' pieces all the same
            size = sum(self.metas[i].nbytes for i in bucket)
            scratch = POOL.take(size, self.device, at_least=self.bucket_bytes)
            buf = scratch[:size]
        recvs, owns, strided, at = [], [], [], 0
        for i, local, boxes in self._pieces(bucket):
            shape = self.metas[i].shape
            whole = buf[at:at + self.metas[i].nbytes].view(self.dtype)
            for box in boxes:
                if box.rank == 0:
                    owns.append((box.view(whole.view(shape)), local))
                    continue
                run = box.run(shape)
                if run is not None:
                    into = whole[run[0]:run[0] + run[1]]
                else:  # received whole, then copied into its strided place
                    into = torch.empty(box.shape, dtype=self.dtype, device=self.device)
                    strided.append((box.view(whole.view(shape)), into))
                # tag: the tensor's index, so each receive pairs with its send
                recvs.append(dist.P2POp(dist.irecv, into.view(-1).view(torch.uint8), group=self.group,
                                        group_peer=box.rank, tag=i))
            at += self.metas[i].nbytes
        works = dist.batch_isend_irecv(recvs) if recvs else []  # posted first: they arrive while rank 0 copies
        for place, local in owns:
            place.copy_(local)
        for w in works:
            w.wait()
        for place, piece in strided:
            place.copy_(piece)
        if scratch is not None:
            del buf
            POOL.give(scratch)

    def _send(self, bucket: list[int], dist) -> None:
        """A non-zero rank: send this rank's rows of each sharded parameter of the bucket to rank 0. The sends of
        the previous bucket are finished first, so at most two buckets' worth of cast shards are in flight."""
        self._finish_sends()
        esize = torch.empty((), dtype=self.dtype).element_size()
        pieces = [(i, local, local.numel() * esize) for i, local, _ in self._pieces(bucket) if local is not None]
        # a shard in the wire dtype on this device goes out as it is; others (cast, or on the host under
        # actor.offload: full) are copied into a device buffer first
        direct = lambda t: t.dtype == self.dtype and t.is_contiguous() and t.device == self.device  # noqa: E731
        cast = sum(k for _, local, k in pieces if not direct(local))
        base = POOL.take(cast, self.device, at_least=self.bucket_bytes) if cast else None
        sends, off = [], 0
        for i, local, k in pieces:
            if direct(local):
                out = local.reshape(-1)  # already in the wire dtype: the shard itself goes out
            else:
                assert base is not None  # sized for every piece that is not sent as it is
                out = base[off:off + k].view(self.dtype)
                out.copy_(local.reshape(-1))
                off += k
            # as bytes on both ends (rank 0 receives into its byte bucket; NCCL pairs dtype and count)
            sends.append(dist.P2POp(dist.isend, out.view(torch.uint8), group=self.group, group_peer=0, tag=i))
        # the sent tensors are kept alive until their sends are done (a LoRA-merged piece is a temporary)
        self._sends = [(dist.batch_isend_irecv(sends) if sends else [], base, [op.tensor for op in sends])]
        if bucket[-1] == len(self.metas) - 1:  # the last bucket of the sync: nothing may stay in flight
            self._finish_sends()

    def _finish_sends(self) -> None:
        for works, base, _ in self._sends:
            for w in works:
                w.wait()
            if base is not None:
                POOL.give(base)
        self._sends = []


def send_model(sources: list[tuple[str, torch.Tensor]], metas: list[TensorMeta], bucket_bytes: int,
               transport: Transport | None, device: torch.device, gather_group, rank: int, world: int) -> SyncStats:
    """Stream a model out of its shards (`sources`: its backend's `hf_weights`); `transport` is None on the ranks
    that only take part in the gather."""
    return send(ShardGather(sources, metas, gather_group, rank, world, device, bucket_bytes), metas, bucket_bytes,
                transport, device)


def send_tensors(tensors: Iterator[torch.Tensor], metas: list[TensorMeta], bucket_bytes: int, transport: Transport,
                 device: torch.device) -> SyncStats:
    """Stream full tensors (in `metas` order and dtype, produced lazily): a process that holds a whole model."""
    it = iter(tensors)

    def fill(bucket: list[int], buf: torch.Tensor | None) -> None:
        offset = 0
        for i in bucket:
            full = next(it)
            if tuple(full.shape) != metas[i].shape:
                raise RuntimeError(f"weight sync: {metas[i].name} has shape {tuple(full.shape)}, "
                                   f"declared {metas[i].shape}")
            n = metas[i].nbytes
            if buf is not None:
                buf[offset:offset + n].view(full.dtype).copy_(full.reshape(-1))
            offset += n

    return send(fill, metas, bucket_bytes, transport, device)


def send(fill: Callable[[list[int], torch.Tensor | None], None], metas: list[TensorMeta], bucket_bytes: int,
         transport: Transport | None, device: torch.device) -> SyncStats:
    """Fill each bucket (`fill(bucket, buffer)`) and publish it asynchronously, so that filling the next bucket
    overlaps sending this one. Without a transport this process only helps rank 0 gather (buffer None)."""
    stats = SyncStats()
    if transport is None:
        for bucket in bucket_layout(metas, bucket_bytes):
            t0 = time.perf_counter()
            fill(bucket, None)
            stats.gather_s += time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return stats
    layout = bucket_layout(metas, bucket_bytes)
    transport.start(_slot_bytes(metas, layout, bucket_bytes), device)
    pending = None  # the bucket in flight
    for bucket in layout:
        t0 = time.perf_counter()
        size = sum(metas[i].nbytes for i in bucket)
        base = transport.buffer(size, device, bucket_bytes)
        buf = base[:size]
        fill(bucket, buf)
        stats.gather_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if pending is not None:
            pending.wait()
        pending = transport.publish(buf, base)
        del buf
        stats.transfer_s += time.perf_counter() - t0
        stats.bytes += size
        stats.buckets += 1
    t0 = time.perf_counter()
    if pending is not None:
        pending.wait()
    transport.finish()
    stats.transfer_s += time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    return stats


def _slot_bytes(metas: list[TensorMeta], layout: list[list[int]], bucket_bytes: int) -> int:
    """An IPC slot holds the largest bucket plus the gather's padding headroom (as `BufferPool.take`)."""
    largest = max(sum(metas[i].nbytes for i in bucket) for bucket in layout)
    need = max(largest, bucket_bytes)
    return need + need // 8


# ----------------------------------------------------------------------------------------------------- receiver
def unpack(buf: torch.Tensor, metas: list[TensorMeta], bucket: list[int], aliases: dict[str, str]
           ) -> list[tuple[str, torch.Tensor]]:
    """Views into one received bucket, HF-named; `aliases` (target -> source) adds tied names."""
    out = []
    offset = 0
    for i in bucket:
        m = metas[i]
        t = buf[offset:offset + m.nbytes].view(getattr(torch, m.dtype)).view(m.shape)
        offset += m.nbytes
        out.append((m.name, t))
        out.extend((target, t) for target, source in aliases.items() if source == m.name)
    return out


def receive(transport: Transport, metas: list[TensorMeta], bucket_bytes: int, device: torch.device,
            load: Callable[[list[tuple[str, torch.Tensor]]], None], aliases: dict[str, str]) -> SyncStats:
    """Receive every bucket and hand it to `load` as it arrives, the next receive already posted."""
    stats = SyncStats()
    layout = bucket_layout(metas, bucket_bytes)
    sizes = [sum(metas[i].nbytes for i in bucket) for bucket in layout]
    transport.start(_slot_bytes(metas, layout, bucket_bytes), device)
    nxt = transport.post(sizes[0], device, bucket_bytes)
    for k, bucket in enumerate(layout):
        posted = nxt
        t0 = time.perf_counter()
        buf = transport.collect(posted)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        stats.transfer_s += time.perf_counter() - t0
        nxt = transport.post(sizes[k + 1], device, bucket_bytes) if k + 1 < len(layout) else None
        t0 = time.perf_counter()
        load(unpack(buf, metas, bucket, aliases))
        stats.load_s += time.perf_counter() - t0
        stats.bytes += buf.numel()
        stats.buckets += 1
        del buf
        transport.release(posted)
    t0 = time.perf_counter()
    transport.finish()
    stats.load_s += time.perf_counter() - t0
    return stats


def tied_aliases(metas: list[TensorMeta], tied: bool) -> dict[str, str]:
    """lm_head.weight -> the embedding, when tied and the trainer did not send it itself."""
    names = {m.name for m in metas}
    if not tied or LM_HEAD in names:
        return {}
    return next(({LM_HEAD: embed} for embed in (EMBED, VLM_EMBED) if embed in names), {})
