"""The FSDP2 actor group: one Ray actor per rank, a policy model sharded with `fully_shard`, and its frozen reference.

Each `PolicyWorker` joins one torch.distributed world (gloo on CPU, NCCL on GPUs; rank 0's node is the master),
shards every decoder layer and then the root (`reference/environment.md` §5), and owns the optimizer and scheduler.
The driver (`runtime/loop.py`) calls every rank with the same object-store batch; each rank takes its contiguous
shard, so concatenating the ranks' outputs in rank order restores the batch order.

Loss aggregation is Molt's global token mean (`reference/molt_rules.md` §6.4): inside an optimizer-step window,
each rank sums its per-token losses and divides by the action-token count of the *whole* window (all micro-batches
of all ranks, one all-reduce), times the dp size because FSDP averages gradients over ranks. The backward is not
rescaled by the accumulation count.

What this module does not know: rollouts, engines, queues. It takes tensors and returns tensors and numbers.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from runtime.experience import Experience


@dataclass(frozen=True)
class OptimizerSpec:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    max_norm: float            # <= 0: no clipping
    scheduler: str             # transformers.get_scheduler name
    warmup_steps: int
    total_steps: int           # optimizer steps of the whole run
    min_lr_ratio: float


@dataclass(frozen=True)
class LossSpec:
    mode: str                  # ppo | cispo | gspo
    clip_low: float
    clip_high: float
    dual_clip: float | None
    entropy_coef: float
    kl_estimator: str          # k1 | k2 | k3
    kl_use_loss: bool
    is_level: str              # off | token | seq | geo
    is_mode: str               # mask | clip | trunc
    is_low: float
    is_high: float


@dataclass(frozen=True)
class TrainerSpec:
    """Everything a rank needs, copied from the plan's `rl` section by `runtime/loop.py` (never defaulted here)."""

    model_path: str
    ref_path: str | None       # None: no reference model
    dtype: str                 # float32 | bfloat16 | float16: FSDP2 compute dtype (master weights stay fp32)
    attn: str                  # attn_implementation
    gradient_checkpoint: bool
    device: str                # cpu | cuda
    dist_backend: str          # gloo | nccl
    world: int
    micro_batch_size: int
    grad_accum: int
    max_epochs: int
    temperature: float
    seed: int
    optimizer: OptimizerSpec
    loss: LossSpec


def _ray():
    """Ray, imported on first use: a rank itself needs only torch, so it also runs under torchrun (GPU checks)."""
    import ray

    return ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------- math helpers
