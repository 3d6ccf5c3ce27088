"""The driver's side of the weight sync: forms the group once, then runs one streamed sync per step.

The group (`plan.rl.weight_sync`) is trainer rank 0 plus every engine worker; trainer rank 0 hosts its store on its
own node. Per sync every trainer rank runs `send_weights` (all ranks gather, rank 0 broadcasts) while every engine
runs `receive_weights`, all at once: the gathers, the broadcasts and the engines' loads overlap bucket by bucket.
Nothing goes through the Ray object store; the driver sees only the numbers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    from runtime.trainer import TrainerGroup
    from schemas.plan import WeightSyncPlan

logger = logging.getLogger(__name__)

_TRANSPORT = {"gloo_broadcast": "gloo", "nccl_broadcast": "nccl", "cuda_ipc": "cuda_ipc"}


@dataclass
class WeightSyncLink:
    plan: WeightSyncPlan
    dtype: str              # the engines' dtype: what crosses the wire
    trainer: TrainerGroup
    engines: list[Any]      # engine actor handles, engine i at plan.engine_rank_offsets[i]
    check_unassigned: bool  # train.check_weight_update_equal: each engine reports the parameters a sync left out
    get: Callable[[list], list] = ray.get  # how results are awaited (the driver's supervisor)

    def connect(self) -> None:
        """Form the group: trainer rank 0 and every engine worker rendezvous (blocks until all have joined)."""
        p = self.plan
        rank0 = self.trainer.workers[0]
        metas = self.get(rank0.weight_sync_metas.remote(self.dtype))
        host, free = self.get(rank0.weight_sync_address.remote())
        port = p.master_port or free
        backend = _TRANSPORT[p.method]
        init = {"backend": backend, "master_address": host, "master_port": port, "world_size": p.world_size,
                "timeout_s": float(p.timeout_s), "bucket_bytes": p.bucket_bytes,
                "metas": [[n, d, list(s)] for n, d, s in metas], "check_unassigned": self.check_unassigned}
        self.get([rank0.open_weight_sync.remote(backend, host, port, p.world_size, float(p.timeout_s))]
                + [e.join_weight_sync.remote({**init, "rank_offset": off})
                   for e, off in zip(self.engines, p.engine_rank_offsets, strict=True)])

    def sync(self, version: int) -> dict[str, float]:
        """One streamed sync (engines must be paused); returns its timings and throughput."""
        t0 = time.perf_counter()
        sends = [w.send_weights.remote(self.dtype, self.plan.bucket_bytes) for w in self.trainer.workers]
        receives = [e.receive_weights.remote(version) for e in self.engines]
        out = self.get(sends + receives)
        wall = time.perf_counter() - t0
        sender, received = out[0], out[len(sends):]
        if any(r["bytes"] != sender["bytes"] for r in received):
            raise RuntimeError(f"weight sync: rank 0 sent {sender['bytes']} bytes, engines received "
                               f"{[r['bytes'] for r in received]}")
        checked = {"weight_sync/unassigned_params": float(report_unassigned(received))} if self.check_unassigned else {}
        return {
            **checked,
            "timing/weight_sync": wall,
            "timing/weight_sync_gather": sender["gather_s"],
            "timing/weight_sync_transfer": max([sender["transfer_s"], *(r["transfer_s"] for r in received)]),
            "timing/weight_sync_load": max(r["load_s"] for r in received),
            "weight_sync/bytes": sender["bytes"],
            "weight_sync/buckets": sender["buckets"],
            "weight_sync/gb_per_s": sender["bytes"] / wall / 1e9,
        }


def report_unassigned(received: list[dict[str, Any]], shown: int = 5) -> int:
    """The check of `train.check_weight_update_equal` (Molt reports, it does not stop): warn with the first few
    parameters each engine's sync left unassigned; returns the most any engine left out."""
    for i, r in enumerate(received):
        if r["unassigned"]:
            logger.warning("weight sync: engine %d has %d parameters this sync did not assign: %s%s", i,
                           len(r["unassigned"]), ", ".join(r["unassigned"][:shown]),
                           ", ..." if len(r["unassigned"]) > shown else "")
    return max(len(r["unassigned"]) for r in received)


class StateDictSender:
    """The calling process as group rank 0, streaming a plain state dict to engines (engine tests and benchmarks,
    where no trainer exists); the same protocol and engine code as the trainer's sync."""

    def __init__(self, engines: list[Any], names_shapes: dict[str, tuple[int, ...]], dtype: str, bucket_bytes: int,
                 backend: str = "gloo", per_engine: int = 1, timeout_s: float = 120.0, check_unassigned: bool = False):
        import threading

        from runtime import weight_sync
        from runtime.trainer import free_port

        self.engines, self.bucket_bytes = engines, bucket_bytes
        self.metas = [weight_sync.TensorMeta(n, dtype, tuple(s)) for n, s in names_shapes.items()]
        world = 1 + per_engine * len(engines)
        port = free_port()
        init = {"backend": backend, "master_address": "127.0.0.1", "master_port": port, "world_size": world,
                "timeout_s": timeout_s, "bucket_bytes": bucket_bytes,
                "metas": [[m.name, m.dtype, list(m.shape)] for m in self.metas], "check_unassigned": check_unassigned}
        joined = [e.join_weight_sync.remote({**init, "rank_offset": 1 + i * per_engine})
                  for i, e in enumerate(engines)]
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(
            group=weight_sync.join_group(backend, "127.0.0.1", port, 0, world, timeout_s)))
        t.start()
        ray.get(joined)
        t.join()
        self.group = box["group"]

    def push(self, state: dict[str, Any], version: int) -> dict[str, float]:
        """Send `state` (every declared name, any dtype: cast to the wire dtype here); return the engines' stats."""
        import threading

        import torch

        from runtime import weight_sync

        receives = [e.receive_weights.remote(version) for e in self.engines]
        tensors = (state[m.name].detach().to(getattr(torch, m.dtype)) for m in self.metas)
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(stats=weight_sync.send_tensors(
            tensors, self.metas, self.bucket_bytes, self.group, torch.device("cpu"))))
        t.start()
        out = ray.get(receives)
        t.join()
        return {"sent": box["stats"].as_dict(), "received": out}
