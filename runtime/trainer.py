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
rescaled by the accumulation count. Under context parallelism the cp ranks of a data-parallel rank take its rows,
split each micro-batch's sequences and put the log-probs back in row order (`runtime/context_parallel.py`): the
token count and the dp factor are the data-parallel ranks', and the rest reads as without CP.

What this module does not know: rollouts, engines, queues. It takes tensors and returns tensors and numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from runtime import fsdp, microbatch, models, moe
from runtime.experience import Experience
from runtime.logprobs import token_logprobs
from runtime.ranks import FsdpRank, free_port, gather_rows, start_ranks

if TYPE_CHECKING:

    from schemas.plan import AlgoPlan, ModelPlan, RefPlan, RlRuntime, TrainerPlan

__all__ = ["PolicyWorker", "TrainerGroup", "fill_for_training", "free_port", "start_trainer_group", "token_logprobs"]


def _ray():
    import ray

    return ray


# --------------------------------------------------------------------------------------------------- worker
class PolicyWorker(FsdpRank):
    """One FSDP2 rank: the policy (trained) and, when the plan has a colocated one, the reference (frozen, same
    process; a separate reference is its own group, `runtime/reference.py`)."""

    def __init__(self, trainer: TrainerPlan, model: ModelPlan, ref: RefPlan | None, algo: AlgoPlan, device: str,
                 dist_backend: str, rank: int, master_addr: str, master_port: int):
        """The plan's sections as they are: `trainer` (batching, optimizer, loss), `model` (path, dtype, attention,
        checkpointing), `ref` (None: no reference model), `algo` (KL estimator, IS correction)."""
        super().__init__(trainer.world, trainer.seed, device, dist_backend, rank, master_addr, master_port)
        self.t, self.model_plan, self.algo = trainer, model, algo
        self.backend = backend = models.backend(model)
        self.meshes = backend.device_mesh(device, trainer.world, trainer.mesh)
        self.use_meshes(self.meshes.cp, self.meshes.tp, trainer.dp)
        self.model = backend.build(model, model.path, self.meshes, self.device, trainable=True,
                                   freeze_router=trainer.freeze_moe_router, lora=trainer.lora,
                                   freeze_visual_encoder=trainer.freeze_visual_encoder, offload=trainer.offload,
                                   sequence_parallel=trainer.sequence_parallel)
        # VLM: the image placeholder id feeds the backbone's M-RoPE token types (a fact of the checkpoint).
        self.image_token_id = getattr(self.model.config, "image_token_id", None)
        colocated_ref = ref is not None and ref.colocated
        self.ref = backend.build(model, ref.path, self.meshes, self.device, trainable=False,
                                 sequence_parallel=trainer.sequence_parallel) if colocated_ref else None
        self.optimizer, self.scheduler = fsdp.build_optimizer(trainer.optimizer, self.model, trainer.offload)
        # Aux losses whenever the model routes (reported as metrics; in the loss at the plan's coefficients).
        self.aux = moe.is_moe(self.model)
        self.top_k = moe.shape_of(self.model)[1]

    def ready(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------------------------------------- batching
    def _shard(self, batch: Experience) -> tuple[torch.Tensor, Experience, torch.Tensor]:
        return self.shard(batch, balanced=self.t.dynamic_batch_max_tokens is not None)

    def _step_windows(self, shard: Experience) -> list[range]:
        """The shard's optimizer-step windows: micro_batch * grad_accum rows, the plan's local batch under dynamic
        batching, the whole shard under force_on_policy."""
        t = self.t
        return microbatch.windows(shard.batch_size, microbatch.window_rows(
            shard.batch_size, t.micro_batch_size, t.grad_accum, t.local_batch_size, t.force_on_policy))

    def _logprobs(self, model, part: Experience) -> torch.Tensor:
        """(b, T-1) log-probs of a micro-batch (no grad), R3-replayed when the plan says so."""
        with self.cp_rows(part, model, self.t.packing) as cp, self._routing(model, part, cp=cp):
            return self.logprobs(model, part, self.t.temperature, self.t.packing, cp=cp)[0]

    @contextlib.contextmanager
    def _routing(self, model, part: Experience, aux: bool = False, cp=None):
        """Around a forward (and its backward: checkpointed layers re-route when recomputed): R3 replay of the
        rollout's routing when the plan says so (under context parallelism the shard's positions', `cp`), and the
        router logits for the aux losses when `aux`."""
        with contextlib.ExitStack() as stack:
            if self.t.routing_replay:
                if part.routed_experts is None:
                    raise RuntimeError("train.routing_replay is on but the batch carries no routing: the engines "
                                       "returned none (EnginesPlan.routed_experts)")
                state = stack.enter_context(moe.replay(model))
                # under CP the shard's positions' (the sharder's pad slots: not captured, they keep the live choice)
                state.targets = (moe.flat_targets(part.routed_experts, part.attention_mask, self.t.packing)
                                 if cp is None else cp.replay_targets(part.routed_experts, part.attention_mask))
                self._replay_state = state
            yield stack.enter_context(moe.collect_logits(model)) if aux else None

    # ----------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def forward_logprobs(self, batch: Experience) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of `batch`: (their indices, old log-probs of the current policy, reference log-probs or
        None), each (b, T-1), zero past each row's end. Runs the micro-batches `train` runs (its windows'), so π_old
        comes from the same micro-batch shapes as the first epoch's training forward."""
        t = self.t
        rows, shard, lengths = self._shard(batch)
        old = torch.zeros(shard.action_mask.shape)
        ref = torch.zeros(shard.action_mask.shape) if self.ref is not None else None
        parts = (p for window in self._step_windows(shard) for p in self.micro_parts(shard, lengths, window, t))
        for mb, part in parts:
            width = part.action_mask.shape[1]
            lp = self._logprobs(self.model, part).cpu()
            if mb is not None:
                old[mb, :width] = lp
            if self.ref is not None:
                lp_ref = self._logprobs(self.ref, part).cpu()
                if mb is not None:
                    ref[mb, :width] = lp_ref
        if not self.leads_rows:  # the first of its data-parallel rank's cp x tp ranks returns the rows
            return rows[:0], old[:0], None if ref is None else ref[:0]
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
        the plan's local batch under dynamic batching; under force_on_policy the whole shard: one step per rollout
        batch), its micro-batches of fixed rows or of a token budget. A batch without old log-probs (the plan's
        `old_logprob_pass` off) takes π_old from the training forward itself (ratio 1).

        Returns sums over this rank's micro-batches (token-weighted means are formed by the driver) plus rank-level
        scalars (lr, grad norm, optimizer steps).
        """
        t = self.t
        _, shard, lengths = self._shard(batch)
        sums: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        for _ in range(t.max_epochs):
            for window in self._step_windows(shard):
                total = self.window_tokens(shard, window)
                stats = self._window_stats(shard, window)
                parts = list(self.micro_parts(shard, lengths, window, t))
                for _, part in parts:
                    for k, v in self._micro_step(part, total, kl_coef, len(parts), stats).items():
                        sums[k] = sums.get(k, 0.0) + v
                fsdp.sync_tp_replicas(self.model, self.meshes.fsdp if self.meshes.tp is not None else None)
                grad_norms.append(self._optimizer_step())
        # the first of its data-parallel rank's cp x tp ranks counts the rows' tokens
        if not self.leads_rows:
            sums = {k: 0.0 if k == "tokens" or k.endswith("_x_tokens") else v for k, v in sums.items()}
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
        return aggregation.merge(parts[::self.replicas])  # one per data-parallel rank (cp x tp ranks consecutive)

    def _micro_step(self, part: Experience, global_tokens: float, kl_coef: float, micro_batches: int,
                    window=None) -> dict[str, float]:
        # under context parallelism the forward and the backward run inside the shard's ring-attention block
        with (self.cp_rows(part, self.model, self.t.packing) as cp,
              self._routing(self.model, part, aux=self.aux, cp=cp) as router_logits):
            return self._micro_step_in(part, global_tokens, kl_coef, micro_batches, window, router_logits, cp)

    def _micro_step_in(self, part: Experience, global_tokens: float, kl_coef: float, micro_batches: int, window,
                       router_logits, cp) -> dict[str, float]:
        from runtime import algo
        from runtime.algo import aggregation, mismatch
        from runtime.algo.score_centering import centering

        ls, isc, kl = self.t.loss, self.algo.is_correction, self.algo.kl
        dev = self.device
        mask = part.action_mask.to(dev)
        centered = self.algo.score_centering_top_k > 0
        if centered and part.rollout_top_ids is None:  # Molt L6
            raise RuntimeError("score centering is on but the batch carries no top-k log-probs from the engines")
        logp, entropy, top_lp = self.top_logprobs(self.model, part, self.t.temperature, self.t.packing,
                                                  with_entropy=ls.entropy_coef != 0, with_top=centered, cp=cp)
        # No old log-probs (Molt B28): π_old is this very forward, detached, so the ratio is exactly 1.
        old = logp.detach() if part.old_log_probs is None else part.old_log_probs.to(dev)
        rollout_lp = part.rollout_log_probs.to(dev)
        is_out = algo.is_correction(old, rollout_lp, mask, level=isc.level, mode=isc.mode, low=isc.low,
                                    high=isc.high, gating=isc.gating)
        sc = None
        if centered:  # f follows the IS mode and band; `none` (f ≡ 1) when IS is off (molt_0_2_1.md §3.4)
            sc = centering(top_lp, part.rollout_top_log_probs.to(dev), mask,
                           mode=isc.mode if isc.enabled else "none", low=isc.low, high=isc.high)
        use_kl_loss = kl.use_loss and part.ref_log_probs is not None
        weights = None if window is None else aggregation.row_weights(ls.agg_mode, part.action_mask,
                                                                      part.group_ids, window).to(dev)
        out = algo.actor_loss(
            logp, old, part.advantages.to(dev), mask, mode=ls.mode, clip_low=ls.clip_low, clip_high=ls.clip_high,
            global_num_tokens=global_tokens, dp_size=self.t.dp, dual_clip=ls.dual_clip,
            is_coef=is_out.coef if isc.enabled else None,
            ref_log_probs=part.ref_log_probs.to(dev) if use_kl_loss else None,
            kl_coef=kl_coef if use_kl_loss else 0.0, kl_estimator=kl.estimator, kl_ref=kl.ref,
            entropy=entropy, entropy_coef=ls.entropy_coef, row_weights=weights,
            centering=None if sc is None else sc.correction)
        loss, moe_stats = out.loss, {}
        if router_logits is not None:
            # Molt B32: coef * aux / micro-batches, so a window adds its micro-batches' mean; a filler adds 0.
            weight = (1.0 if bool(mask.any()) else 0.0) / micro_batches
            logits = router_logits.logits if cp is None else cp.gather_router_logits(router_logits.logits)
            real = (part.attention_mask.to(dev).reshape(-1) if not self.t.packing
                    else torch.ones(logits[0].shape[0], device=dev))
            balance = moe.load_balancing_loss(logits, self.top_k, real)
            z = moe.z_loss(logits, real)
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
        if sc is not None:
            stats["score_centering_sampler_head_mass_x_tokens"] = float(sc.sampler_head_mass) * tokens
            stats["score_centering_policy_head_mass_x_tokens"] = float(sc.policy_head_mass) * tokens
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

        return [(m.name, m.dtype, m.shape) for m in weight_sync.wire_metas(self.backend.hf_weights(self.model), dtype)]

    def weight_sync_address(self) -> tuple[str, int]:
        """This node's IP and a free port for the weight-sync store (rank 0 hosts it)."""
        return _ray().util.get_node_ip_address(), free_port()

    def open_weight_sync(self, method: str, host: str, port: int, world: int, timeout_s: float) -> None:
        """Rank 0 only: host the weight-sync store and join the group as its rank 0 (blocks until all joined);
        `method` is the plan's `weight_sync.method`."""
        from runtime import weight_sync

        self._sync_group = weight_sync.join_group(method, host, port, 0, world, timeout_s)

    def send_weights(self, dtype: str, bucket_bytes: int) -> dict[str, float]:
        """Every rank must call this (rank 0 gathers the shards bucket by bucket); rank 0 broadcasts the buckets."""
        from runtime import weight_sync

        sources = self.backend.hf_weights(self.model)
        metas = weight_sync.wire_metas(sources, dtype)
        group = getattr(self, "_sync_group", None) if self.rank == 0 else None
        return weight_sync.send_model(sources, metas, bucket_bytes, group, self.device, dist.group.WORLD,
                                      self.rank, self.t.world).as_dict()

    def save_checkpoint(self, path: str) -> None:
        from runtime.ckpt import save_sharded

        save_sharded(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: str) -> None:
        from runtime.ckpt import load_sharded

        load_sharded(path, self.model, self.optimizer, self.scheduler)

    def export_hf(self, out_dir: str) -> str | None:
        from runtime.ckpt import export_hf

        return export_hf(out_dir, self.model, self.backend.hf_weights, self.model_plan.path, self.rank)



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
        """(old, colocated ref or None) log-probs of the whole batch, (B, T-1) in batch order."""
        outs = self._get([w.forward_logprobs.remote(batch_ref) for w in self.workers])
        old = gather_rows([(rows, o) for rows, o, _ in outs])
        if outs[0][2] is None:
            return old, None
        return old, gather_rows([(rows, r) for rows, _, r in outs])

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
    t = rl.trainer
    workers = start_ranks(PolicyWorker, actor_options, lambda r, addr, port: (
        t, rl.model, rl.ref, rl.algo, rl.device, rl.dist_backend, r, addr, port), get=get)
    return TrainerGroup(workers=workers, world=t.world, get=get)


def fill_for_training(batch: Experience, old: torch.Tensor | None, ref: torch.Tensor | None, advantages: torch.Tensor,
                      returns: torch.Tensor, values: torch.Tensor | None = None) -> Experience:
    return replace(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages, returns=returns,
                   values=values)
