"""A test-only weight-sync sender: the calling process as group rank 0, streaming a plain state dict to engines (the
engine tests and `tests/bench_engines.py`, where no trainer exists), through the same protocol and engine code as the
trainer's sync (`runtime.weight_sync`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import ray


class StateDictSender:
    """The calling process as group rank 0, streaming a plain state dict to engines (engine tests and benchmarks,
    where no trainer exists); the same protocol and engine code as the trainer's sync."""

    def __init__(self, engines: list[Any], names_shapes: dict[str, tuple[int, ...]], dtype: str, bucket_bytes: int,
                 method: str = "gloo_broadcast", per_engine: int = 1, timeout_s: float = 120.0, check_unassigned: bool = False):
        import threading

        from runtime import weight_sync
        from runtime.trainer import free_port

        self.engines, self.bucket_bytes = engines, bucket_bytes
        self.metas = [weight_sync.TensorMeta(n, dtype, tuple(s)) for n, s in names_shapes.items()]
        world = 1 + per_engine * len(engines)
        port = free_port()
        join = weight_sync.JoinMessage(method, "127.0.0.1", port, world, timeout_s, bucket_bytes,
                                       tuple((m.name, m.dtype, m.shape) for m in self.metas), check_unassigned)
        joined = [e.join_weight_sync.remote(replace(join, rank_offset=1 + i * per_engine))
                  for i, e in enumerate(engines)]
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(
            group=weight_sync.join_group(method, "127.0.0.1", port, 0, world, timeout_s)))
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
