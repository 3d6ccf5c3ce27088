"""The FSDP2 actor group: one Ray actor per rank, a policy model sharded with `fully_shard`, and its frozen reference.

Each `PolicyWorker` joins one torch.distributed world (gloo on CPU, NCCL on GPUs; rank 0's node is the master),
shards every decoder layer and then the root (`reference/environment.md` §5), and owns the optimizer and scheduler.
The driver (`runtime/loop.py`) calls every rank with the same object-store batch and hands each rank the plan's
sections unchanged (`TrainerPlan`, `ModelPlan`, `RefPlan`, `AlgoPlan`). Each rank takes its rows (`runtime/microbatch.py`:
a contiguous slice, or length-balanced rows under dynamic batching) and returns their indices with their log-probs.

Micro-batches are `micro_batch_size` rows, or rows of at most `dynamic_batch_max_tokens` tokens; every rank runs the
maximum count over ranks (empty fillers), because each FSDP forward is a collective. Each micro-batch is cut to its
longest row, and with `packing` its rows run as one packed row (`runtime/logprobs.py`): no padding token is computed.

Loss aggregation is Molt's global token mean (`reference/molt_rules.md` §6.4): inside an optimizer-step window,
each rank sums its per-token losses and divides by the action-token count of the *whole* window (all micro-batches
of all ranks, one all-reduce), times the dp size because FSDP averages gradients over ranks. The backward is not
rescaled by the accumulation count.

What this module does not know: rollouts, engines, queues. It takes tensors and returns tensors and numbers.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from runtime import fsdp, microbatch, models, moe
from runtime.experience import Experience
from runtime.logprobs import token_logprobs, vision_inputs

if TYPE_CHECKING:

    from schemas.plan import AlgoPlan, ModelPlan, RefPlan, RlRuntime, TrainerPlan


def _ray():
    """Ray, imported on first use: a rank itself needs only torch, so it also runs under torchrun (GPU checks)."""
    import ray

    return ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------- worker
class PolicyWorker:
    """One FSDP2 rank: the policy (trained) and, when the plan has one, the reference (frozen, same process)."""

    def __init__(self, trainer: TrainerPlan, model: ModelPlan, ref: RefPlan | None, algo: AlgoPlan, device: str,
                 dist_backend: str, rank: int, master_addr: str, master_port: int):
        """The plan's sections as they are: `trainer` (batching, optimizer, loss), `model` (path, dtype, attention,
        checkpointing), `ref` (None: no reference model), `algo` (KL estimator, IS correction)."""
        self.t, self.model_plan, self.algo, self.rank = trainer, model, algo, rank
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(trainer.world), LOCAL_RANK="0")
        self.device = torch.device(device if device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        dist.init_process_group(dist_backend, rank=rank, world_size=trainer.world)
        torch.manual_seed(trainer.seed)
        backend = models.backend(model.backend)
        self.mesh = backend.device_mesh(device, trainer.world)
        self.model = backend.build(model, model.path, self.mesh, self.device, trainable=True,
                                   freeze_router=trainer.freeze_moe_router, lora=trainer.lora,
                                   freeze_visual_encoder=trainer.freeze_visual_encoder)
        # VLM: the image placeholder id feeds the backbone's M-RoPE token types (a fact of the checkpoint).
        self.image_token_id = getattr(self.model.config, "image_token_id", None)
        self.ref = backend.build(model, ref.path, self.mesh, self.device, trainable=False) if ref else None
        self.optimizer, self.scheduler = fsdp.build_optimizer(trainer.optimizer, self.model)
        # Aux losses whenever the model routes (reported as metrics; in the loss at the plan's coefficients).
        self.aux = moe.is_moe(self.model)
        self.top_k = moe.shape_of(self.model)[1]

    def ready(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------------------------------------- batching
    def _shard(self, batch: Experience) -> tuple[torch.Tensor, Experience, torch.Tensor]:
        """This rank's row indices into `batch`, those rows, and their token lengths."""
        lengths = batch.attention_mask.sum(-1)
        rows = microbatch.rank_rows(lengths, self.t.world, balanced=self.t.dynamic_batch_max_tokens is not None)
        rows = rows[self.rank]
        return rows, batch.select(rows), lengths[rows]

    def _same_count(self, batches: list[list[int]]) -> list[list[int] | None]:
        """Pad to the largest micro-batch count over ranks: every FSDP rank must run as many forwards."""
        count = torch.tensor([len(batches)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return microbatch.pad_to(batches, int(count.item()))

    @staticmethod
    def _part(shard: Experience, positions: list[int] | None) -> Experience:
        """Rows of one micro-batch, cut to its longest row; None: a one-row filler that trains on nothing."""
        if positions is None:
            part = shard.select(torch.zeros(1, dtype=torch.long))
            part.action_mask = torch.zeros_like(part.action_mask)
        else:
            part = shard.select(torch.tensor(positions, dtype=torch.long))
        return part.trim()

    def _logprobs(self, model, part: Experience, with_entropy: bool = False):
        vision = None
        if self.image_token_id is not None:  # every VLM micro-batch, images or not (same code path on all ranks)
            vision = vision_inputs(part.mm_inputs or [None] * part.batch_size, part.sequences.to(self.device),
                                   self.image_token_id, self.device)
        return token_logprobs(model, part.sequences.to(self.device), part.attention_mask.to(self.device),
                              self.t.temperature, with_entropy=with_entropy, packed=self.t.packing, vision=vision)

    @contextlib.contextmanager
    def _routing(self, model, part: Experience, aux: bool = False):
        """Around a forward (and its backward: checkpointed layers re-route when recomputed): R3 replay of the
        rollout's routing when the plan says so, and the router logits for the aux losses when `aux`."""
        with contextlib.ExitStack() as stack:
            if self.t.routing_replay:
                if part.routed_experts is None:
                    raise RuntimeError("train.routing_replay is on but the batch carries no routing: the engines "
                                       "returned none (EnginesPlan.routed_experts)")
                state = stack.enter_context(moe.replay(model))
                state.targets = moe.flat_targets(part.routed_experts, part.attention_mask, self.t.packing)
                self._replay_state = state
            yield stack.enter_context(moe.collect_logits(model)) if aux else None

    # ----------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def forward_logprobs(self, batch: Experience) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of `batch`: (their indices, old log-probs of the current policy, reference log-probs or
        None), each (b, T-1), zero past each row's end."""
        t = self.t
        rows, shard, lengths = self._shard(batch)
        old = torch.zeros(shard.action_mask.shape)
        ref = torch.zeros(shard.action_mask.shape) if self.ref is not None else None
        whole = range(shard.batch_size)
        for mb in self._same_count(microbatch.micro_batches(whole, lengths, t.micro_batch_size,
                                                            t.dynamic_batch_max_tokens)):
            part = self._part(shard, mb)
            width = part.action_mask.shape[1]
            with self._routing(self.model, part):
                lp = self._logprobs(self.model, part)[0].cpu()
            if mb is not None:
                old[mb, :width] = lp
            if self.ref is not None:
                with self._routing(self.ref, part):
                    lp_ref = self._logprobs(self.ref, part)[0].cpu()
                if mb is not None:
                    ref[mb, :width] = lp_ref
        return rows, old, ref

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of a fixed sequence under the current weights at temperature 1, as the engines' `score`
        (every rank must call: FSDP all-gathers)."""
        seq = torch.tensor([token_ids], device=self.device)
        lp, _ = token_logprobs(self.model, seq, torch.ones_like(seq, dtype=torch.bool), 1.0)
        return lp[0].cpu().tolist()

    # ----------------------------------------------------------------------------------------------- train
    def train(self, batch: Experience, kl_coef: float) -> dict[str, float]:
        """max_epochs passes over this rank's rows, one optimizer step per window (micro_batch * grad_accum rows, or
        the plan's local batch under dynamic batching), its micro-batches of fixed rows or of a token budget.

        Returns sums over this rank's micro-batches (token-weighted means are formed by the driver) plus rank-level
        scalars (lr, grad norm, optimizer steps).
        """
        t = self.t
        _, shard, lengths = self._shard(batch)
        step_rows = t.micro_batch_size * t.grad_accum if t.dynamic_batch_max_tokens is None else t.local_batch_size
        sums: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        for _ in range(t.max_epochs):
            for window in microbatch.windows(shard.batch_size, step_rows):
                # Global-token-mean normaliser: action tokens of this window on every rank (one all-reduce).
                total = torch.tensor([float(shard.action_mask[window.start:window.stop].sum())],
                                     device=self.device)  # NCCL reduces device tensors only
                dist.all_reduce(total)
                stats = self._window_stats(shard, window)
                mbs = self._same_count(microbatch.micro_batches(window, lengths, t.micro_batch_size,
                                                                t.dynamic_batch_max_tokens))
                for mb in mbs:
                    for k, v in self._micro_step(self._part(shard, mb), total.item(), kl_coef, len(mbs),
                                                 stats).items():
                        sums[k] = sums.get(k, 0.0) + v
                grad_norms.append(self._optimizer_step())
        sums["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        sums["optimizer_steps"] = float(len(grad_norms))
        sums["lr"] = self.scheduler.get_last_lr()[0]
        return sums

    def _window_stats(self, shard: Experience, window: range):
        """The window's denominators of `loss.agg_mode`, summed over every rank (None under token-mean, which uses
        the all-reduced token count alone)."""
        from runtime.algo import aggregation

        if self.t.loss.agg_mode == "token-mean":
            return None
        rows = slice(window.start, window.stop)
        local = aggregation.window_stats(shard.action_mask[rows], shard.group_ids[rows])
        parts: list = [None] * self.t.world
        dist.all_gather_object(parts, local)
        return aggregation.merge(parts)

    def _micro_step(self, part: Experience, global_tokens: float, kl_coef: float, micro_batches: int,
                    window=None) -> dict[str, float]:
        with self._routing(self.model, part, aux=self.aux) as router_logits:
            return self._micro_step_in(part, global_tokens, kl_coef, micro_batches, window, router_logits)

    def _micro_step_in(self, part: Experience, global_tokens: float, kl_coef: float, micro_batches: int, window,
                       router_logits) -> dict[str, float]:
        from runtime import algo
        from runtime.algo import aggregation, mismatch

        ls, isc, kl = self.t.loss, self.algo.is_correction, self.algo.kl
        dev = self.device
        mask = part.action_mask.to(dev)
        logp, entropy = self._logprobs(self.model, part, with_entropy=ls.entropy_coef != 0)
        old = part.old_log_probs.to(dev)
        rollout_lp = part.rollout_log_probs.to(dev)
        is_out = algo.is_correction(old, rollout_lp, mask, level=isc.level, mode=isc.mode, low=isc.low,
                                    high=isc.high, gating=isc.gating)
        use_kl_loss = kl.use_loss and part.ref_log_probs is not None
        weights = None if window is None else aggregation.row_weights(ls.agg_mode, part.action_mask,
                                                                      part.group_ids, window).to(dev)
        out = algo.actor_loss(
            logp, old, part.advantages.to(dev), mask, mode=ls.mode, clip_low=ls.clip_low, clip_high=ls.clip_high,
            global_num_tokens=global_tokens, dp_size=self.t.world, dual_clip=ls.dual_clip,
            is_coef=None if isc.level == "off" else is_out.coef,
            ref_log_probs=part.ref_log_probs.to(dev) if use_kl_loss else None,
            kl_coef=kl_coef if use_kl_loss else 0.0, kl_estimator=kl.estimator, kl_ref=kl.ref,
            entropy=entropy, entropy_coef=ls.entropy_coef, row_weights=weights)
        loss, moe_stats = out.loss, {}
        if router_logits is not None:
            # Molt B32: coef * aux / micro-batches, so a window adds its micro-batches' mean; a filler adds 0.
            real = part.attention_mask.to(dev).reshape(-1) if not self.t.packing else None
            real = torch.ones(router_logits.logits[0].shape[0], device=dev) if real is None else real
            weight = (1.0 if bool(mask.any()) else 0.0) / micro_batches
            balance = moe.load_balancing_loss(router_logits.logits, self.top_k, real)
            z = moe.z_loss(router_logits.logits, real)
            loss = loss + weight * (ls.aux_loss_coef * balance + ls.router_z_loss_coef * z)
            moe_stats = {"moe/load_balancing_loss": balance.item(), "moe/router_z_loss": z.item()}
        loss.backward()
        if self.t.routing_replay:  # how often the trainer's own top-k matched the engine's (1: replay changed nothing)
            state = self._replay_state
            moe_stats["moe/router_agreement"] = state.agreed / max(state.known, 1)
        # Per-micro-batch means, weighted by its action tokens so the driver can form batch-level token means.
        tokens = float(mask.sum())
        stats = {f"{k}_x_tokens": float(v) * tokens for k, v in {**out.metrics, **moe_stats}.items()}
        stats["is_filter_ratio_x_tokens"] = float(is_out.is_filter_ratio) * tokens
        stats["vllm_kl_x_tokens"] = float(is_out.vllm_kl) * tokens
        if tokens:
            stats.update({f"{k}_x_tokens": v * tokens
                          for k, v in mismatch.mismatch_metrics(logp.detach(), rollout_lp, mask).items()})
        stats["tokens"] = tokens
        return stats

    def _optimizer_step(self) -> float:
        grad_norm = fsdp.clipped_step(self.model, self.optimizer, self.scheduler, self.t.optimizer.max_norm)
        return grad_norm

    # ----------------------------------------------------------------------------------------------- weights
    def weight_sync_metas(self, dtype: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """What `send_weights` streams (names, wire dtype, full shapes), read from the shards without a gather."""
        from runtime import weight_sync

        return [(m.name, m.dtype, m.shape) for m in weight_sync.wire_metas(self.model, dtype)]

    def weight_sync_address(self) -> tuple[str, int]:
        """This node's IP and a free port for the weight-sync store (rank 0 hosts it)."""
        return _ray().util.get_node_ip_address(), free_port()

    def open_weight_sync(self, backend: str, host: str, port: int, world: int, timeout_s: float) -> None:
        """Rank 0 only: host the weight-sync store and join the group as its rank 0 (blocks until all joined)."""
        from runtime import weight_sync

        self._sync_group = weight_sync.join_group(backend, host, port, 0, world, timeout_s)

    def send_weights(self, dtype: str, bucket_bytes: int) -> dict[str, float]:
        """Every rank must call this (rank 0 gathers the shards bucket by bucket); rank 0 broadcasts the buckets."""
        from runtime import weight_sync

        metas = weight_sync.wire_metas(self.model, dtype)
        group = getattr(self, "_sync_group", None) if self.rank == 0 else None
        return weight_sync.send_model(self.model, metas, bucket_bytes, group, self.device, self.mesh.get_group(),
                                      self.rank, self.t.world).as_dict()

    def save_checkpoint(self, path: str) -> None:
        from runtime.ckpt import save_sharded

        save_sharded(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: str) -> None:
        from runtime.ckpt import load_sharded

        load_sharded(path, self.model, self.optimizer, self.scheduler)

    def export_hf(self, out_dir: str) -> str | None:
        from runtime.ckpt import export_hf

        return export_hf(out_dir, self.model, self.model_plan.path, self.rank)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- group
