"""Images in SFT rows (`data.image_key`, VLM SFT): a conversation with images to token ids, loss mask and the
images' model inputs (`runtime/sft_data.py` calls it per row, `runtime/sft.py` feeds the inputs to the forward).

The images join the first user turn as image parts (at its `<image>` markers, else before its text: the RL
prompts' rule, `runtime/vlm.py`). The reply mask is found on the conversation rendered with one placeholder per
image (`sft_data.encode_conversation`); the processor then expands each placeholder to one token per merged patch
(Nemotron-Omni's wraps them in `<img>` ... `</img>`: `vlm.image_run`) and returns the pixel values and grids, and
the mask is expanded with it (placeholders are never supervised). The expanded ids must equal the rendered ids with
each placeholder replaced by its image's run, else the features would land on the wrong tokens: the row is refused
(`SftError`). A row cut by `max_len` through an image's placeholders is dropped (`vlm_truncation`, Molt's rule for
rollouts: a half image misaligns tokens and features; so is a row whose image lies wholly beyond the cut); one with
more than `max_images_per_prompt` images is dropped (`too_many_images`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime import vlm


class ImageMismatch(ValueError):
    """The processor's expanded image tokens do not line up with the rendered conversation."""


def encode(processor, messages: list[dict], refs: list, base_dir: Path | None, max_len: int, max_images: int,
           render: Callable[[list[dict]], Any]):
    """(ids, loss mask, images' model inputs or None) of a row, or the reason it is dropped (`too_many_images`,
    `vlm_truncation`, None: no reply token within `max_len`). `render`: the conversation's ids and loss mask
    without a length cut (`sft_data.encode_conversation`), or None."""
    if len(refs) > max_images:
        return "too_many_images"
    images = [vlm.load_image(ref, base_dir) for ref in refs]
    messages = vlm.messages_with_images(messages, len(images))
    rendered = render(messages)
    if rendered is None:
        return None
    if not images:
        ids, mask = rendered.input_ids[:max_len], rendered.loss_mask[:max_len]
        return (ids, mask, None) if any(mask) else None
    ids, mm = vlm.encode(processor, processor.tokenizer.apply_chat_template(messages, tokenize=False), images)
    image_id = vlm.image_token_id(processor)
    per_image = vlm.features_per_image(processor, mm)
    expected, mask, seen = [], [], 0
    for tok, m in zip(rendered.input_ids, rendered.loss_mask, strict=True):
        if tok == image_id:
            if seen == len(per_image):
                raise ImageMismatch(f"the conversation renders more image placeholders than its {len(images)} images")
            run = vlm.image_run(processor, per_image[seen])
            expected += run
            mask += [0] * len(run)
            seen += 1
        else:
            expected.append(tok)
            mask.append(m)
    if ids != expected or seen != len(per_image):
        raise ImageMismatch("the processor's expanded image placeholders do not line up with the rendered "
                            "conversation (the chat template and the processor disagree on the image token)")
    if image_id in ids[max_len:]:  # an image cut, or wholly cut off while its features stay: misaligned
        return "vlm_truncation"
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return None
    return ids, mask, mm


def image_refs(row: dict, image_key: str) -> list[Any]:
    return vlm.as_image_list(row.get(image_key))