def token_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T-1) log π(sequences[:, t+1] | sequences[:, :t+1]) with logits / temperature, and optionally the entropy."""
    logits = model(input_ids=sequences, attention_mask=attention_mask.long()).logits[:, :-1].float()
    logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, sequences[:, 1:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    return picked - logz, entropy


def _micro_batches(rows: int, micro: int, accum: int) -> list[list[slice]]:
    """Optimizer-step windows of `micro * accum` rows, each a list of micro-batch slices."""
    window = micro * accum
    out = []
    for w0 in range(0, rows, window):
        w1 = min(w0 + window, rows)
        out.append([slice(m0, min(m0 + micro, w1)) for m0 in range(w0, w1, micro)])
    return out


# --------------------------------------------------------------------------------------------------- worker
class PolicyWorker:
    """One FSDP2 rank: the policy (trained) and, when the plan has one, the reference (frozen, same process)."""

    def __init__(self, spec: TrainerSpec, rank: int, master_addr: str, master_port: int):
        self.spec, self.rank = spec, rank
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                          WORLD_SIZE=str(spec.world), LOCAL_RANK="0")
        self.device = torch.device(spec.device if spec.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        dist.init_process_group(spec.dist_backend, rank=rank, world_size=spec.world)
        torch.manual_seed(spec.seed)
        self.mesh = dist.device_mesh.init_device_mesh(spec.device, (spec.world,), mesh_dim_names=("dp",))
        self.model = self._build(spec.model_path, trainable=True)
        self.ref = self._build(spec.ref_path, trainable=False) if spec.ref_path else None
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                           weight_decay=opt.weight_decay)
        from transformers import get_scheduler

        extra = {"min_lr_rate": opt.min_lr_ratio} if opt.scheduler == "cosine_with_min_lr" else None
        self.scheduler = get_scheduler(opt.scheduler, self.optimizer, num_warmup_steps=opt.warmup_steps,
                                       num_training_steps=opt.total_steps, scheduler_specific_kwargs=extra)
        self.optimizer_steps = 0

    def _build(self, path: str, trainable: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        # Master weights in fp32; FSDP2 casts to the compute dtype on all-gather.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=self.spec.attn)
        model.to(self.device)
        if trainable and self.spec.gradient_checkpoint:
            model.gradient_checkpointing_enable()
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, self.spec.dtype), reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        return model

    def ready(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # ----------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def forward_logprobs(self, batch: Experience) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's shard: (old log-probs of the current policy, reference log-probs or None), each (b, T-1)."""
        shard = batch.shard(self.rank, self.spec.world)
        old, ref = [], []
        for (mb,) in _micro_batches(shard.batch_size, self.spec.micro_batch_size, 1):
            seqs, attn = shard.sequences[mb].to(self.device), shard.attention_mask[mb].to(self.device)
            old.append(token_logprobs(self.model, seqs, attn, self.spec.temperature)[0].cpu())
            if self.ref is not None:
                ref.append(token_logprobs(self.ref, seqs, attn, self.spec.temperature)[0].cpu())
        return torch.cat(old), (torch.cat(ref) if self.ref is not None else None)

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        """Log-probs of a fixed sequence under the current weights at temperature 1, as the engines' `score`
        (every rank must call: FSDP all-gathers)."""
        seq = torch.tensor([token_ids], device=self.device)
        lp, _ = token_logprobs(self.model, seq, torch.ones_like(seq, dtype=torch.bool), 1.0)
        return lp[0].cpu().tolist()

    # ----------------------------------------------------------------------------------------------- train
    def train(self, batch: Experience, kl_coef: float) -> dict[str, float]:
        """max_epochs passes over this rank's shard, one optimizer step per window of micro_batch * grad_accum rows.

        Returns sums over this rank's micro-batches (token-weighted means are formed by the driver) plus rank-level
        scalars (lr, grad norm, optimizer steps).
        """
        spec = self.spec
        shard = batch.shard(self.rank, spec.world)
        sums: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        for _ in range(spec.max_epochs):
            for window in _micro_batches(shard.batch_size, spec.micro_batch_size, spec.grad_accum):
                # Global-token-mean normaliser: action tokens of this window on every rank (one all-reduce).
                total = torch.tensor([float(sum(int(shard.action_mask[mb].sum()) for mb in window))],
                                     device=self.device)  # NCCL reduces device tensors only
                dist.all_reduce(total)
                for mb in window:
                    for k, v in self._micro_step(shard.select(mb), total.item(), kl_coef).items():
                        sums[k] = sums.get(k, 0.0) + v
                grad_norms.append(self._optimizer_step())
        sums["grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        sums["optimizer_steps"] = float(len(grad_norms))
        sums["lr"] = self.scheduler.get_last_lr()[0]
        return sums

    def _micro_step(self, part: Experience, global_tokens: float, kl_coef: float) -> dict[str, float]:
        from runtime import algo

        ls = self.spec.loss
        dev = self.device
        seqs, attn, mask = part.sequences.to(dev), part.attention_mask.to(dev), part.action_mask.to(dev)
        logp, entropy = token_logprobs(self.model, seqs, attn, self.spec.temperature,
                                       with_entropy=ls.entropy_coef != 0)
        old = part.old_log_probs.to(dev)
        is_out = algo.is_correction(old, part.rollout_log_probs.to(dev), mask, level=ls.is_level, mode=ls.is_mode,
                                    low=ls.is_low, high=ls.is_high)
        use_kl_loss = ls.kl_use_loss and part.ref_log_probs is not None
        out = algo.actor_loss(
            logp, old, part.advantages.to(dev), mask, mode=ls.mode, clip_low=ls.clip_low, clip_high=ls.clip_high,
            global_num_tokens=global_tokens, dp_size=self.spec.world, dual_clip=ls.dual_clip,
            is_coef=None if ls.is_level == "off" else is_out.coef,
            ref_log_probs=part.ref_log_probs.to(dev) if use_kl_loss else None,
            kl_coef=kl_coef if use_kl_loss else 0.0, kl_estimator=ls.kl_estimator,
            entropy=entropy, entropy_coef=ls.entropy_coef)
        out.loss.backward()
        # Per-micro-batch means, weighted by its action tokens so the driver can form batch-level token means.
        tokens = float(mask.sum())
        stats = {f"{k}_x_tokens": float(v) * tokens for k, v in out.metrics.items()}
        stats["is_filter_ratio_x_tokens"] = float(is_out.is_filter_ratio) * tokens
        stats["vllm_kl_x_tokens"] = float(is_out.vllm_kl) * tokens
        stats["tokens"] = tokens
        return stats

    def _optimizer_step(self) -> float:
        max_norm = self.spec.optimizer.max_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm if max_norm > 0 else math.inf)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        return float(grad_norm)

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
                                      self.rank, self.spec.world).as_dict()

    def save_checkpoint(self, path: str) -> None:
        from runtime.ckpt import save_sharded

        save_sharded(path, self.model, self.optimizer, self.scheduler)

    def load_checkpoint(self, path: str) -> None:
        from runtime.ckpt import load_sharded

        load_sharded(path, self.model, self.optimizer, self.scheduler)

    def export_hf(self, out_dir: str) -> str | None:
        from runtime.ckpt import export_hf

        return export_hf(out_dir, self.model, self.spec.model_path, self.rank)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- group
