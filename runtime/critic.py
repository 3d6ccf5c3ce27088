"""The critic (value model) of the gae estimator: its own FSDP2 group, optimizer and scheduler.

One `CriticWorker` per rank (`runtime/ranks.py`), placed as the plan's `critic` role says: colocated, each rank shares
the bundle of the policy rank of the same index (time-sliced, `reference/molt_rules.md` §3.2), or in an actor-sized
group of its own. The model is the policy's architecture with a scalar head, built from `critic.path` by the plan's
backend (`build_value_model`: transformers' token classifier on `hf`, nemo-automodel's causal LM on `automodel`), on
the plan's critic mesh: FSDP2 over its ranks, and at the actor's tp > 1 nemo-automodel's tensor parallelism as the
policy's (its tp ranks take a data-parallel rank's rows; the head replicated).
It batches exactly like the policy (the shared FSDP strategy, B9: micro-batches of `train.micro_batch_size` rows or
of a token budget, padded or packed), with its own `grad_accum`, local batch and `max_epochs`: it runs no context
parallelism, so under the actor's cp it has cp times the policy's data-parallel ranks (the plan's `critic.dp`).

- `values`: V(s_t) at collection time, (B, T-1) aligned like the log-probs: position t is the value of the state
  that ends with token t, before the action token t+1.
- `train`: `max_epochs` passes of the clipped value regression (`runtime.algo.value_loss`, Molt's ValueLoss)
  against the GAE returns, with the global token mean over each optimizer-step window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from runtime import fsdp, microbatch, models
from runtime.algo import masked_mean
from runtime.experience import Experience
from runtime.logprobs import key_padding_mask, pack, packed_row_masks, unpack
from runtime.ranks import FsdpRank, gather_rows, start_ranks

if TYPE_CHECKING:
    from schemas.plan import CriticPlan, ModelPlan, RlRuntime, TrainerPlan


def _ray():
    import ray

    return ray


def token_values(model, sequences: Tensor, attention_mask: Tensor, packed: bool = False) -> Tensor:
    """(b, w-1) V(sequences[:, :t+1]) for t < w-1 from a one-label token-classification model, 0 past each row's
    scored positions. `packed` runs the rows as one packed row (as `runtime.logprobs.token_logprobs`)."""
    if not packed:
        values = model(input_ids=sequences, attention_mask=key_padding_mask(model, attention_mask, None),
                       use_cache=False).logits[..., 0]
        return values[:, :-1] * attention_mask[:, 1:]
    lengths = attention_mask.sum(-1)
    flat, positions = pack(sequences, lengths)
    values = model(input_ids=flat, position_ids=positions, use_cache=False, **packed_row_masks(model, flat, positions)
                   ).logits[..., 0]
    return unpack(values.reshape(flat.shape), lengths, sequences.shape[1])  # THD (te): (N,) values


# --------------------------------------------------------------------------------------------------- worker
class CriticWorker(FsdpRank):
    """One FSDP2 rank of the value model."""

    def __init__(self, critic: CriticPlan, trainer: TrainerPlan, model: ModelPlan, device: str, dist_backend: str,
                 rank: int, master_addr: str, master_port: int):
        """The plan's sections as they are: `critic` (path, world, grad_accum, epochs, value clip, optimizer),
        `trainer` (the FSDP strategy the critic shares with the policy: micro-batching, packing, seed), `model`
        (dtype, attention, checkpointing)."""
        super().__init__(critic.world, trainer.seed, device, dist_backend, rank, master_addr, master_port)
        self.c, self.t = critic, trainer
        backend = models.backend(model)
        # the plan's critic mesh: the actor's tp (its ranks share a data-parallel rank's rows), FSDP2 over the rest
        self.meshes = backend.device_mesh(device, critic.world, critic.mesh)
        self.use_meshes(None, self.meshes.tp, critic.dp)
        self.model = backend.build_value_model(model, critic.path, self.meshes, self.device, offload=trainer.offload)
        self.optimizer, self.scheduler = fsdp.build_optimizer(critic.optimizer, self.model, trainer.offload)

    def ready(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def _rows(self, batch: Experience):
        return self.shard(batch, balanced=self.t.dynamic_batch_max_tokens is not None)

    def _values(self, part: Experience) -> Tensor:
        return token_values(self.model, part.sequences.to(self.device), part.attention_mask.to(self.device),
                            packed=self.t.packing)

    @torch.no_grad()
    def values(self, batch: Experience) -> tuple[Tensor, Tensor]:
        """This rank's rows of `batch`: (their indices, (b, T-1) values), zero past each row's end."""
        self.model.eval()
        rows, shard, lengths = self._rows(batch)
        out = torch.zeros(shard.action_mask.shape)
        for mb, part in self.micro_parts(shard, lengths, range(shard.batch_size), self.t):
            v = self._values(part).float().cpu()
            if mb is not None:
                out[mb, :v.shape[1]] = v
        return (rows, out) if self.leads_rows else (rows[:0], out[:0])

    def train(self, batch: Experience) -> dict[str, float]:
        """`critic.max_epochs` passes over this rank's rows, one optimizer step per window (micro_batch x the
        critic's grad_accum rows, or the critic's local batch under dynamic batching; under force_on_policy the whole
        shard, Molt critic_actor.py:136-137). Returns sums over this rank's micro-batches (the group forms token
        means) and rank-level scalars."""
        from runtime import algo

        c, t = self.c, self.t
        _, shard, lengths = self._rows(batch)
        step_rows = microbatch.window_rows(shard.batch_size, t.micro_batch_size, c.grad_accum, c.local_batch_size,
                                           t.force_on_policy)
        sums = {"value_loss_sum": 0.0, "value_clip_frac_x_tokens": 0.0, "tokens": 0.0}
        grad_norms = []
        self.model.train()
        for _ in range(c.max_epochs):
            for window in microbatch.windows(shard.batch_size, step_rows):
                total = self.window_tokens(shard, window)
                for _, part in self.micro_parts(shard, lengths, window, t):
                    mask = part.action_mask.to(self.device)
                    loss, clip_frac = algo.value_loss(
                        self._values(part), part.values.to(self.device), part.returns.to(self.device), mask,
                        value_clip=c.value_clip, global_num_tokens=total, dp_size=self.dp)
                    loss.backward()
                    tokens = float(mask.sum())
                    sums["value_loss_sum"] += float(loss.detach()) * total / self.dp  # back to Σ per-token loss
                    sums["value_clip_frac_x_tokens"] += float(clip_frac) * tokens
                    sums["tokens"] += tokens
                fsdp.sync_tp_replicas(self.model, self.meshes.fsdp if self.meshes.tp is not None else None)
                grad_norms.append(fsdp.clipped_step(self.model, self.optimizer, self.scheduler,
                                                    c.optimizer.max_norm))
        if not self.leads_rows:  # its tp rank 0 counts the rows' loss and tokens
            sums = dict.fromkeys(sums, 0.0)
        sums["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        sums["optimizer_steps"] = float(len(grad_norms))
        sums["lr"] = self.scheduler.get_last_lr()[0]
        return sums

    def save_checkpoint(self, path: str) -> None:
        from runtime.ckpt import save_sharded

        save_sharded(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: str) -> None:
        from runtime.ckpt import load_sharded

        load_sharded(path, self.model, self.optimizer, self.scheduler)


# --------------------------------------------------------------------------------------------------- group
@dataclass
class CriticGroup:
    """The driver's handle on the critic ranks."""

    workers: list  # list[ActorHandle[CriticWorker]]
    get: Callable[[list], list] | None = None  # how results are awaited (the driver's supervisor); None: ray.get

    def _get(self, refs: list) -> list:
        return (self.get or _ray().get)(refs)

    def values(self, batch_ref) -> Tensor:
        """(B, T-1) V_old of the whole batch, in batch order."""
        return gather_rows(self._get([w.values.remote(batch_ref) for w in self.workers]))

    def train(self, batch_ref) -> dict[str, float]:
        """The critic step on every rank: token means over all ranks (lr, grad norm: rank 0's)."""
        outs = self._get([w.train.remote(batch_ref) for w in self.workers])
        tokens = max(sum(o["tokens"] for o in outs), 1.0)
        return {"value_loss": sum(o["value_loss_sum"] for o in outs) / tokens,
                "value_clip_frac": sum(o["value_clip_frac_x_tokens"] for o in outs) / tokens,
                "lr": outs[0]["lr"], "grad_norm": outs[0]["grad_norm"], "optimizer_steps": outs[0]["optimizer_steps"]}

    def save_checkpoint(self, path: str) -> None:
        self._get([w.save_checkpoint.remote(path) for w in self.workers])

    def load_checkpoint(self, path: str) -> None:
        self._get([w.load_checkpoint.remote(path) for w in self.workers])

    def shutdown(self) -> None:
        _ray().get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            _ray().kill(w)


