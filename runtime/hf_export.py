"""The HF export, streamed: the model's weights leave their shards the way a weight sync sends them, and rank 0
writes them as safetensors files one at a time; no rank ever holds the whole model.

The stream is the weight sync's (`weight_sync.ShardGather` over the backend's `hf_weights`: transformers' names and
layouts, each rank's piece of every placement the backends make, FSDP2, HSDP or expert parallelism at any ep), in
fp32 (the master weights), cut into files of at most `FILE_BYTES` and, within a file, gathered a bucket of
`BUCKET_BYTES` at a time. Rank 0 keeps one file's tensors, turns them into the checkpoint's on-disk format as
`save_pretrained` does (transformers' `revert_weight_conversion`: its fused experts back to one tensor per expert,
file by file as transformers itself does for offloaded models) and writes the file; then the index (when there is
more than one file), the config, the generation config and the tokenizer. A model of one file is written as
`save_pretrained` writes it: `model.safetensors`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from runtime import weight_sync

FILE_BYTES = 4 << 30
"""At most this many bytes of weights per safetensors file (and held by rank 0 at once)."""
BUCKET_BYTES = 256 << 20
"""Bytes gathered per step of the stream (the weight sync's bucket)."""


def write(out_dir: str, sources: list, meta_model, rank: int, device: torch.device) -> None:
    """Stream `sources` (the backend's `hf_weights`) into safetensors files under `out_dir` (collective: every rank
    calls it); `meta_model`: transformers' model of the checkpoint on the meta device, for its on-disk conversions
    (rank 0 only, None elsewhere)."""
    from safetensors.torch import save_file

    metas = weight_sync.wire_metas(sources, "float32")
    gather = weight_sync.ShardGather(sources, metas, dist.group.WORLD, rank, dist.get_world_size(), device,
                                     BUCKET_BYTES)
    files = weight_sync.bucket_layout(metas, FILE_BYTES)
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    weight_map: dict[str, str] = {}
    total = 0
    for name, group in zip(names, files, strict=True):
        tensors = {}
        for part in weight_sync.bucket_layout([metas[i] for i in group], BUCKET_BYTES):
            bucket = [group[j] for j in part]
            buf = torch.empty(sum(metas[i].nbytes for i in bucket), dtype=torch.uint8, device=device) \
                if rank == 0 else None
            gather(bucket, buf)
            if buf is not None:
                tensors.update((n, t.cpu()) for n, t in weight_sync.unpack(buf, metas, bucket, {}))
        if rank != 0:
            continue
        from transformers.core_model_loading import revert_weight_conversion

        tensors = {n: t.contiguous() for n, t in revert_weight_conversion(meta_model, tensors).items()}
        save_file(tensors, str(Path(out_dir) / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    gather._finish_sends()
    if rank == 0 and len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
