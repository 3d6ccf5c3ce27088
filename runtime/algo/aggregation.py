"""Loss aggregation modes over one optimizer step's window (Molt 0.2.1 `--actor.loss_agg_mode`, molt_0_2_1.md §3.2).

A window W is every micro-batch of one optimizer step on every data-parallel rank. Each micro-batch backpropagates
`D · Σ_{i,t} m·ℓ·w_i` (D = dp ranks, which FSDP's gradient *average* divides out again), with a per-row weight w_i
built from the window's global denominators:

| mode                    | w_i                                  | effective objective                    |
|-------------------------|--------------------------------------|----------------------------------------|
| token-mean              | 1 / N_W                              | (1/N_W) Σ_all m·ℓ                      |
| seq-mean-token-mean     | 1 / ((n_i + 1e-8) · S_W), n_i > 0    | (1/S_W) Σ_i mean_t ℓ_i                 |
| prompt-mean-token-mean  | 1 / (max(1, N_g(i)) · P_W)           | (1/P_W) Σ_g (1/N_g) Σ_{i∈g} Σ_t m·ℓ    |

N_W = action tokens in W, n_i = row i's action tokens, S_W = rows in W that have action tokens, N_g = action tokens
of prompt group g in W, P_W = groups with N_g > 0. A "row" is one step-sample (a multi-turn segment counts on its
own); a group is one prompt. The caller sums `WindowStats` over ranks (`merge`) before weighting, so the result does
not depend on how the window was split over micro-batches or ranks. The KL and entropy terms stay token-mean (I17).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "prompt-mean-token-mean")
SEQ_EPS = 1e-8


@dataclass
class WindowStats:
    """The denominators of one window, summable across micro-batches and ranks."""

    tokens: float = 0.0  # N_W
    rows: float = 0.0  # S_W
    group_tokens: dict[int, float] = field(default_factory=dict)  # N_g

    @property
    def prompts(self) -> int:  # P_W
        return sum(1 for n in self.group_tokens.values() if n > 0)


def window_stats(action_mask: Tensor, group_ids: Tensor) -> WindowStats:
    """This rank's share of a window: `action_mask` (B, T) and `group_ids` (B,) of its rows."""
    n = action_mask.float().sum(-1)
    groups: dict[int, float] = {}
    for g, k in zip(group_ids.tolist(), n.tolist(), strict=True):
        groups[int(g)] = groups.get(int(g), 0.0) + k
    return WindowStats(tokens=float(n.sum()), rows=float((n > 0).sum()), group_tokens=groups)


def merge(parts: Iterable[WindowStats]) -> WindowStats:
    """Sum of several ranks' (or micro-batches') stats: the window's global denominators."""
    out = WindowStats()
    for p in parts:
        out.tokens += p.tokens
        out.rows += p.rows
        for g, k in p.group_tokens.items():
            out.group_tokens[g] = out.group_tokens.get(g, 0.0) + k
    return out


def row_weights(mode: str, action_mask: Tensor, group_ids: Tensor, stats: WindowStats) -> Tensor:
    """(B,) the weight w_i of each row's per-token loss sum (zero for rows without action tokens)."""
    n = action_mask.float().sum(-1)
    if mode == "token-mean":
        w = torch.full_like(n, 1.0 / stats.tokens if stats.tokens else 0.0)
    elif mode == "seq-mean-token-mean":
        w = torch.where(n > 0, 1.0 / ((n + SEQ_EPS) * max(stats.rows, 1.0)), torch.zeros_like(n))
    elif mode == "prompt-mean-token-mean":
        per_group = torch.tensor([max(1.0, stats.group_tokens.get(int(g), 0.0)) for g in group_ids.tolist()],
                                 dtype=n.dtype, device=n.device)
        w = 1.0 / (per_group * max(stats.prompts, 1))
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    return torch.where(n > 0, w, torch.zeros_like(w))


def aggregate(loss_mat: Tensor, action_mask: Tensor, weights: Tensor, dp_size: int = 1) -> Tensor:
    """D · Σ_{i,t} m·ℓ·w_i: one micro-batch's share of the window's objective, to backpropagate as is."""
    masked = torch.where(action_mask.bool(), loss_mat, torch.zeros_like(loss_mat))
    return (masked.sum(-1) * weights.to(masked.dtype)).sum() * dp_size
