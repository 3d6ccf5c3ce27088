"""Text rendering of a plan with rich: the roles, a per-node device map, and the key derived values.

The map stays readable at any size: a node is summarised as runs of identical devices (`actor.rank ×8`), and
consecutive nodes with the same summary are one line (`node 4-35  actor.rank ×8  actor 0-255`).
"""

from __future__ import annotations

import re
from typing import Any

from rich.console import ConsoleRenderable, Group
from rich.table import Table
from rich.text import Text

from schemas.plan import Plan

_INDEX = re.compile(r"\[(\d+)\]$")
KEY_DERIVED_RL = (
    "actor.world",
    "actor.dp",
    "actor.grad_accum",
    "ref.exists",
    "critic.exists",
    "fsdp.colocate",
    "rollout.executor",
    "rollout.gpus_per_engine",
    "rollout.total_gpus",
    "fsdp.total_gpus",
    "weight_sync.world_size",
    "rollout.samples_per_step",
    "data.prompt_count",
    "train.steps_per_episode",
    "train.total_steps",
    "eval.every",
    "ckpt.every",
)
KEY_DERIVED_SFT = (
    "actor.world",
    "actor.dp",
    "actor.grad_accum",
    "sft.nnodes",
    "sft.nproc_per_node",
    "data.sample_count",
    "train.steps_per_epoch",
    "train.total_steps",
    "eval.every",
    "ckpt.every",
)


def _role_of(label: str) -> tuple[str, int | None]:
    """`actor.rank[3]` -> ("actor.rank", 3)."""
    m = _INDEX.search(label)
    return (label[: m.start()], int(m.group(1))) if m else (label, None)


def device_pattern(labels: list[str]) -> str:
    """What sits on one device, without indices: `actor.rank+ref.rank`, or `idle`."""
    return "+".join(_role_of(label)[0] for label in labels) if labels else "idle"


def node_summary(devices: list[list[str]]) -> str:
    """Runs of identical device patterns on one node: `rollout.engine ×4, idle ×4`."""
    runs: list[list[Any]] = []
    for labels in devices:
        pattern = device_pattern(labels)
        if runs and runs[-1][0] == pattern:
            runs[-1][1] += 1
        else:
            runs.append([pattern, 1])
    return ", ".join(f"{p} ×{n}" for p, n in runs) if runs else "(no devices)"


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def grouped_nodes(gpu_map: list[list[list[str]]]) -> list[tuple[str, str, str]]:
    """(node range, summary, instance ranges) for runs of consecutive nodes with the same summary."""
    rows: list[tuple[str, str, str]] = []
    start = 0
    n = len(gpu_map)
    summaries = [node_summary(node) for node in gpu_map]
    while start < n:
        end = start
        while end + 1 < n and summaries[end + 1] == summaries[start]:
            end += 1
        indices: dict[str, list[int]] = {}
        for node in gpu_map[start : end + 1]:
            for labels in node:
                for label in labels:
                    role, idx = _role_of(label)
                    if idx is not None:
                        indices.setdefault(role.removesuffix(".rank"), []).append(idx)
        which = "  ".join(f"{role} {_ranges(ix)}" for role, ix in indices.items())
        nodes = f"node {start}" if start == end else f"node {start}-{end}"
        rows.append((nodes, summaries[start], which))
        start = end + 1
    return rows


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def render_summary(plan: Plan, memory: Any = None) -> Group:
    """A rich renderable: header, roles table, grouped device map, key derived values, and the memory estimate per
    GPU (`memory`: a `molt_compile.memory.MemoryReport`, None when there is none)."""
    c = plan.cluster
    unit = "GPU" if c.device == "cuda" else "device slot"
    header = Text.assemble(
        (f"plan {plan.name}", "bold"),
        f" ({plan.kind})  fingerprint {plan.fingerprint[:12]}\n",
        f"cluster: {c.nodes} node(s) × {c.gpus_per_node} {c.gpu} = {c.total_gpus} {unit}s, "
        f"{c.used_gpus} used, {c.total_gpus - c.used_gpus} idle; {c.cpus_per_node} CPUs per node",
    )

    roles = Table(title="roles", title_justify="left")
    for col in ("role", "class", "count", f"{unit}s each", "CPUs each", "placement", "nodes"):
        roles.add_column(col, overflow="fold")
    for r in plan.roles:
        placement = r.placement_group or r.scheduling
        nodes = _ranges([i.node for i in r.instances])
        each = _fmt(r.num_gpus)
        if r.num_gpus == 0 and r.instances and r.instances[0].devices:
            each += f" (+{len(r.instances[0].devices)} workers × 1)"
        roles.add_row(r.name, r.actor_class, str(r.count), each, _fmt(r.num_cpus), placement, nodes)

    devmap = Table(title=f"{unit} map", title_justify="left")
    for col in ("nodes", "devices", "instances"):
        devmap.add_column(col, overflow="fold")
    for nodes, summary, which in grouped_nodes(plan.gpu_map):
        devmap.add_row(nodes, summary, which)

    derived = Table(title="key derived values", title_justify="left")
    for col in ("name", "value", "reason"):
        derived.add_column(col, overflow="fold")
    by_name = {d.name: d for d in plan.derived}
    for name in KEY_DERIVED_RL if plan.kind == "rl" else KEY_DERIVED_SFT:
        if name in by_name:
            derived.add_row(name, _fmt(by_name[name].value), by_name[name].reason)
    parts: list[ConsoleRenderable] = [header, roles, devmap, derived]
    if memory is not None and (memory.fsdp_groups or memory.engine is not None or memory.hf_engine_weights):
        parts.append(_memory_table(memory))
    return Group(*parts)


def _memory_table(memory: Any) -> Table:
    from molt_compile.memory import gib

    table = Table(title="memory per GPU (estimate)", title_justify="left")
    for col in ("GPUs of", "peak", "of", "largest term"):
        table.add_column(col, overflow="fold")
    for group in memory.fsdp_groups:
        biggest = max(group.roles, key=lambda r: r.static + r.activations)
        table.add_row(group.label, gib(group.total), gib(group.capacity), biggest.largest_term)
    if memory.host_per_node:
        capacity = gib(memory.host_capacity) if memory.host_capacity is not None else "unknown"
        table.add_row("host RAM of a node (CPU offload)", gib(memory.host_per_node), capacity, memory.host_breakdown())
    if memory.engine is not None:
        e = memory.engine
        table.add_row(
            "rollout.engine (vLLM share)",
            gib(e.share),
            gib(e.capacity),
            f"weights {gib(e.weights)}, KV cache {gib(max(e.kv_room, 0))}",
        )
    if memory.hf_engine_weights is not None:
        gpu_capacity = memory.fsdp_groups[0].capacity if memory.fsdp_groups else None
        table.add_row(
            "rollout.engine (HF)",
            gib(memory.hf_engine_weights) + " + KV",
            gib(gpu_capacity) if gpu_capacity else "-",
            f"weights {gib(memory.hf_engine_weights)} (the whole model on each engine GPU); KV cache not estimated",
        )
    return table
