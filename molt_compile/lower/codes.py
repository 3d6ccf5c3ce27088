"""The lowering's own diagnostics (PLACE1xx): what per-node placement cannot do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlaceCode:
    code: str
    name: str
    doc: str
    severity: str = "error"


PLACE_CODES: tuple[PlaceCode, ...] = (
    PlaceCode(
        "PLACE100",
        "cannot-lower",
        """A value the plan needs could not be derived (for example dp when the world
size is not divisible by tp x cp, or no agent). The rule that explains why is reported too; fix that first.""",
    ),
    PlaceCode(
        "PLACE101",
        "bundle-larger-than-node",
        """One Ray bundle needs more GPUs than any node has: an mp or uni
vLLM engine (tp x dp GPUs in one bundle) or a role on nodes with too few GPUs. Ray would wait forever for the
placement group (Molt I6/I7). Use the ray executor for engines that span nodes, lower tp x dp, or use bigger nodes.""",
    ),
    PlaceCode(
        "PLACE102",
        "cluster-full",
        """A placement group does not fit in what the groups created before it left
free. Groups are placed in Molt's order (engines, then the FSDP groups), first-fit per node; the message gives the
GPUs needed and free per node. Add nodes, fewer engines, or colocate the ref/critic.""",
    ),
    PlaceCode(
        "PLACE103",
        "cpus-exhausted",
        """A CPU-only actor (router, agent runner) finds no node with a free CPU
after the FSDP bundles (1 CPU each) took theirs. Lower rollout.runners or raise cluster.cpus_per_node.""",
    ),
    PlaceCode(
        "PLACE104",
        "group-split-across-nodes",
        """An EP or CP x TP group of consecutive ranks lands on two nodes
although its size divides the node size: earlier groups left a node partly used. Intra-node dispatch (hybridep,
deep_ep) across nodes fails with illegal memory access (§3.3). Give the FSDP group whole nodes (fewer or
differently sized engines).""",
        "warning",
    ),
    PlaceCode(
        "PLACE105",
        "sft-layout-exceeds-cluster",
        """The SFT torchrun layout (actor.nodes x actor.gpus_per_node)
needs more nodes or GPUs per node than the cluster has.""",
    ),
)
PLACE_CODE_NAMES = {c.code: c.name for c in PLACE_CODES}
