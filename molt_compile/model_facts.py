"""Model facts: the catalog row for `model.arch`, or what `<model.path>/config.json` says.

Reads config.json with `json` only (no transformers): compiling never imports it. MoE detection copies Molt's
(`models/base.py:45-62`, molt_rules.md F6): an `architectures` entry containing "Moe"/"MoE", or one of
`num_experts`, `n_routed_experts`, `num_local_experts`, `moe_num_experts` > 1. A VLM has a `vision_config`; an MTP
head is `num_nextn_predict_layers` (DeepSeek/GLM) or `mtp_num_hidden_layers` / `num_mtp_layers` > 0.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from molt_compile.paths import path_base
from schemas.catalog import MODELS, ModelSpec, gqa_kv_bytes, model_for_hub_id

if TYPE_CHECKING:
    from molt_compile.source import SourceMap
    from schemas.recipe import MoeDispatcher

ModelFacts = ModelSpec
"""Facts about one model: a catalog row, or a row built from a config.json (its `source` says which)."""

EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
# Architectures (config.json `architectures[0]`) with a custom NVIDIA AutoModel implementation that Molt uses.
# Everything else falls back to HF transformers (H9). Dense Qwen3 is on the HF path in Molt (slurm/rl_qwen3_4b.sh).
NATIVE_ARCHITECTURES = frozenset(
    {
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Glm4MoeForCausalLM",
        "NemotronHForCausalLM",
        "NemotronH_Nano_Omni",
        "NemotronH_Nano_Omni_Reasoning_V3",  # the omni checkpoint's own name (the catalog row's above)
        "GptOssForCausalLM",
    }
)
# Dense architectures nemo-automodel 0.7.0 builds with its own implementation and a registered tensor-parallel plan
# (`optimized_tp_plans.PARALLELIZE_FUNCTIONS`): Molt trains them on HF transformers (above), except at actor tp > 1,
# where they take the automodel backend for nemo-automodel's TP (runtime/models/automodel.py `tensor_parallel`).
TP_ARCHITECTURES = frozenset({"Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM"})
# Custom implementations known to consume THD packing kwargs (H4): DSA/MLA models with tilelang, DeepSeek/Qwen-MoE.
THD_ARCHITECTURES = frozenset(
    {
        "GlmMoeDsaForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)


def resolve_model(model_section: Any, recipe_dir: Path | str | None) -> ModelFacts | None:
    """Facts for a recipe's `model` (or `ref`/`critic`) section: `arch` from the catalog, else `path/config.json`,
    else the catalog row whose hub id `path` is (`Qwen/Qwen3-8B`).

    An `arch` that is not a catalog key falls back to config.json too (rule MODEL004 reports the unknown key).

    `model_section` needs `path` and optionally `arch` (a pydantic section or a dict). None when none works: a hub
    id the catalog does not hold, a cluster path not visible here, or an unreadable config.json (MODEL005).
    """
    arch = _get(model_section, "arch")
    path = _get(model_section, "path")
    if arch and arch in MODELS:
        return MODELS[arch]
    if not path:
        return None
    p = Path(path)
    if not p.is_absolute() and recipe_dir is not None:
        p = Path(recipe_dir) / p
    try:
        stamp = (p / "config.json").stat().st_mtime_ns
    except (OSError, ValueError):  # ValueError: a NUL byte in the path (no such file can exist)
        stamp = None
    found = _from_config_dir(str(p), stamp) if stamp is not None else None
    if found is None:  # a hub id the catalog describes (issue 30: `Qwen/Qwen3-8B` turned the shape checks off)
        row = model_for_hub_id(str(path))
        if row is not None:
            return replace(row, source=f"catalog row {row.key} (hub id {path})")
    return found


def _get(section: Any, key: str) -> Any:
    if isinstance(section, dict):
        return section.get(key)
    return getattr(section, key, None)


@lru_cache(maxsize=64)
def _from_config_dir(path: str, stamp: int) -> ModelFacts | None:
    """Facts from `path/config.json`, cached per modification time `stamp`."""
    config_file = Path(path) / "config.json"
    try:
        cfg = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    facts = facts_from_config(cfg, source=str(config_file))
    try:
        tokenizer = json.loads((Path(path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        tokenizer = None
    limit = _int(tokenizer, "model_max_length") if isinstance(tokenizer, dict) else 0
    if facts.max_positions and limit > 0:
        return replace(facts, max_positions=min(facts.max_positions, limit))  # vLLM takes the smaller
    return facts


def facts_from_config(cfg: dict, source: str = "config.json") -> ModelFacts:
    """A ModelFacts from a parsed HF config.json (VLM configs keep the language model under `text_config`)."""
    text = _text_config(cfg)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else cfg.get("model_type", "unknown")
    layers = _int(text, "num_hidden_layers")
    hidden = _int(text, "hidden_size")
    heads = _int(text, "num_attention_heads") or 1
    kv_heads = _int(text, "num_key_value_heads") or heads
    head_dim = _int(text, "head_dim") or (hidden // heads if heads else 0)
    vocab = _int(text, "vocab_size") or _int(cfg, "vocab_size")
    experts = max((_int(text, k) or _int(cfg, k) for k in EXPERT_KEYS), default=0)
    if experts <= 1 and any("moe" in a.lower() for a in archs):
        experts = 2  # Molt treats the architecture name alone as MoE (F6); the expert count is unknown
    topk = max((_int(text, k) for k in TOPK_KEYS), default=0)
    inter = _int(text, "moe_intermediate_size") if experts > 1 else 0
    inter = inter or _int(text, "intermediate_size")
    mtp = max((_int(text, k) or _int(cfg, k) for k in MTP_KEYS), default=0)
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    total = _estimate_params(layers, hidden, heads, kv_heads, head_dim, inter, vocab, experts, tie)
    active = (
        _estimate_params(layers, hidden, heads, kv_heads, head_dim, inter, vocab, min(topk, experts) or 0, tie)
        if experts > 1
        else total
    )
    return ModelSpec(
        key=arch,
        hf_name=source,
        architecture=arch,
        params_total=total,
        params_active=active,
        layers=layers,
        hidden_size=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab=vocab,
        experts=experts if experts > 1 else 0,
        experts_per_token=topk if experts > 1 else 0,
        is_vlm="vision_config" in cfg,
        has_mtp_head=mtp > 0,
        native_automodel=arch in NATIVE_ARCHITECTURES,
        thd_packing=arch in THD_ARCHITECTURES,
        cp_hook="vision_config" in cfg and arch in NATIVE_ARCHITECTURES,
        kv_bytes_per_token=gqa_kv_bytes(layers, kv_heads, head_dim),
        tie_embeddings=tie,
        max_positions=max_positions(cfg, text),
        estimated=("params_total", "params_active"),
        source=source,
    )


POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""The keys vLLM derives a checkpoint's longest sequence from (the smallest present; `model_max_length` wins)."""
# RoPE types whose `factor` vLLM does not multiply in: their max_position_embeddings is already the scaled length
_SCALED_ROPE = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})


