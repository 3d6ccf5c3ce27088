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
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
