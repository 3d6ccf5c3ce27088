"""A separate reference or teacher (`ref.placement: separate`): its own FSDP2 group on its own devices, forward only.

One `ReferenceWorker` per rank (`runtime/ranks.py`) in the plan's `ref` role and placement group, `ref.world` ranks
(which may differ from the policy's). It loads `ref.path` (the KL reference, or the on-policy-distillation teacher,
which may be another checkpoint than the policy: same tokenizer, checked by the compiler) frozen, without
activation checkpointing, and returns log π_ref of every row, batched like the policy (the shared FSDP strategy:
micro-batches of `train.micro_batch_size` rows or of a token budget, padded or packed, at the rollout temperature).
A colocated reference lives in the policy ranks instead (`runtime/trainer.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from runtime import models, moe
from runtime.experience import Experience
from runtime.ranks import FsdpRank, gather_rows, start_ranks

if TYPE_CHECKING:
    from schemas.plan import ModelPlan, RefPlan, RlRuntime, TrainerPlan


def _ray():
    import ray

    return ray


class ReferenceWorker(FsdpRank):
    """One FSDP2 rank of the frozen reference / teacher."""

    def __init__(self, ref: RefPlan, trainer: TrainerPlan, model: ModelPlan, device: str, dist_backend: str,
                 rank: int, master_addr: str, master_port: int):
        """The plan's sections as they are: `ref` (path, world), `trainer` (the shared FSDP strategy: micro-batching,
        packing, temperature, seed), `model` (dtype, attention)."""
        super().__init__(ref.world, trainer.seed, device, dist_backend, rank, master_addr, master_port)
        self.t = trainer
        backend = models.backend(model)
        # the plan gives a separate reference no mesh of its own: data parallelism over its ranks
        self.model = backend.build(model, ref.path, backend.device_mesh(device, ref.world, None), self.device,
                                   trainable=False)
        self.image_token_id = getattr(self.model.config, "image_token_id", None)

    def ready(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @torch.no_grad()
    def forward_logprobs(self, batch: Experience) -> tuple[Tensor, Tensor]:
        """This rank's rows of `batch`: (their indices, (b, T-1) reference log-probs), zero past each row's end."""
        t = self.t
        rows, shard, lengths = self.shard(batch, balanced=t.dynamic_batch_max_tokens is not None)
        out = torch.zeros(shard.action_mask.shape)
        for mb, part in self.micro_parts(shard, lengths, range(shard.batch_size), t):
            with self._replay(part):
                lp, _ = self.logprobs(self.model, part, t.temperature, t.packing)
            if mb is not None:
                out[mb, :lp.shape[1]] = lp.cpu()
        return rows, out


    @contextlib.contextmanager
    def _replay(self, part: Experience):
        """R3 (`train.routing_replay`): the reference routes each token to the experts the rollout used, as the
        policy's ranks do (`runtime/trainer.py`)."""
        if not self.t.routing_replay:
            yield
            return
        if part.routed_experts is None:
            raise RuntimeError("train.routing_replay is on but the batch carries no routing: the engines returned "
                               "none (EnginesPlan.routed_experts)")
        with moe.replay(self.model) as state:
            state.targets = moe.flat_targets(part.routed_experts, part.attention_mask, self.t.packing)
            yield


@dataclass
class ReferenceGroup:
    """The driver's handle on the separate reference ranks."""

    workers: list  # list[ActorHandle[ReferenceWorker]]
    get: Callable[[list], list] | None = None  # how results are awaited (the driver's supervisor); None: ray.get

    def _get(self, refs: list) -> list:
        return (self.get or _ray().get)(refs)

    def forward_logprobs(self, batch_ref) -> Tensor:
        """(B, T-1) log π_ref of the whole batch, in batch order."""
        return gather_rows(self._get([w.forward_logprobs.remote(batch_ref) for w in self.workers]))

    def shutdown(self) -> None:
        _ray().get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            _ray().kill(w)


def start_reference_group(rl: RlRuntime, actor_options: list[dict], get: Callable | None = None) -> ReferenceGroup:
    """`rl.ref.world` ranks, one Ray actor each with `actor_options[r]` from the plan's `ref` role."""
    workers = start_ranks(ReferenceWorker, actor_options, lambda r, addr, port: (
        rl.ref, rl.trainer, rl.model, rl.device, rl.dist_backend, r, addr, port), get=get)
    return ReferenceGroup(workers=workers, get=get)
