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
  runs there (`HostStep`): before it, each parameter's and gradient's local shard is copied into a host buffer and
  put in its place; after it, the updated shard is copied back into the device tensor FSDP2 all-gathers from.
  The optimizer is an ordinary AdamW over the model's own parameters, so DCP checkpoints and the LR scheduler see
  nothing different. The device shards are fp32 master weights, so nothing is kept on the host between steps
  except the optimizer states and the reused buffers (a checkpoint load between steps needs no resync).
On a CPU run both levels run these same code paths, with host and device the same memory.
"""

from __future__ import annotations

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
    with `offload: optimizer` its states and step on the host (`HostStep`)."""
    from transformers import get_scheduler

    # Fused on GPUs: one kernel per parameter group and no fp32 temporary of the parameters' size (the multi-tensor
    # path allocates one: 4 B/param at the step's peak, measured by tests/gpu/check_memory.py). A host step is the
    # single-tensor path: its tensors are host shards of parameters that FSDP2 keeps on the device.
    fused = _on_cuda(model) and offload == "none"
    params = [p for p in model.parameters() if p.requires_grad]  # under LoRA: the adapters only
    optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay, fused=fused,
                                  foreach=False if offload == "optimizer" else None)
    if offload == "optimizer":
        HostStep(optimizer, pin=_on_cuda(model))
    extra = {"min_lr_rate": opt.min_lr_ratio} if opt.scheduler == "cosine_with_min_lr" else None
    scheduler = get_scheduler(opt.scheduler, optimizer, num_warmup_steps=opt.warmup_steps,
                              num_training_steps=opt.total_steps, scheduler_specific_kwargs=extra)
    return optimizer, scheduler


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


class HostStep:
    """`actor.offload: optimizer`: the optimizer's step on host copies of the local shards, its states on the host.

    Step pre-hook: copy each parameter's and gradient's local shard into its reused host buffer (pinned on CUDA),
    point the parameter and the gradient at those; the optimizer creates and keeps its states next to them. Step
    post-hook: copy the updated buffers back into the device tensors FSDP2 all-gathers from, and point the
    parameters back at them. A state a checkpoint load put on the device (DCP restores states onto the parameter's
    device) goes back to the host at the next step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pin: bool):
        self.pin = pin
        self.buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}  # param -> (host param, host grad)
        self.swapped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (param, device shard, grad shard)
        optimizer.register_step_pre_hook(self._to_host)
        optimizer.register_step_post_hook(self._to_device)

    def _host_buffers(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if p not in self.buffers:
            local = _local(p)
            # Always fresh storage, also on a CPU run: the step must work on the copies, as it does on GPUs.
            self.buffers[p] = tuple(torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
                                    for _ in range(2))
        return self.buffers[p]

    @torch.no_grad()
    def _to_host(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                host_p, host_g = self._host_buffers(p)
                shard, grad_shard = _local(p), _local(p.grad)
                host_p.copy_(shard)
                host_g.copy_(grad_shard)
                self.swapped.append((p, shard, grad_shard))
                _set_local(p, host_p)
                _set_local(p.grad, host_g)
                for value in optimizer.state.get(p, {}).values():
                    if isinstance(value, torch.Tensor) and _local(value).device.type != "cpu":
                        _set_local(value, _local(value).cpu())

    @torch.no_grad()
    def _to_device(self, optimizer, args, kwargs) -> None:
        for p, shard, grad_shard in self.swapped:
            shard.copy_(_local(p))
            _set_local(p, shard)
            _set_local(p.grad, grad_shard)
        self.swapped = []


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
    all-reduce over the world."""
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64, device=params[0].grad.device)
    for p in params:
        g = p.grad
        copies = 1
        for dim, placement in enumerate(getattr(g, "placements", ())):
            if placement.is_replicate():
                copies *= g.device_mesh.size(dim)
        local = g.to_local() if hasattr(g, "to_local") else g
        if not hasattr(g, "placements"):
            copies = dist.get_world_size()  # a plain tensor is whole on every rank
        total += local.detach().double().pow(2).sum() / copies
    dist.all_reduce(total)
    return float(total.sqrt())
