"""What every FSDP2 rank of every model group shares: the policy (`runtime/trainer.py`), the critic
(`runtime/critic.py`) and a separate reference or teacher (`runtime/reference.py`).

A group is one Ray actor per rank in one torch.distributed world of its own (gloo on CPU, NCCL on GPUs; rank 0's
node is the master). The driver hands every rank the same object-store batch; each rank takes its rows
(`runtime/microbatch.py`: a contiguous slice, or length-balanced rows under dynamic batching), runs them in
micro-batches of fixed rows or of a token budget (every rank runs the maximum count over ranks, empty fillers
included, because each FSDP forward is a collective), and returns their indices with its per-token results, which
`gather_rows` puts back in batch order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from runtime import microbatch
from runtime.experience import Experience
from runtime.logprobs import token_top_logprobs, vision_inputs
from runtime.node_address import node_ip_and_port
from schemas.plan import TrainerPlan
from schemas.ports import free_port as free_port  # re-exported: the trainer and the tests' rank worlds pick ports here


def _ray():
    """Ray, imported on first use: a rank itself needs only torch, so it also runs under torchrun (GPU checks)."""
    import ray

    return ray


class FsdpRank:
    """One rank of a model group: joins the group's world and cuts batches (its model's backend builds the device
    meshes, `runtime/models/`)."""

    def __init__(self, world: int, seed: int, device: str, dist_backend: str, rank: int, master_addr: str,
                 master_port: int):
        self.world, self.rank = world, rank
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK="0")
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        dist.init_process_group(dist_backend, rank=rank, world_size=world)
        torch.manual_seed(seed)
        # VLM: the image placeholder id feeds the backbone's M-RoPE token types (a fact of the checkpoint; a
        # subclass sets it from its model's config once built).
        self.image_token_id: int | None = None
        # Data parallelism over every rank; a group under context or tensor parallelism sets these from its meshes
        # (`use_meshes`).
        self.dp, self.dp_rank, self.cp, self.cp_mesh = world, rank, 1, None
        self.tp, self.tp_rank = 1, 0

    def use_meshes(self, cp_mesh, tp_mesh, dp: int) -> None:
        """Context parallelism over `cp_mesh` and tensor parallelism over `tp_mesh` (None: none; both None: data
        parallelism over every rank): the cp x tp ranks of one of the plan's `dp` data-parallel ranks take the same
        rows (consecutive ranks: tp is nemo-automodel's innermost mesh axis, cp the next; checked,
        `context_parallel.dp_rank`); each cp rank runs its cut of their positions, which its tp ranks share
        (`runtime/context_parallel.py`). Their token counts and statistics are their first rank's (`replicas`,
        `leads_rows`)."""
        from runtime import context_parallel

        if cp_mesh is None and tp_mesh is None:
            return
        self.cp_mesh, self.cp = cp_mesh, 1 if cp_mesh is None else cp_mesh.size()
        self.tp, self.tp_rank = (1, 0) if tp_mesh is None else (tp_mesh.size(), tp_mesh.get_local_rank())
        self.dp, self.dp_rank = dp, context_parallel.dp_rank(self.rank, cp_mesh, tp_mesh)

    @property
    def replicas(self) -> int:
        """Consecutive ranks that take the same rows: a data-parallel rank's cp x tp ranks."""
        return self.cp * self.tp

    @property
    def leads_rows(self) -> bool:
        """The first of its data-parallel rank's cp x tp ranks: the one that returns their rows (`gather_rows` takes
        each row once) and counts their tokens."""
        cp_rank = 0 if self.cp_mesh is None else self.cp_mesh.get_local_rank()
        return cp_rank == 0 and self.tp_rank == 0

    def cp_rows(self, part: Experience, model=None, packed: bool = False):
        """The block a micro-batch's forward and backward run in: its context-parallel shard (or None); `packed`:
        its rows as one packed row cut by `model`'s own CP."""
        from runtime import context_parallel

        if self.cp_mesh is None:
            return contextlib.nullcontext()
        return context_parallel.sharded_rows(self.cp_mesh, part.sequences.to(self.device),
                                             part.attention_mask.to(self.device), model, packed)

    def logprobs(self, model, part: Experience, temperature: float, packed: bool, with_entropy: bool = False,
                 cp=None):
        """`token_logprobs` of one micro-batch on this rank's device; a VLM's image inputs ride along on every
        micro-batch, images or not (the same code path on all ranks). `cp`: its `cp_rows`."""
        return self.top_logprobs(model, part, temperature, packed, with_entropy, with_top=False, cp=cp)[:2]

    def top_logprobs(self, model, part: Experience, temperature: float, packed: bool, with_entropy: bool = False,
                     with_top: bool = True, cp=None):
        """`logprobs`, plus the (b, w-1, k) log-probs of the batch's sampler top-k ids (`rollout_top_ids`, score
        centering) from the same chunked forward when `with_top`."""
        vision = None
        if self.image_token_id is not None:
            vision = vision_inputs(part.mm_inputs or [None] * part.batch_size, part.sequences.to(self.device),
                                   self.image_token_id, self.device)
        top_ids = part.rollout_top_ids.to(self.device) if with_top else None
        return token_top_logprobs(model, part.sequences.to(self.device), part.attention_mask.to(self.device),
                                  temperature, top_ids, with_entropy=with_entropy, packed=packed, vision=vision,
                                  cp=cp)

    def shard(self, batch: Experience, balanced: bool) -> tuple[torch.Tensor, Experience, torch.Tensor]:
        """This rank's row indices into `batch`, those rows, and their token lengths: its data-parallel rank's
        (every cp rank of it takes the same)."""
        lengths = batch.attention_mask.sum(-1)
        rows = microbatch.rank_rows(lengths, self.dp, balanced=balanced)[self.dp_rank]
        return rows, batch.select(rows), lengths[rows]

    def same_count(self, batches: list[list[int]]) -> list[list[int] | None]:
        """Pad to the largest micro-batch count over ranks: every FSDP rank must run as many forwards."""
        count = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return microbatch.pad_to(batches, int(count.item()))

    @staticmethod
    def part(shard: Experience, positions: list[int] | None, width_multiple: int) -> Experience:
        """Rows of one micro-batch, cut to its longest row rounded up to `width_multiple`; None: a one-row filler
        that trains on nothing."""
        if positions is None:
            part = shard.select(torch.zeros(1, dtype=torch.long))
            part.action_mask = torch.zeros_like(part.action_mask)
        else:
            part = shard.select(torch.tensor(positions, dtype=torch.long))
        return part.trim(width_multiple)

    def micro_parts(self, shard: Experience, lengths: torch.Tensor, window: range, t: TrainerPlan
                    ) -> Iterator[tuple[list[int] | None, Experience]]:
        """(positions or None, rows) of each micro-batch of `window` (`t`'s micro-batch size, grouped by length where
        `t.micro_batches_by_length`, or its token budget), the same count on every rank. `t` is the plan's trainer
        section for the policy, the reference and the critic alike (their micro-batches are the policy's)."""
        for mb in self.same_count(microbatch.micro_batches(window, lengths, t.micro_batch_size,
                                                          t.dynamic_batch_max_tokens, t.micro_batches_by_length)):
            yield mb, self.part(shard, mb, t.width_multiple)

    def window_tokens(self, shard: Experience, window: range) -> float:
        """Action tokens of this optimizer-step window on every data-parallel rank (one all-reduce): the
        global-token-mean normaliser (`runtime/algo/losses.py`)."""
        total = torch.tensor([float(shard.action_mask[window.start:window.stop].sum())], device=self.device)
        dist.all_reduce(total)  # NCCL reduces device tensors only
        return float(total.item()) / self.replicas  # the cp x tp ranks of a data-parallel rank hold the same rows

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def gather_rows(outs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-rank (row indices, (b, T-1) values) -> the whole batch's (B, T-1), in batch order (each row from one rank:
    the ones that `leads_rows`)."""
    rows = torch.cat([r for r, _ in outs])
    if rows.unique().numel() != rows.numel():
        raise RuntimeError("ranks returned the same rows twice: the replicas of a data-parallel rank must not")
    full = torch.empty((rows.numel(), outs[0][1].shape[1]))
    full[rows] = torch.cat([v for _, v in outs])
    return full


def start_ranks(worker_cls: type, actor_options: list[dict], make_args: Callable[[int, str, int], tuple],
                get: Callable[[list], list] | None = None) -> list:
    """One Ray actor per rank (`actor_options[r]` from the plan's role), each built with `make_args(rank, master
    address, master port)`; waits until every rank is built (`ready`) through `get` (the driver's supervisor, which
    notices a rank that dies while building; None: ray.get). Rank 0's node IP plus a free port on that node is the
    group's torch.distributed master."""
    remote_cls = _ray().remote(worker_cls)
    probe = _ray().remote(num_cpus=0)(node_ip_and_port)
    addr, port = _ray().get(probe.options(**_placement_only(actor_options[0])).remote())
    workers = [remote_cls.options(**opts).remote(*make_args(r, addr, port)) for r, opts in enumerate(actor_options)]
    (get or _ray().get)([w.ready.remote() for w in workers])
    return workers


def _placement_only(options: dict) -> dict:
    return {k: v for k, v in options.items() if k == "scheduling_strategy"}
