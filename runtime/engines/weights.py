"""Facts about the served checkpoint that the engines' weight loading needs."""

from __future__ import annotations

import json
from pathlib import Path


def tied_embeddings(model_path: str) -> bool:
    """`tie_word_embeddings` of a local HF checkpoint (False for hub names we cannot read offline: nothing to add)."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def image_token_id(model_path: str) -> int:
    """The image placeholder id of a local VLM checkpoint (`image_token_id` in config.json)."""
    return int(json.loads((Path(model_path) / "config.json").read_text())["image_token_id"])


def merge_size(model_path: str) -> int:
    """Vision patches merged per placeholder token, per side: Qwen-VL's `vision_config.spatial_merge_size`,
    Nemotron-Omni's pixel shuffle (1 / `downsample_ratio`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if "spatial_merge_size" in config["vision_config"]:
        return int(config["vision_config"]["spatial_merge_size"])
    return round(1 / config["downsample_ratio"])


def image_wrapper_ids(model_path: str) -> tuple[int, int] | None:
    """The ids of the tokens a VLM's processor wraps each image run in (Nemotron-Omni's `<img>`, `</img>`; None:
    Qwen-VL's processors wrap nothing, its chat template renders the vision start and end)."""
    from runtime import omni_processor

    if not omni_processor.is_omni_checkpoint(model_path):
        return None
    processor = omni_processor.load(model_path)
    tok = processor.tokenizer
    return tok.convert_tokens_to_ids(processor.image_start_token), tok.convert_tokens_to_ids(processor.image_end_token)
