"""The FSDP2 core shared by the RL trainer ranks (`runtime/trainer.py`), the critic (`runtime/critic.py`) and the
SFT job (`runtime/sft.py`).

The model and its device mesh come from the plan's backend (`runtime/models/`); here: the AdamW optimizer and its
transformers scheduler from the plan's `OptimizerPlan`, CPU offload (`actor.offload`, Molt's `--fsdp.offload`),
and the clipped optimizer step. DCP save/load and the HF export are `runtime/ckpt.py`'s, used by all alike.

CPU offload, per the plan's level:
- `full`: FSDP2's own `CPUOffloadPolicy` (`offload_policy`): the sharded fp32 parameters and their gradients live
  in host memory, each unit's parameters are copied to the device for its all-gather, gradients come back to the
  host after the reduce-scatter, and AdamW steps on the host.
- `optimizer`: the parameters and gradients stay on the device; the AdamW states live in host memory and the step
  runs there (torch's fused CPU AdamW), a chunk of parameters at a time (`HostAdamW`): each chunk's local shards
  are copied into reused host buffers, stepped there, and copied back into the device tensors FSDP2 all-gathers
  from, the copies of one chunk overlapping the step of the next. The device shards are fp32 master weights, so
  nothing is kept on the host between steps except the optimizer states and the four chunk buffers (a checkpoint
  load between steps needs no resync).
On a CPU run both levels run these same code paths, with host and device the same memory.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from schemas.plan import OptimizerPlan


def offload_policy(offload: str, device: torch.device):
    """FSDP2's offload policy for `fully_shard` at the plan's level: `CPUOffloadPolicy` for `full` (host buffers
    pinned on CUDA; pinning needs an accelerator), else the no-op default."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload == "full" else OffloadPolicy()


def _on_cuda(model) -> bool:
    """The model computes on CUDA (its mesh's device; under `full` offload the shards themselves are on the host)."""
    p = next(model.parameters())
    mesh = getattr(p, "device_mesh", None)
    return (mesh.device_type if mesh is not None else p.device.type) == "cuda"


def build_optimizer(opt: OptimizerPlan, model, offload: str = "none") -> tuple[torch.optim.Optimizer, object]:
    """AdamW and the plan's transformers scheduler (`warmup_steps` and `total_steps` exactly as the plan has them);
    with `offload: optimizer` its states and step on the host (`HostAdamW`)."""
    from transformers import get_scheduler

    # Fused on GPUs: one kernel per parameter group and no fp32 temporary of the parameters' size (the multi-tensor
    # path allocates one: 4 B/param at the step's peak, measured by tests/gpu/check_memory.py). A host step is the
    # single-tensor path: its tensors are host shards of parameters that FSDP2 keeps on the device.
    params = [p for p in model.parameters() if p.requires_grad]  # under LoRA: the adapters only
    adamw = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    optimizer: torch.optim.Optimizer
    if offload == "optimizer":
        optimizer = HostAdamW(params, pin=_on_cuda(model), **adamw)
    else:
        optimizer = torch.optim.AdamW(params, fused=_on_cuda(model) and offload == "none", **adamw)
    extra = {"min_lr_rate": opt.min_lr_ratio} if opt.scheduler == "cosine_with_min_lr" else None
    scheduler = get_scheduler(opt.scheduler, optimizer, num_warmup_steps=opt.warmup_steps,
                              num_training_steps=opt.total_steps, scheduler_specific_kwargs=extra)
    return optimizer, scheduler


