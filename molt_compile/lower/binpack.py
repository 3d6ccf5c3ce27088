"""Bin packing: a deterministic model of Ray's PACK strategy, placement groups created in order.

Bundles go first-fit onto nodes in index order, in chunks of the largest EP / CP x TP group size that a node can hold
(node-sorted rank order keeps such groups on one node, `reference/molt_rules.md` §3.3). What cannot be placed raises
PlaceError with a PLACE1xx code, the numbers and a fix; the caller turns it into a diagnostic.
"""

from __future__ import annotations

import math


class PlaceError(Exception):
    def __init__(self, code: str, message: str, help: str):
        super().__init__(message)
        self.code, self.message, self.help = code, message, help


class Placer:
    """Deterministic first-fit bin packing of bundles onto nodes (a model of Ray's PACK in creation order).

    Devices on a node are handed out in index order and never freed, so a node's used devices are a prefix.
    """

    def __init__(self, nodes: int, devices_per_node: int, cpus_per_node: float | None):
        self.nodes, self.g = nodes, devices_per_node
        self.cpu_cap = cpus_per_node
        self.next_dev = [0] * nodes
        self.cpu_used = [0.0] * nodes
        self.first_open = 0
        """Nodes before this index have no free device (an optimisation for 1,000-node clusters)."""

    def _fits(self, n: int, devs: int, cpus: float) -> bool:
        return self.next_dev[n] + devs <= self.g and (
            self.cpu_cap is None or self.cpu_used[n] + cpus <= self.cpu_cap + 1e-9
        )

    def _take(self, n: int, devs: int, cpus: float) -> list[int]:
        start = self.next_dev[n]
        self.next_dev[n] += devs
        self.cpu_used[n] += cpus
        while self.first_open < self.nodes and self.next_dev[self.first_open] >= self.g:
            self.first_open += 1
        return list(range(start, start + devs))

    def _first_fit(self, devs: int, cpus: float) -> int | None:
        start = self.first_open if devs > 0 else 0
        for n in range(start, self.nodes):
            if self._fits(n, devs, cpus):
                return n
        return None

    def place_group(
        self, name: str, bundles: list[tuple[int, float]], unit: int
    ) -> tuple[list[tuple[int, list[int]]], bool]:
        """Place every bundle (devices, cpus) of one group, all or nothing. Returns (node, devices) per bundle and
        whether a chunk of `unit` consecutive bundles had to be split over nodes."""
        saved = (list(self.next_dev), list(self.cpu_used), self.first_open)
        out: list[tuple[int, list[int]]] = []
        split = False
        try:
            for start in range(0, len(bundles), max(1, unit)):
                chunk = bundles[start : start + max(1, unit)]
                need_d = sum(d for d, _ in chunk)
                need_c = sum(c for _, c in chunk)
                node = self._first_fit(need_d, need_c) if len(chunk) > 1 else None
                if node is not None:
                    for d, c in chunk:
                        out.append((node, self._take(node, d, c)))
                    continue
                split = split or len(chunk) > 1
                for d, c in chunk:
                    node = self._first_fit(d, c)
                    if node is None:
                        raise self._failure(name, len(out), len(bundles), d, c)
                    out.append((node, self._take(node, d, c)))
        except PlaceError:
            self.next_dev, self.cpu_used, self.first_open = saved
            raise
        return out, split

    def _failure(self, name: str, index: int, total: int, devs: int, cpus: float) -> PlaceError:
        if devs > self.g:
            return PlaceError(
                "PLACE101",
                f"placement group `{name}`: a bundle needs {devs} devices but a node has "
                f"{self.g}; Ray would wait forever",
                "use the ray executor for engines that span nodes, or lower tp x dp",
            )
        if self.cpu_cap is not None and cpus > self.cpu_cap:
            return PlaceError(
                "PLACE101",
                f"placement group `{name}`: a bundle needs {cpus:g} CPUs but a node has {self.cpu_cap:g}",
                "raise cluster.cpus_per_node",
            )
        free = [self.g - d for d in self.next_dev]
        free_total = sum(free)
        return PlaceError(
            "PLACE102",
            f"placement group `{name}` does not fit: bundle {index} of {total} needs "
            f"{devs} device(s) + {cpus:g} CPU and no node has room ({free_total} device(s) free in "
            f"total{_free_summary(free)})",
            "add nodes, use fewer/smaller engines, or colocate the ref/critic with the actor",
        )

    def place_cpu(self, cpus: float, prefer: int = 0) -> int | None:
        """A CPU-only actor: `prefer` first, then the next nodes round-robin."""
        for k in range(self.nodes):
            n = (prefer + k) % self.nodes
            if self.cpu_cap is None or self.cpu_used[n] + cpus <= self.cpu_cap + 1e-9:
                self.cpu_used[n] += cpus
                return n
        return None


def _free_summary(free: list[int]) -> str:
    nonzero = [f"node {i}: {f}" for i, f in enumerate(free) if f]
    if not nonzero:
        return ""
    shown = ", ".join(nonzero[:4]) + (", ..." if len(nonzero) > 4 else "")
    return f"; {shown}"


def placement_unit(group_sizes: list[int], devices_per_node: int) -> int:
    """Bundles placed together so that groups of consecutive ranks stay on one node when they can.

    A size that divides the node keeps its groups whole; a multiple of the node size asks for whole nodes; a size
    below the node that does not divide it keeps its groups whole only by leaving devices idle; larger sizes cannot
    be aligned and are ignored. The unit is the lcm of those. When that exceeds the node, the sizes that divide the
    node win (those are the groups PLACE104 warns about), else the largest size.
    """
    g = devices_per_node
    parts = []
    for s in group_sizes:
        if s <= 1 or g <= 0:
            continue
        if s <= g:
            parts.append(s)
        elif s % g == 0:
            parts.append(g)
    if not parts:
        return 1
    unit = math.lcm(*parts)
    if unit <= g:
        return unit
    dividing = [s for s in parts if g % s == 0]
    return math.lcm(*dividing) if dividing else max(parts)
