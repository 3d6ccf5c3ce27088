"""The FSDP2 core shared by the RL trainer ranks (`runtime/trainer.py`) and the SFT job (`runtime/sft.py`).

The model and its device mesh come from the plan's backend (`runtime/models/`); here: the AdamW optimizer and its
transformers scheduler from the plan's `OptimizerPlan`, and the clipped optimizer step. DCP save/load and the HF
export are `runtime/ckpt.py`'s, used by both alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from schemas.plan import OptimizerPlan


def build_optimizer(opt: OptimizerPlan, model) -> tuple[torch.optim.Optimizer, object]:
    """AdamW and the plan's transformers scheduler (`warmup_steps` and `total_steps` exactly as the plan has them)."""
    from transformers import get_scheduler

    # Fused on GPUs: one kernel per parameter group and no fp32 temporary of the parameters' size (the multi-tensor
    # path allocates one: 4 B/param at the step's peak, measured by tests/gpu/check_memory.py).
    fused = next(model.parameters()).device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]  # under LoRA: the adapters only
    optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay, fused=fused)
    extra = {"min_lr_rate": opt.min_lr_ratio} if opt.scheduler == "cosine_with_min_lr" else None
    scheduler = get_scheduler(opt.scheduler, optimizer, num_warmup_steps=opt.warmup_steps,
                              num_training_steps=opt.total_steps, scheduler_specific_kwargs=extra)
    return optimizer, scheduler


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