def start_critic_group(rl: RlRuntime, actor_options: list[dict], get: Callable | None = None) -> CriticGroup:
    """`rl.critic.world` ranks, one Ray actor each with `actor_options[r]` from the plan's `critic` role."""
    workers = start_ranks(CriticWorker, actor_options, lambda r, addr, port: (
        rl.critic, rl.trainer, rl.model, rl.device, rl.dist_backend, r, addr, port), get=get)
    return CriticGroup(workers=workers, get=get)


def critic_metrics(values: torch.Tensor | None, returns: torch.Tensor, batch: Experience) -> dict[str, float]:
    """The critic at collection: its mean value, the returns' mean and spread, and how much of their variance it
    explains (gae only)."""
    if values is None:
        return {}
    real, mask = batch.batch_size, batch.action_mask
    return {"critic/values_mean": float(masked_mean(values[:real], mask)),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/returns_std": float(returns[mask.bool()].double().std(unbiased=False)),
            "critic/explained_variance": explained_variance(values[:real], returns, mask)}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 − Var(returns − values) / Var(returns) over the action tokens: 1 is a perfect critic, 0 one that predicts
    the mean return, below 0 a worse one (nan when the returns do not vary)."""
    m = mask.bool()
    r, v = returns[m].double(), values[m].double()
    var_r = r.var(unbiased=False)
    return float("nan") if var_r == 0 else float(1 - (r - v).var(unbiased=False) / var_r)
