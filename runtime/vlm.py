"""Images in RL rollouts: loading dataset images, the processor, and token/feature alignment.

The contract (Qwen-VL style, what `runtime.tiny_vlm` builds and what vLLM's Qwen2.5-VL expects):
- the chat template renders each image as `<|vision_start|><|image_pad|><|vision_end|>`;
- the processor expands each `<|image_pad|>` to prod(grid_thw) / merge² copies (one per merged patch) and returns
  `pixel_values` (patches x features) and `image_grid_thw` (images x 3);
- the *expanded* ids are what the trainer sees, aligned with the features (`experience.check_image_alignment`);
- vLLM takes the prompt with each run of placeholders collapsed back to one token plus the images, and expands it
  again with the same processor (`collapse_image_runs`), so engine and trainer see the same sequence.

Nemotron-Omni (`runtime/omni_processor.py`) differs in two ways: its grid is `image_grid_hw` (images x 2, no time
axis; `image_grid`), and its processor wraps each image's run in `<img>` ... `</img>`, which the chat template
does not render (`image_run`: what one rendered placeholder becomes).

Dataset images (`data.image_key`) may be PIL images (HF `Image` features decode to them), paths (relative to the
dataset file's directory, else to the working directory), raw bytes, or `{"bytes": ..., "path": ...}` dicts
(an undecoded HF image feature). A prompt's text may mark where images go with `<image>` (geo3k style); otherwise
the images come first in the user turn.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

IMAGE_MARKER = "<image>"


class VlmTruncation(RuntimeError):
    """The context budget would cut through an image's placeholder tokens: the rollout is dropped (`vlm_truncation`,
    Molt's rule: a half image misaligns tokens and features)."""


def load_image(ref: Any, base_dir: Path | None = None):
    """A PIL RGB image from a dataset image reference (see the module docstring)."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return load_image(ref["bytes"], base_dir)
        return load_image(ref["path"], base_dir)
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref)).convert("RGB")
    path = Path(ref)
    if not path.is_absolute() and base_dir is not None and (base_dir / path).is_file():
        path = base_dir / path
    with Image.open(path) as img:
        return img.convert("RGB")


def as_image_list(value: Any) -> list:
    """A row's image column as a list (a single image or path is a list of one; None is empty)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def load_processor(path: str):
    from transformers import AutoProcessor

    from runtime import no_torchvision, omni_processor

    if omni_processor.is_omni_checkpoint(path):  # no auto class in transformers, and a torchvision backend
        return omni_processor.load(path)
    no_torchvision.allow()
    return AutoProcessor.from_pretrained(path)


def messages_with_images(prompt: Any, n_images: int) -> list[dict]:
    """Chat messages whose first user turn has `n_images` image parts: at each `<image>` marker, else first. A prompt
    is text or chat messages (geo3k's: one user turn of text with a `<image>` marker); messages that already hold
    image parts keep their own."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": _image_parts(prompt, n_images)}]
    if any(isinstance(m["content"], list) and any(p.get("type") in ("image", "image_url") for p in m["content"])
           for m in prompt):
        return prompt
    out = [dict(m) for m in prompt]
    for m in out:
        if m["role"] == "user":
            if isinstance(m["content"], str):
                m["content"] = _image_parts(m["content"], n_images)
            break
    return out


def _image_parts(text: str, n_images: int) -> list[dict]:
    if IMAGE_MARKER in text:
        parts: list[dict] = []
        for i, piece in enumerate(text.split(IMAGE_MARKER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        return parts
    return [{"type": "image"}] * n_images + [{"type": "text", "text": text}]


def render(processor, prompt: Any, n_images: int, tools: list | None = None) -> str:
    """The prompt text with one image placeholder per image (the processor's chat template)."""
    return processor.apply_chat_template(messages_with_images(prompt, n_images), tools=tools, tokenize=False,
                                         add_generation_prompt=True)


def encode(processor, text: str, images: list) -> tuple[list[int], dict | None]:
    """Expanded token ids of `text` and the images' model inputs ({pixel_values, image_grid_thw}, None: no image)."""
    if not images:
        return list(processor.tokenizer.encode(text, add_special_tokens=False)), None
    enc = processor(text=[text], images=images, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    key = grid_key(enc)
    mm = {"pixel_values": enc["pixel_values"], key: enc[key]}
    # the processor takes images whose placeholders the text lacks; vLLM then finds no place for them
    if ids.count(image_token_id(processor)) != sum(features_per_image(processor, mm)):
        raise ValueError(f"the rendered prompt holds {text.count(processor.image_token)} image placeholders for its "
                         f"{len(images)} images")
    return ids, mm


GRID_KEYS = ("image_grid_thw", "image_grid_hw")
"""Per image, its patch grid: (t, h, w) for Qwen-VL, (h, w) for Nemotron-Omni."""


def grid_key(mm) -> str:
    """Which of `GRID_KEYS` the processor's output (or a row's image inputs) holds."""
    return GRID_KEYS[0] if GRID_KEYS[0] in mm else GRID_KEYS[1]


def image_grid(mm: dict):
    """A row's (images x 2 or 3) patch grids, whichever processor made them."""
    return mm[grid_key(mm)]


def features_per_image(processor, mm: dict) -> list[int]:
    """Placeholder tokens of each image: its patches over the merge (Qwen-VL) or pixel shuffle (omni), squared."""
    return (image_grid(mm).prod(-1) // merge_size(processor) ** 2).tolist()


def image_run(processor, features: int) -> list[int]:
    """The ids one rendered image placeholder becomes in the processor's output: `features` placeholders, wrapped
    in the omni's `<img>` ... `</img>` (Qwen-VL's template renders its own vision start/end)."""
    run = [image_token_id(processor)] * features
    if getattr(processor, "image_start_token", None) is None:
        return run
    tok = processor.tokenizer
    return [tok.convert_tokens_to_ids(processor.image_start_token), *run,
            tok.convert_tokens_to_ids(processor.image_end_token)]


def join_inputs(a: dict | None, b: dict | None) -> dict | None:
    """Model inputs of two consecutive image lists (a turn's new images after the earlier ones)."""
    import torch

    if a is None or b is None:
        return a if b is None else b
    return {k: torch.cat([a[k], b[k]]) for k in a}


def collapse_image_runs(token_ids: list[int], image_token_id: int,
                        wrapper: tuple[int, int] | None = None) -> list[int]:
    """Each run of consecutive image placeholders as one placeholder: the prompt form vLLM expands itself. With
    `wrapper` (Nemotron-Omni's `<img>`, `</img>` ids: vLLM's processor wraps each run it expands itself) the run's
    wrapper goes too, so that one rendered `<image>` is left, as the chat template rendered it."""
    out: list[int] = []
    for i, tok in enumerate(token_ids):
        if tok == image_token_id and out and out[-1] == image_token_id:
            continue
        if wrapper is not None and (
            (tok == wrapper[0] and i + 1 < len(token_ids) and token_ids[i + 1] == image_token_id)
            or (tok == wrapper[1] and out and out[-1] == image_token_id)
        ):
            continue
        out.append(tok)
    return out


def image_token_id(processor) -> int:
    return int(processor.image_token_id)


def merge_size(processor) -> int:
    return int(processor.image_processor.merge_size)
