"""Where each rank's piece of a sharded parameter lies in the whole tensor: what the weight sync's gather
(`weight_sync.ShardGather`) reads from which rank, for any placement the model backends make.

A DTensor is a grid of boxes over its mesh: each mesh dim placed `Shard(d)` cuts dim d as torch.chunk does (equal
ceil-sized chunks, the tail short or empty: DTensor's and FSDP2's uneven split), left to right, and a `Replicate`
mesh dim copies the box. The placements met here: FSDP2's Shard(0) over dp; HSDP's (Replicate, Shard(0)) over
(dp_replicate, dp_shard); nemo-automodel's experts Shard(0) over ep, and with ep below the ranks its FSDP2
Shard(1) over ep_shard as well ((ep_shard, ep) mesh: (Shard(1), Shard(0))). One copy of each box is read, from the
rank at coordinate 0 of every Replicate dim; a plain tensor is whole on every rank and read from rank 0.
Tensor parallelism adds nemo-automodel's column / row shards (Shard(0) / Shard(1) over tp) under FSDP2's
`_StridedShard` over dp ((dp, tp) mesh: FSDP2 cuts the tp rank's piece again, so the tp cut comes first: a strided
shard is applied after the plain ones that cut the same dim, whose sizes multiply to its split factor), and
parameters FSDP2 shards over the dp ranks alone (the norms: one mesh per tp coordinate, each holding a whole copy;
the copy on rank 0's mesh is read). `Partial` is not a box: refused, with the placement.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """One rank's box of a tensor: `rank` in the gather group (the mesh's global rank: the group is the trainer's
    world), `offset` and `shape` in the engine's layout."""

    rank: int
    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def run(self, whole: tuple[int, ...]) -> tuple[int, int] | None:
        """(first element, elements) when the box is one contiguous run of the whole tensor's row-major order (a
        Shard(0) piece), else None."""
        cut = [d for d in range(len(whole)) if self.shape[d] != whole[d]]
        if cut and any(self.shape[d] != 1 for d in range(cut[-1])):
            return None  # not 1 wide in a dim before its last cut one: strided
        strides = [math.prod(whole[d + 1:]) for d in range(len(whole))]
        return sum(o * s for o, s in zip(self.offset, strides, strict=True)), math.prod(self.shape)

    def view(self, whole: torch.Tensor) -> torch.Tensor:
        """The box inside `whole` (the full tensor's view), to copy the piece into."""
        return whole[tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))]


def pieces(p, world: int) -> list[Piece]:
    """The non-empty boxes of `p` (a parameter, or an engine view of one: `.base` and `.local()`, its dims 1 and 2
    swapped when it says `swapped`), one per box, in mesh order. `world`: the gather group's size; a mesh over
    fewer ranks is refused (its coordinates would not name every rank the same way on each)."""
    base = p.base if hasattr(p, "local") else p
    placements = getattr(base, "placements", None)
    shape = tuple(base.shape)
    if placements is None:
        boxes = [Piece(0, (0,) * len(shape), shape)]
    else:
        mesh = base.device_mesh
        if world % mesh.size():
            raise NotImplementedError(f"weight sync: a parameter placed over {mesh.size()} of {world} ranks "
                                      f"({mesh.mesh_dim_names}); the gather reads meshes tiling the group")
        # a mesh over part of the group holds a whole copy (the others hold the same): rank 0's mesh is read
        boxes = _grid(shape, tuple(placements), mesh) if 0 in mesh.mesh else []
    if getattr(p, "swapped", False):  # the engine's layout swaps dims 1 and 2 (transformers' fused experts)
        boxes = [Piece(b.rank, _swap(b.offset), _swap(b.shape)) for b in boxes]
    return [b for b in boxes if math.prod(b.shape)]


def own_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, shape) of this rank's box of `t` in the whole tensor (a plain tensor: the whole of it)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return (0,) * t.dim(), tuple(t.shape)
    mesh = t.device_mesh
    box = _box(0, tuple(mesh.get_coordinate()), tuple(mesh.shape), tuple(placements), tuple(t.shape))
    return box.offset, box.shape


@functools.lru_cache(maxsize=4096)
def _grid(shape: tuple[int, ...], placements: tuple, mesh) -> list[Piece]:
    """The boxes of one copy of a tensor over `mesh` (a model's layers share a few shapes and meshes: computed once
    per process, not per parameter and sync: a mesh of hundreds of ranks has as many boxes)."""
    return [_box(int(mesh.mesh[coord]), coord, tuple(mesh.shape), placements, shape)
            for coord in itertools.product(*(range(n) for n in mesh.shape))
            if not any(pl.is_replicate() and c for pl, c in zip(placements, coord, strict=True))]


def _box(rank: int, coord: tuple[int, ...], mesh_shape: tuple[int, ...], placements, shape: tuple[int, ...]) -> Piece:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    offset, size = [0] * len(shape), list(shape)
    cuts = list(zip(placements, coord, mesh_shape, strict=True))
    # a strided shard (FSDP2 over a tensor-parallel cut) cuts what the plain shards of its dim left
    for placement, c, n in sorted(cuts, key=lambda cut: isinstance(cut[0], _StridedShard)):
        if placement.is_replicate():
            continue
        if not isinstance(placement, Shard | _StridedShard):
            raise NotImplementedError(f"weight sync: placement {tuple(placements)} (Shard and Replicate only)")
        d = placement.dim
        if isinstance(placement, _StridedShard):
            before = math.prod(m for p, _, m in cuts if type(p) is Shard and p.dim == d)
            if placement.split_factor != before:
                raise NotImplementedError(f"weight sync: placement {tuple(placements)} (a strided shard after "
                                          "the plain ones of its dim only)")
        chunk = -(-size[d] // n)
        start = min(c * chunk, size[d])
        offset[d] += start
        size[d] = max(0, min(chunk, size[d] - start))
    return Piece(rank, tuple(offset), tuple(size))


def _swap(t: tuple[int, ...]) -> tuple[int, ...]:
    return (t[0], t[2], t[1], *t[3:])
