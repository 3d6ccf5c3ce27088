"""LoRA adapters (Molt 0.2.1 `actor.lora`, molt_0_2_1.md §3.7), for the RL trainer and SFT alike.

- `apply` (the hf backend): peft's `inject_adapter_in_model` patches the plan's targets in place (the HF model keeps
  its own module tree, so FSDP2 wraps its decoder layers and the chunked log-prob method attaches as for full
  fine-tuning); only the adapters train. `lora_B` starts at zero, so step 0 is the base model. Targets are the
  plan's fnmatch wildcards on full module names (one regex, which peft full-matches), or every linear layer but
  `lm_head`.
- `apply_automodel` (the automodel backend): nemo-automodel's own adapters on the same targets (its `LinearLoRA`,
  patched in by `apply_lora_to_linear_modules`, as its recipes do before parallelizing): its parallelizers know
  them (the tensor-parallel plan's LoRA-aware styles, `translate_to_lora`; FSDP2 and expert parallelism shard them
  like any parameter), where peft's wrapped layers are no `nn.Linear` a TP style takes. The same function, init
  (A Kaiming-uniform, B zero) and scale (alpha / dim) as peft's; the parameters are `<layer>.lora_A.weight` where
  peft's are `<layer>.lora_A.default.weight`, and the base stays `<layer>.weight`.
- `merged_weights`: what the engines get at each weight sync: every adapted base weight as W + scale·B@A, under its
  plain HF name, the adapter tensors themselves left out. On shards this stays local: A and B are small (r rows or
  columns) and travel whole (one all-gather each per layer), and each rank adds B@A over its own box of W (rows
  under FSDP2, columns too under tensor parallelism).
- `export_adapter`: a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`), loadable by
  `PeftModel.from_pretrained(base, dir)`.
DCP checkpoints hold the adapted model's whole state (base and adapters) and resume it like any other model.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runtime import shard_layout

if TYPE_CHECKING:
    from schemas.plan import LoraPlan

ADAPTER = "default"


def target_regex(patterns: list[str]) -> str:
    """One regex that full-matches a module name iff one fnmatch pattern does (peft's str `target_modules`)."""
    return "|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)


def config(plan: LoraPlan, base_model: str | None = None):
    from peft import LoraConfig

    targets = target_regex(plan.target_modules) if plan.target_modules else "all-linear"
    return LoraConfig(r=plan.dim, lora_alpha=plan.alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                      base_model_name_or_path=base_model, task_type="CAUSAL_LM")


def apply(model: torch.nn.Module, plan: LoraPlan) -> torch.nn.Module:
    """Patch `model` in place with the plan's adapters and freeze everything else."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config(plan), model, adapter_name=ADAPTER)
    return _train_adapters_only(model, plan)


def apply_automodel(model: torch.nn.Module, plan: LoraPlan) -> torch.nn.Module:
    """Patch `model` (nemo-automodel's, unsharded) in place with nemo-automodel's adapters on the plan's targets
    (the linear layers peft's `apply` would take: the plan's full-name wildcards, or every linear layer but the
    output head) and freeze everything else."""
    from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules

    pattern = re.compile(target_regex(plan.target_modules)) if plan.target_modules else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)
             and (pattern.fullmatch(name) if pattern is not None else module is not head)]
    if names:  # exact names: its matcher takes a name equal to a target as it is
        apply_lora_to_linear_modules(model, PeftConfig(target_modules=names, dim=plan.dim, alpha=plan.alpha,
                                                       dropout=0.0, lora_A_init="kaiming"))
    return _train_adapters_only(model, plan)


def _train_adapters_only(model: torch.nn.Module, plan: LoraPlan) -> torch.nn.Module:
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
        trainable += p.requires_grad
    if not trainable:  # Molt's L10; the compiler's LORA002 catches the recipe-side cause
        raise ValueError(f"LoRA target_modules {plan.target_modules} matched no modules")
    model.molt_lora = plan
    return model


@dataclass
class MergedWeight:
    """W + scale·B@A of one adapted linear layer, computed on the fly from (possibly sharded) parameters."""

    base: torch.Tensor
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]
    scale: float

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    def is_floating_point(self) -> bool:
        return True

    def local(self) -> torch.Tensor:
        """This rank's box of the merged weight (a collective when A or B is sharded: every rank of their meshes
        calls it in order)."""
        a = self.lora_a.full_tensor() if hasattr(self.lora_a, "full_tensor") else self.lora_a
        b = self.lora_b.full_tensor() if hasattr(self.lora_b, "full_tensor") else self.lora_b
        w = self.base.to_local() if hasattr(self.base, "to_local") else self.base
        rows, cols = (slice(o, o + n) for o, n in zip(*shard_layout.own_box(self.base), strict=True))
        return (w.float() + self.scale * (b[rows].float() @ a[:, cols].float())).to(w.dtype)


def merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor | MergedWeight]]:
    """(HF name, tensor or merged weight) of every floating parameter the engines load, in module order."""
    merged: dict[str, MergedWeight] = {}
    for mod_name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if hasattr(module, "base_layer") and isinstance(lora_a, torch.nn.ModuleDict) and ADAPTER in lora_a:  # peft
            merged[f"{mod_name}.base_layer.weight"] = MergedWeight(
                module.base_layer.weight, lora_a[ADAPTER].weight, module.lora_B[ADAPTER].weight,
                float(module.scaling[ADAPTER]))
        elif isinstance(lora_a, torch.nn.Linear) and hasattr(module, "scale"):  # nemo-automodel's LinearLoRA
            merged[f"{mod_name}.weight"] = MergedWeight(module.weight, lora_a.weight, module.lora_B.weight,
                                                        float(module.scale))
    out: list[tuple[str, torch.Tensor | MergedWeight]] = []
    for name, p in model.named_parameters():
        if ".lora_" in name or not p.is_floating_point():
            continue
        out.append((name.replace(".base_layer.", "."), merged.get(name, p)))
    return out


def export_adapter(out_dir: str, model: torch.nn.Module, model_path: str, rank: int) -> str | None:
    """Gather the adapters (collective) and, on rank 0, write a PEFT adapter directory."""
    from safetensors.torch import save_file

    tensors = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            tensors[f"base_model.model.{name.replace(f'.{ADAPTER}.', '.')}"] = full.detach().float().cpu().contiguous()
    if rank != 0:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = config(model.molt_lora, base_model=model_path).to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"]) if isinstance(cfg["target_modules"], set) else \
        cfg["target_modules"]
    cfg["peft_type"] = str(getattr(cfg["peft_type"], "value", cfg["peft_type"]))
    cfg["task_type"] = str(getattr(cfg["task_type"], "value", cfg["task_type"]))
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return str(out)