@dataclass
class TrainerGroup:
    """The driver's handle on the ranks. Calls are direct (`w.train.remote(...)`), never dispatched by name."""

    workers: list  # list[ActorHandle[PolicyWorker]]
    world: int

    def forward_logprobs(self, batch_ref) -> tuple[torch.Tensor, torch.Tensor | None]:
        outs = _ray().get([w.forward_logprobs.remote(batch_ref) for w in self.workers])
        old = torch.cat([o for o, _ in outs])
        ref = torch.cat([r for _, r in outs]) if outs[0][1] is not None else None
        return old, ref

    def train(self, batch_ref, kl_coef: float) -> dict[str, float]:
        """Run the step on every rank; return token-weighted means over all ranks (lr, grad norm: rank 0's)."""
        outs = _ray().get([w.train.remote(batch_ref, kl_coef) for w in self.workers])
        tokens = max(sum(o["tokens"] for o in outs), 1.0)
        means = {k.removesuffix("_x_tokens"): sum(o.get(k, 0.0) for o in outs) / tokens
                 for k in outs[0] if k.endswith("_x_tokens")}
        means.update(tokens=tokens, lr=outs[0]["lr"], grad_norm=outs[0]["grad_norm"],
                     optimizer_steps=outs[0]["optimizer_steps"])
        return means

    def probe_logprobs(self, token_ids: list[int]) -> list[float]:
        return _ray().get([w.probe_logprobs.remote(token_ids) for w in self.workers])[0]

    def save_checkpoint(self, path: str) -> None:
        _ray().get([w.save_checkpoint.remote(path) for w in self.workers])

    def load_checkpoint(self, path: str) -> None:
        _ray().get([w.load_checkpoint.remote(path) for w in self.workers])

    def export_hf(self, out_dir: str) -> str | None:
        return _ray().get([w.export_hf.remote(out_dir) for w in self.workers])[0]

    def shutdown(self) -> None:
        _ray().get([w.shutdown.remote() for w in self.workers])
        for w in self.workers:
            _ray().kill(w)


def start_trainer_group(spec: TrainerSpec, actor_options: list[dict]) -> TrainerGroup:
    """Create `spec.world` ranks (one Ray actor each, `actor_options[r]` from the plan's role), wait until built.

    Rank 0 is created first; its node IP plus a free port on that node is the torch.distributed master.
    """
    remote_cls = _ray().remote(PolicyWorker)
    probe = _ray().remote(num_cpus=0)(_node_ip_and_port)
    addr, port = _ray().get(probe.options(**_placement_only(actor_options[0])).remote())
    workers = [remote_cls.options(**actor_options[r]).remote(spec, r, addr, port) for r in range(spec.world)]
    _ray().get([w.ready.remote() for w in workers])
    return TrainerGroup(workers=workers, world=spec.world)


def _node_ip_and_port() -> tuple[str, int]:
    return _ray().util.get_node_ip_address(), free_port()


def _placement_only(options: dict) -> dict:
    return {k: v for k, v in options.items() if k == "scheduling_strategy"}


def fill_for_training(batch: Experience, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
                      returns: torch.Tensor) -> Experience:
    return replace(batch, old_log_probs=old, ref_log_probs=ref, advantages=advantages, returns=returns)
