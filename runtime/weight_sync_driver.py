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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray

from runtime.weight_sync import JoinMessage

if TYPE_CHECKING:
    from runtime.trainer import TrainerGroup
    from schemas.plan import WeightSyncPlan

logger = logging.getLogger(__name__)

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
        join = JoinMessage(p.method, host, p.master_port or free, p.world_size, float(p.timeout_s), p.bucket_bytes,
                           tuple((n, d, tuple(s)) for n, d, s in metas), self.check_unassigned)
        self.get([rank0.open_weight_sync.remote(join.method, host, join.master_port, p.world_size, join.timeout_s)]
                 + [e.join_weight_sync.remote(replace(join, rank_offset=off))
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
