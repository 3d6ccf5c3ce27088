"""Weight-sync helpers shared by the engines: resolve what the trainer sent into a complete HF-named state dict."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

LM_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def tied_embeddings(model_path: str) -> bool:
    """`tie_word_embeddings` of a local HF checkpoint (False for hub names we cannot read offline: nothing to add)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


async def resolve_weights(weights: Any) -> dict[str, torch.Tensor]:
    """A state dict, or a Ray ObjectRef to one (Ray resolves top-level ObjectRef arguments itself; a ref nested in a
    list or sent via `ray.put` of a ref arrives unresolved)."""
    import ray

    if isinstance(weights, ray.ObjectRef):
        weights = await weights
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise TypeError(f"update_weights expects a dict name -> torch.Tensor (or an ObjectRef to one), got "
                        f"{type(weights).__name__}")
    return weights


def complete_state_dict(weights: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Drop non-float entries and add `lm_head.weight` when embeddings are tied and the trainer skipped it.

    Molt's refit skips the tied lm_head (molt_rules.md §6.6), but vLLM needs it even when tied: without it the
    engine logs "ParallelLMHead: Failed to load weights" and samples from stale logits (environment.md §3).
    """
    out = {name: t for name, t in weights.items() if t.is_floating_point()}
    if tied and LM_HEAD not in out and EMBED in out:
        out[LM_HEAD] = out[EMBED]
    return out


def save_for_reload(weights: dict[str, torch.Tensor], path: Path) -> None:
    """Write a safetensors file; tensors that share storage (tied embeddings) are copied, which safetensors needs."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    flat = {}
    for name, tensor in weights.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        flat[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(flat, str(path))