HOST_STEP_CHUNK_BYTES = 1 << 30
"""`offload: optimizer` steps the parameters in chunks of about this many bytes of local shards (at least the
largest shard); the host holds four such buffers (two chunks' parameter and gradient copies: one chunk arrives
while the other steps) besides the optimizer states. The compiler's host-memory estimate uses the same number (`molt_compile/memory.py`)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding a parameter's (or gradient's) local shard: a DTensor's local tensor, else the tensor."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t.data


def _set_local(t: torch.Tensor, local: torch.Tensor) -> None:
    """Point `t` at another local shard in place: a DTensor keeps its mesh and placements (FSDP2 assigns
    `_local_tensor` the same way), a plain tensor takes new data."""
    if hasattr(t, "_local_tensor"):
        t._local_tensor = local
    else:
        t.data = local


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


class HostAdamW(torch.optim.AdamW):
    """`actor.offload: optimizer`: AdamW whose states live in host memory and whose step runs there (torch's fused
    CPU kernel), a chunk of parameters at a time.

    For each chunk (parameters in order, about `chunk_bytes` of local shards): its parameters' and gradients' local
    shards are copied into views of a reused pair of host buffers (pinned on CUDA) and the parameters and gradients
    pointed at them; AdamW's own step runs with every other gradient hidden (AdamW skips a parameter without one);
    the updated shards are copied back into the device tensors FSDP2 all-gathers from and the parameters pointed
    back. On CUDA the copies run on a side stream, double-buffered: the next chunk comes to the host while the CPU
    steps this one, and this one goes back while the CPU steps the next. The states are created next to the host
    copies (the step counters too, on the host, as the CPU kernel needs); one a checkpoint load put on the device
    (DCP restores states onto the parameter's device) goes back to the host at the next step. Host memory: the
    states plus four chunk buffers, not a host copy of every shard. It is an ordinary AdamW over the model's own
    parameters, so DCP checkpoints and the LR scheduler see nothing different.
    """

    def __init__(self, params, *, pin: bool, **adamw):
        super().__init__(params, foreach=False, fused=True, **adamw)
        self.pin = pin
        self.chunk_bytes = HOST_STEP_CHUNK_BYTES
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # two slots of (parameters, gradients), bytes
        self.copies = torch.cuda.Stream() if pin else None
        self.chunks_last_step = 0

    @property
    def capacity(self) -> int:
        return self.buffers[0][0].numel() if self.buffers else 0

    def _chunks(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        need = max([self.chunk_bytes] + [_aligned(_local(p).nbytes) for p in params])
        if need > self.capacity:
            # Always fresh storage, also on a CPU run: the step must work on the copies, as it does on GPUs.
            self.buffers = [(_host_buffer(need, self.pin), _host_buffer(need, self.pin)) for _ in range(2)]
        chunks: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in params:
            nbytes = _aligned(_local(p).nbytes)
            if chunks[-1] and size + nbytes > self.capacity:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += nbytes
        return chunks

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "the trainer steps without a closure"
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return None
        grads = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        chunks = self._chunks(params)
        if self.copies is not None:
            self.copies.wait_stream(torch.cuda.current_stream())  # the gradients are complete
        try:
            pending = self._to_host(chunks[0], grads, self.buffers[0])
            for k, chunk in enumerate(chunks):
                arrived, swapped = pending
                if k + 1 < len(chunks):  # the next chunk's copies overlap this chunk's step
                    pending = self._to_host(chunks[k + 1], grads, self.buffers[(k + 1) % 2])
                if arrived is not None:
                    arrived.synchronize()
                for p in chunk:
                    p.grad = grads[p]
                super().step()
                for p in chunk:
                    p.grad = None
                self._to_device(swapped)
        finally:
            for p, g in grads.items():
                p.grad = g
        if self.copies is not None:
            torch.cuda.current_stream().wait_stream(self.copies)  # the next forward reads the updated shards
        self.chunks_last_step = len(chunks)
        return None

    def _to_host(self, chunk: list[torch.Tensor], grads: dict, slot: tuple[torch.Tensor, torch.Tensor]):
        """Copy the chunk's shards into the slot's buffers and point the parameters and gradients at the copies;
        returns the event the copies complete at (None when synchronous) and what to swap back."""
        swapped = []
        offset = 0
        with torch.cuda.stream(self.copies) if self.copies is not None else contextlib.nullcontext():
            for p in chunk:
                shard, grad_shard = _local(p), _local(grads[p])
                views = [b[offset:offset + shard.nbytes].view(shard.dtype).view(shard.shape) for b in slot]
                offset += _aligned(shard.nbytes)
                views[0].copy_(shard, non_blocking=True)
                views[1].copy_(grad_shard, non_blocking=True)
                swapped.append((p, grads[p], shard, grad_shard))
                _set_local(p, views[0])
                _set_local(grads[p], views[1])
                state = self.state[p]
                if not state:  # AdamW would put the step counter on the parameter's (device) mesh
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                for value in state.values():
                    if isinstance(value, torch.Tensor) and _local(value).device.type != "cpu":
                        _set_local(value, _local(value).cpu())
            arrived = None
            if self.copies is not None:
                arrived = torch.cuda.Event()
                arrived.record(self.copies)
        return arrived, swapped

    def _to_device(self, swapped) -> None:
        """Copy the stepped shards back into the device tensors and point everything back at them (on CUDA the
        copies are queued on the side stream, after this slot's arrival and before its next reuse)."""
        with torch.cuda.stream(self.copies) if self.copies is not None else contextlib.nullcontext():
            for p, grad, shard, grad_shard in swapped:
                shard.copy_(_local(p), non_blocking=True)
                _set_local(p, shard)
                _set_local(grad, grad_shard)


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """`nbytes` of host memory, page-locked on CUDA by registering it: torch's pinned allocator would round each
    buffer up to a power of two (a 2.5 GB buffer takes 4 GiB)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pin:
        import weakref

        cudart = torch.cuda.cudart()
        if cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0) != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte host buffer failed")
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
    return buffer


def sync_tp_replicas(model, tp_world) -> None:
    """Under tensor parallelism (`tp_world`: nemo-automodel's world mesh; None: none), once per optimizer step
    before the clip: nemo-automodel's reduction of the gradients of the parameters every tp rank holds whole
    (`synchronize_tp_replica_gradients`, where its recipes call it): the q/k norms summed over tp (each rank's
    heads are a part of them), the other norms averaged, so the replicas stay equal (a collective)."""
    if tp_world is not None:
        from nemo_automodel.components.distributed.tp_replicas import synchronize_tp_replica_gradients

        synchronize_tp_replica_gradients([model], tp_world)


def clipped_step(model, optimizer, scheduler, max_norm: float) -> float:
    """Clip the gradient norm to `max_norm` (<= 0: no clipping), step optimizer and scheduler, zero the gradients;
    returns the norm before clipping (a collective: every rank calls it)."""
    params = [p for p in model.parameters() if p.grad is not None]
    meshes = {getattr(p.grad, "device_mesh", None) for p in params}
    if len(meshes) <= 1:  # one FSDP2 mesh: torch's clip (its DTensor norm reduces over that mesh)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
    else:  # several meshes (experts over ep, the rest over dp): one norm over the whole world
        grad_norm = world_grad_norm(params)
        if max_norm > 0 and grad_norm > max_norm:
            coef = max_norm / (grad_norm + 1e-6)  # torch's clip coefficient
            for p in params:
                p.grad.mul_(coef)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def world_grad_norm(params) -> float:
    """The L2 norm of the gradients of DTensor parameters placed on different meshes of one world: each rank's
    local pieces squared and summed, a piece replicated over mesh dims counted once (divided by their sizes), one
    all-reduce over the world. A mesh over part of the world (tensor parallelism's FSDP2 units over dp, one mesh per
    tp coordinate) holds one copy per such mesh: divided by world / its size too."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64, device=params[0].grad.device)
    for p in params:
        g = p.grad
        copies = dist.get_world_size() // g.device_mesh.size() if hasattr(g, "device_mesh") else 1
        for dim, placement in enumerate(getattr(g, "placements", ())):
            if placement.is_replicate():
                copies *= g.device_mesh.size(dim)
        local = g.to_local() if hasattr(g, "to_local") else g
        if not hasattr(g, "placements"):
            copies = dist.get_world_size()  # a plain tensor is whole on every rank
        total += local.detach().double().pow(2).sum() / copies
    dist.all_reduce(total)
    return float(total.sqrt())
