"""The FSDP2 core shared by the RL model groups (policy `runtime/trainer.py`, critic `runtime/critic.py`, separate
reference `runtime/reference.py`) and the SFT job (`runtime/sft.py`).

Model build (HF model, fp32 master weights, activation checkpointing, `fully_shard` per decoder layer and then the
root, compute dtype from the plan: `reference/environment.md` §5; plus the chunked log-prob method of
`runtime/logprobs.py`; or the same architecture with a scalar value head for the critic), the AdamW optimizer and
its transformers scheduler from the plan's `OptimizerPlan`, and the clipped optimizer step. DCP save/load and the
HF export are `runtime/ckpt.py`'s, used by all alike.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from runtime.logprobs import attach

if TYPE_CHECKING:
    from schemas.plan import LoraPlan, ModelPlan, OptimizerPlan


def is_vlm(path: str) -> bool:
    """The checkpoint is a vision-language model (its config has a `vision_config`): a fact of the model."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def build_model(model_plan: ModelPlan, path: str, mesh, device: torch.device, trainable: bool = True,
                lora: LoraPlan | None = None, freeze_visual_encoder: bool = False):
    """`path`'s HF causal LM with `model_plan`'s attention, dtype and checkpointing, FSDP2-sharded over `mesh`.

    A frozen model (a reference) is in eval mode without gradients and never checkpoints. `lora`: peft adapters
    patched in before sharding (`runtime/lora.py`); only they train. A VLM loads as an image-text-to-text model;
    its language-model layers are the FSDP units and the vision tower stays in the root unit (all-gathered on every
    forward, so a rank whose micro-batch has no image runs the same collectives). `freeze_visual_encoder` (Molt's:
    train only the language model and lm_head) stops the tower's gradients.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # Master weights in fp32; FSDP2 casts to the compute dtype on all-gather.
    vlm = is_vlm(path)
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=model_plan.attn)
    model.to(device)
    if lora is not None:
        from runtime import lora as lora_adapters

        lora_adapters.apply(model, lora)
    if vlm and freeze_visual_encoder:
        model.model.visual.requires_grad_(False)
    _shard(model, model_plan, mesh, trainable, lora=lora is not None,
           layers=model.model.language_model.layers if vlm else model.model.layers)
    attach(model)  # chunked lm_head log-probs as an FSDP forward method
    return model


def build_value_model(model_plan: ModelPlan, path: str, mesh, device: torch.device):
    """The critic: `path`'s architecture with its vocabulary head replaced by a scalar head (transformers'
    `...ForTokenClassification` with one label: `score = Linear(hidden, 1)`, initialised with the model's
    `initializer_range`), no dropout on the head, sharded like the policy (`reference/molt_rules.md` §6.4)."""
    model = load_value_model(path, model_plan.attn)
    model.to(device)
    _shard(model, model_plan, mesh, trainable=True, lora=False, layers=model.model.layers)
    return model


def load_value_model(path: str, attn: str):
    """`path`'s architecture as an unsharded fp32 one-label token classifier, without dropout before the head."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                           attn_implementation=attn)


def _shard(model, model_plan: ModelPlan, mesh, trainable: bool, lora: bool, layers) -> None:
    """Checkpointing (trainable models only), eval mode and no gradients for a frozen one, then FSDP2 over `mesh`:
    each of `layers` is a unit, the rest of the model the root unit."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if trainable and model_plan.gradient_checkpoint != "none":
        model.gradient_checkpointing_enable()
        if lora:
            model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks still need a grad path
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, model_plan.dtype), reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


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
