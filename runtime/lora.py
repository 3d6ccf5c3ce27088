"""LoRA adapters through peft (Molt 0.2.1 `actor.lora`, molt_0_2_1.md §3.7), for the RL trainer and SFT alike.

- `apply`: peft's `inject_adapter_in_model` patches the plan's targets in place (the HF model keeps its own module
  tree, so FSDP2 wraps its decoder layers and the chunked log-prob method attaches as for full fine-tuning); only
  the adapters train. `lora_B` starts at zero, so step 0 is the base model. Targets are the plan's fnmatch
  wildcards on full module names (one regex, which peft full-matches), or every linear layer but `lm_head`.
- `merged_weights`: what the engines get at each weight sync: every adapted base weight as W + scale·B@A, under its
  plain HF name, the adapter tensors themselves left out. On FSDP2 shards this stays local: W and B are both
  row-sharded over `out` the same way, so W_r + scale·B_r@A needs only A whole (one small all-gather per layer).
- `export_adapter`: a PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`), loadable by
  `PeftModel.from_pretrained(base, dir)`.
DCP checkpoints hold the adapted model's whole state (base and adapters) and resume it like any other model.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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
        """This rank's rows of the merged weight (a collective when A is sharded: every rank calls it in order)."""
        a = self.lora_a.full_tensor() if hasattr(self.lora_a, "full_tensor") else self.lora_a
        b = self.lora_b.to_local() if hasattr(self.lora_b, "to_local") else self.lora_b
        w = self.base.to_local() if hasattr(self.base, "to_local") else self.base
        return (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)


def merged_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor | MergedWeight]]:
    """(HF name, tensor or merged weight) of every floating parameter the engines load, in module order."""
    merged: dict[str, MergedWeight] = {}
    for mod_name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A") and ADAPTER in getattr(module, "lora_A", {}):
            merged[f"{mod_name}.base_layer.weight"] = MergedWeight(
                module.base_layer.weight, module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight,
                float(module.scaling[ADAPTER]))
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