@dataclass
class TrainerGroup:
    """The driver's handle on the ranks. Calls are direct (`w.train.remote(...)`), never dispatched by name."""

    workers: list  # list[ActorHandle[PolicyWorker]]
    world: int
    get: Callable[[list], list] | None = None  # how results are awaited (the driver's supervisor); None: ray.get

    def _get(self, refs: list) -> list:
        return (self.get or _ray().get)(refs)

    def forward_logprobs(self, batch_ref) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(old, ref or None) log-probs of the whole batch, (B, T-1) in batch order (ranks return their rows)."""
        outs = self._get([w.forward_logprobs.remote(batch_ref) for w in self.workers])
        rows = torch.cat([r for r, _, _ in outs])
        old = torch.empty((rows.numel(), outs[0][1].shape[1]))
        old[rows] = torch.cat([o for _, o, _ in outs])
        if outs[0][2] is None:
            return old, None
        ref = torch.empty_like(old)
        ref[rows] = torch.cat([r for _, _, r in outs])
        return old, ref

    def train(self, batch_ref, kl_coef: float) -> dict[str, float]:
        """Run the step on every rank; return token-weighted means over all ranks (lr, grad norm: rank 0's)."""
        outs = self._get([w.train.remote(batch_ref, kl_coef) for w in self.workers])
        tokens = max(sum(o["tokens"] for o in outs), 1.0)
        means = {k.removesuffix("_x_tokens"): sum(o.get(k, 0.0) for o in outs) / tokens
                 for k in outs[0] if k.endswith("_x_tokens")}
        means.update(tokens=tokens, lr=outs[0]["lr"], grad_norm=outs[0]["grad_norm"],
                     optimizer_steps=outs[0]["optimizer_steps"])
        return means

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return self._get([w.probe_logprobs.remote(token_ids) for w in self.workers])[0]

    def save_checkpoint(self, path: str) -> None:
        self._get([w.save_checkpoint.remote(path) for w in self.workers])

    def load_checkpoint(self, path: str) -> None:
        self._get([w.load_checkpoint.remote(path) for w in self.workers])

    def export_hf(self, out_dir: str) -> str | None:
        return self._get([w.export_hf.remote(out_dir) for w in self.workers])[0]

    def shutdown(self) -> None:
        _ray().get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            _ray().kill(w)


def start_trainer_group(rl: RlRuntime, actor_options: list[dict], get: Callable | None = None) -> TrainerGroup:
    """Create `rl.trainer.world` ranks (one Ray actor each, `actor_options[r]` from the plan's role), wait until
    built. Each rank gets the plan's sections it reads, unchanged.

    Rank 0 is created first; its node IP plus a free port on that node is the torch.distributed master.
    """
    remote_cls = _ray().remote(PolicyWorker)
    probe = _ray().remote(num_cpus=0)(_node_ip_and_port)
    addr, port = _ray().get(probe.options(**_placement_only(actor_options[0])).remote())
    world = rl.trainer.world
    workers = [remote_cls.options(**actor_options[r]).remote(rl.trainer, rl.model, rl.ref, rl.algo, rl.device,
                                                             rl.dist_backend, r, addr, port) for r in range(world)]
    (get or _ray().get)([w.ready.remote() for w in workers])
    return TrainerGroup(workers=workers, world=world, get=get)


def _node_ip_and_port() -> tuple[str, int]:
    return _ray().util.get_node_ip_address(), free_port()


def _placement_only(options: dict) -> dict:
    return {k: v for k, v in options.items() if k == "scheduling_strategy"}


def fill_for_training(batch: Experience, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
                      returns: torch.Tensor) -> Experience:
    return replace(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages, returns=returns)
