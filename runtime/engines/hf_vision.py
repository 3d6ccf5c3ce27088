"""Images in the hf rollout engine: a Qwen-VL style model's prefill with its images, as the trainer's forward sees it.

A request's prompt ids arrive expanded (one `<|image_pad|>` per merged patch, `runtime.vlm`), with the
conversation's images in placeholder order. At submit the image processor turns the images into `pixel_values` /
`image_grid_thw` (the same processor the runners and the trainer use); at prefill the vision tower's features replace
the placeholders' embeddings and the prompt gets the model's 3-D (temporal, height, width) rope positions
(`get_rope_index`). After the prompt every position is text, so decode keeps the 1-D cache position plus the row's
rope delta (max rope position + 1 - prompt length), like transformers' own generate.
"""

from __future__ import annotations

import torch


class VisionPrefill:
    """The processor's images -> model inputs, and a prefill batch's embeddings and rope positions."""

    def __init__(self, model, processor):
        self.model = model  # the image-text-to-text model: `.model` has the vision tower and `get_rope_index`
        self.image_processor = processor.image_processor
        self.image_token_id = int(processor.image_token_id)

    def encode(self, images: list) -> dict:
        out = self.image_processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def inputs(self, ids: torch.Tensor, lens: list[int], mms: list[dict | None]):
        """(inputs_embeds (B, W, H), position_ids (3, B, W), rope deltas (B,)) of right-padded prompts `ids`; rows
        whose `mms` entry is None are text (their positions the plain ones, delta 0)."""
        dev = ids.device
        b, width = ids.shape
        embeds = self.model.get_input_embeddings()(ids)
        positions = torch.arange(width, device=dev).view(1, 1, width).repeat(3, b, 1)
        deltas = torch.zeros(b, dtype=torch.long, device=dev)
        rows = [row for row, mm in enumerate(mms) if mm is not None]
        if not rows:
            return embeds, positions, deltas
        grids = torch.cat([mms[row]["image_grid_thw"] for row in rows]).to(dev)
        pixels = torch.cat([mms[row]["pixel_values"] for row in rows]).to(dev)
        per_image = self.model.model.get_image_features(pixels, grids).pooler_output  # one tensor per image
        first = 0
        for row in rows:
            n_images = len(mms[row]["image_grid_thw"])
            feats = torch.cat(per_image[first:first + n_images])
            grid = grids[first:first + n_images]
            first += n_images
            row_ids = ids[row:row + 1, :lens[row]]
            mask = row_ids[0] == self.image_token_id
            if int(mask.sum()) != feats.shape[0]:  # the runners' encode and ours disagree: never generate from it
                raise ValueError(f"prompt has {int(mask.sum())} image placeholders, its images {feats.shape[0]} "
                                 "features")
            embeds[row, :lens[row]][mask] = feats.to(embeds.dtype)
            pos, delta = self.model.model.get_rope_index(row_ids, mm_token_type_ids=mask.int().unsqueeze(0),
                                                         image_grid_thw=grid)
            positions[:, row, :lens[row]] = pos[:, 0]
            deltas[row] = int(delta.view(-1)[0])
        return embeds, positions, deltas