def _text_config(cfg: dict) -> dict:
    """The language model's part of a config.json: a VLM's `text_config`, else the config itself."""
    nested = cfg.get("text_config")
    return nested if isinstance(nested, dict) else cfg


def max_positions(cfg: dict, text: dict | None = None) -> int:
    """The longest sequence vLLM 0.32 accepts for this config.json (`vllm/config/model.py`
    `_get_and_verify_max_len`): the smallest position key of the text config (`model_max_length` when present),
    times the RoPE scaling factor except for types already scaled; gemma3 is never scaled again. 0: no key."""
    text = _text_config(cfg) if text is None else text
    found = [n for k in POSITION_KEYS if (n := _int(text, k)) > 0]
    if not found:
        return 0
    length = _int(text, "model_max_length") or min(found)
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in str(cfg.get("model_type", "")):
        # one dict, or one per layer type (`{"full_attention": {...}, "sliding_attention": {...}}`)
        params = (
            [rope]
            if any(k in rope for k in ("rope_type", "type", "factor"))
            else [v for v in rope.values() if isinstance(v, dict)]
        )
        factor = 1.0
        for rp in params:
            if rp.get("rope_type", rp.get("type", "default")) not in _SCALED_ROPE and isinstance(
                rp.get("factor"), int | float
            ):
                factor = float(rp["factor"])
        length = int(length * factor)
    return length


def _int(d: dict, key: str) -> int:
    v = d.get(key)
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _estimate_params(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    inter: int,
    vocab: int,
    mlp_copies: int,
    tie: bool,
) -> int:
    """Parameter count of a standard decoder (estimate): attention q,k,v,o + gated MLP (× experts) + embeddings."""
    attn = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
    mlp = 3 * hidden * inter * max(1, mlp_copies)
    embed = vocab * hidden * (1 if tie else 2)
    return layers * (attn + mlp + 2 * hidden) + embed + hidden


# ------------------------------------------------------------------ the recipe's models
def _facts(path: str | None, arch: str | None, base: str | None):
    return resolve_model({"path": path, "arch": arch}, base)


def model_facts(recipe: Any, source: SourceMap | None):
    """Facts of the trained model (`model.arch`, else `model.path/config.json`), or None."""
    base = path_base(source, "model.path")
    return _facts(recipe.model.path, recipe.model.arch, str(base) if base else None)


def role_facts(recipe: Any, source: SourceMap | None, role: str):
    """Facts of a role's checkpoint: ref/critic `path` when set and readable, else the policy's (B9)."""
    section = getattr(recipe, role, None) if role != "actor" else None
    own_path = getattr(section, "path", None) if section is not None else None
    if own_path and own_path != recipe.model.path:
        base = path_base(source, f"{role}.path")
        found = _facts(own_path, None, str(base) if base else None)
        if found is not None:
            return found
        if role == "ref":
            return None  # a teacher of unknown architecture: nothing to check
    return model_facts(recipe, source)


def hf_fallback(recipe: Any, facts: Any) -> bool:
    """True when the trained models run on HF transformers: `model.backend: hf`, or no AutoModel custom class (H9)."""
    if recipe.model.backend == "hf":
        return True
    if recipe.actor.mesh.tp > 1 and facts is not None and facts.architecture in TP_ARCHITECTURES:
        return False  # nemo-automodel's own implementation and its TP plan (TP_ARCHITECTURES)
    return facts is not None and not facts.native_automodel


def moe_dispatcher(recipe: Any) -> MoeDispatcher:
    """The MoE token dispatcher, `model.moe_dispatcher` (Molt's env MOLT_MOE_DISPATCHER, B19; MOE015 moves it)."""
    return recipe.model.moe_dispatcher
