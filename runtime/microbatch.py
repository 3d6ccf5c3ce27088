"""Which rows each FSDP rank trains, in which optimizer-step windows and micro-batches.

Pure index arithmetic on the rows' token lengths (no models, no communication), so every rank and the driver derive
the same plan from the same batch.

- Rank shards: contiguous equal slices (fixed micro-batches), or, under dynamic batching, Molt's sequence-length
  balancing (`reference/molt_rules.md` G6: equal row counts, total tokens balanced): Karmarkar-Karp's largest
  differencing method with equal-size sets, as Molt's `utils/seqlen_balancing.py`.
- Windows: one optimizer step per `window` rows of a rank's shard (micro * accum, or the plan's local batch size
  under dynamic batching, or the whole shard under force_on_policy), so the step windows are the same with and without a token budget.
- Micro-batches: fixed `micro` rows, or first-fit-decreasing bins of at most `max_tokens` tokens (a longer row gets
  a bin of its own). Fixed micro-batches are contiguous rows, or, where the plan says so
  (`TrainerPlan.micro_batches_by_length`: where Molt's replay loader shuffles rows into micro-batches, G11), the
  window's rows grouped by length, longest together, so each micro-batch is padded least. FSDP ranks must run the same number of forwards, so the caller pads every rank's bin count to
  the maximum over ranks with empty micro-batches (`None`).
"""

from __future__ import annotations

import heapq
import itertools

import torch
from torch import Tensor


def rank_rows(lengths: Tensor, world: int, balanced: bool) -> list[Tensor]:
    """Row indices of each rank, equal counts (the batch is a multiple of `world`), each in ascending order."""
    rows = int(lengths.numel())
    per_rank = rows // world
    if not balanced:
        return [torch.arange(r * per_rank, (r + 1) * per_rank) for r in range(world)]
    return [torch.tensor(sorted(m), dtype=torch.long) for m in karmarkar_karp(lengths.tolist(), world)]


def karmarkar_karp(sizes: list[int], k: int) -> list[list[int]]:
    """Indices of `sizes` in k equal-count sets with balanced sums (len(sizes) a multiple of k).

    Each run of k consecutive items in sorted order starts as a partial partition (one item per set); the two
    partitions with the largest spread (max set sum - min set sum) are merged repeatedly, the heaviest set of one with
    the lightest of the other, until one partition is left.
    """
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], i))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for n, start in enumerate(range(0, len(order), k)):
        sets = sorted(((sizes[i], [i]) for i in order[start:start + k]), key=lambda s: -s[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), n, sets))
    tiebreak = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)),
                        key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tiebreak, merged))
        tiebreak += 1
    return [members for _, members in heap[0][2]] if heap else [[] for _ in range(k)]


def window_rows(shard_rows: int, micro: int, accum: int, local_batch: int | None, force_on_policy: bool) -> int:
    """Rows of one optimizer-step window of a rank's shard: micro * accum, the plan's local batch under dynamic
    batching (`local_batch` not None), or the whole shard under force_on_policy (Molt policy_actor.py:277-292,
    critic_actor.py:136-141: one optimizer step per rollout batch)."""
    if force_on_policy:
        return max(shard_rows, 1)
    return micro * accum if local_batch is None else local_batch


def windows(rows: int, window: int) -> list[range]:
    """Optimizer-step windows over a shard of `rows` rows: positions [w0, w0 + window)."""
    return [range(w0, min(w0 + window, rows)) for w0 in range(0, rows, window)]


def fixed_micro_batches(window: range, micro: int) -> list[list[int]]:
    return [list(range(m0, min(m0 + micro, window.stop))) for m0 in range(window.start, window.stop, micro)]


def length_grouped_micro_batches(window: range, lengths: Tensor, micro: int) -> list[list[int]]:
    """The rows of `window` in as many micro-batches of the same sizes as `fixed_micro_batches`, longest rows
    together: the grouping with the fewest padded positions (Σ rows x longest row of each micro-batch).

    Where Molt shuffles rows into micro-batches (G11) any grouping of a window's rows is one it could draw; this one
    computes least padding. Rows never leave their window (an optimizer step trains the same rows), and the losses
    are normalised by the whole window (the global token count, `aggregation.row_weights`' window denominators), so
    the loss and the gradients are the ungrouped ones up to float summation order. The MoE aux losses are per
    micro-batch (Molt B32: coef x aux / micro-batches) and change with the grouping, as under Molt's shuffle.

    Contiguous runs of the rows sorted by length are optimal for given sizes (exchange argument); a window that is
    not a multiple of `micro` has one short micro-batch, placed at whichever run position pads least (the last on a
    tie). Each micro-batch lists its rows in ascending order.
    """
    n = {i: int(lengths[i]) for i in window}
    order = sorted(window, key=lambda i: (-n[i], i))
    sizes = [len(b) for b in fixed_micro_batches(window, micro)]
    if not sizes:
        return []

    def cut(short_at: int) -> list[list[int]]:
        run = [*sizes[:-1]]
        run.insert(short_at, sizes[-1])
        starts = itertools.accumulate(run[:-1], initial=0)
        return [order[s:s + size] for s, size in zip(starts, run, strict=True)]

    def padded(batches: list[list[int]]) -> int:  # each batch's first row is its longest
        return sum(len(b) * n[b[0]] for b in batches)

    places = range(len(sizes)) if sizes[-1] < micro else [len(sizes) - 1]  # equal sizes: one grouping
    best = min(places, key=lambda at: (padded(cut(at)), -at))
    return [sorted(b) for b in cut(best)]


def token_budget_micro_batches(window: range, lengths: Tensor, max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: rows of `window` (positions into `lengths`) into bins of at most `max_tokens` tokens."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(window, key=lambda i: (-int(lengths[i]), i)):
        n = int(lengths[i])
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


def micro_batches(window: range, lengths: Tensor, micro: int, max_tokens: int | None,
                  by_length: bool) -> list[list[int]]:
    if max_tokens is not None:
        return token_budget_micro_batches(window, lengths, max_tokens)
    if by_length:
        return length_grouped_micro_batches(window, lengths, micro)
    return fixed_micro_batches(window, micro)


def pad_to(batches: list[list[int]], count: int) -> list[list[int] | None]:
    """`batches` followed by empty micro-batches up to `count` (the maximum over ranks)."""
    return [*batches, *([None] * (count - len(batches)))]
