"""`molt-compile diff A B`: what differs between two recipes once resolved, and how their plans differ.

Compared, in order: the resolved recipes (after `extends`, `--set` and defaults; every leaf key), the plans'
clusters and GPU use, roles (count, devices and CPUs each, placement), placement groups, the device map (per
node, as `render_plan` summarises it), every derived value, and the fingerprints. Pure: takes two
`CompileResult`s, returns text lines.
"""

from __future__ import annotations

import json
from typing import Any

from molt_compile.render_plan import grouped_nodes

_MISSING = "<absent>"


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _show(value: Any) -> str:
    if value is _MISSING:
        return _MISSING
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _compare(section: str, a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    lines = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _MISSING), b.get(key, _MISSING)
        if va != vb:
            lines.append(f"  {key}: {_show(va)} -> {_show(vb)}")
    return [f"{section}:"] + lines if lines else []


def _recipe_values(result: Any) -> dict[str, Any]:
    if result.recipe is None:
        return {}
    return _flatten(result.recipe.model_dump(mode="json", by_alias=True))


def _role_values(plan: Any) -> dict[str, Any]:
    out = {}
    for r in plan.roles:
        out[r.name] = f"{r.count} × ({r.num_gpus:g} dev, {r.num_cpus:g} CPU) {r.placement_group or r.scheduling}"
    return out


def _cluster_values(plan: Any) -> dict[str, Any]:
    c = plan.cluster
    return {
        "nodes": c.nodes,
        "gpus_per_node": c.gpus_per_node,
        "gpu": c.gpu,
        "device": c.device,
        "total_gpus": c.total_gpus,
        "used_gpus": c.used_gpus,
        "idle_gpus": c.total_gpus - c.used_gpus,
        "cpus_per_node": c.cpus_per_node,
    }


def _pg_values(plan: Any) -> dict[str, Any]:
    out = {}
    for pg in plan.placement_groups:
        shapes = sorted({json.dumps(b, sort_keys=True) for b in pg.bundles})
        out[pg.name] = f"{pg.strategy} {len(pg.bundles)} bundles {' '.join(shapes)}"
    return out


def _map_values(plan: Any) -> dict[str, Any]:
    out = {}
    for n, node in enumerate(plan.gpu_map):
        out[f"node {n:>5}"] = " | ".join("+".join(labels) if labels else "idle" for labels in node)
    return out


def _derived_values(result: Any) -> dict[str, Any]:
    if result.derived is None:
        return {}
    return {dv.name: dv.value for dv in result.derived.values()}


def diff_results(a: Any, b: Any) -> tuple[list[str], bool]:
    """Lines describing how B differs from A, and whether they differ (True: different, False: equal).

    Equal means: the same resolved recipe values and the same plan fingerprint (or neither has a plan).
    """
    name_a = getattr(a.source, "root_file", None) or "A"
    name_b = getattr(b.source, "root_file", None) or "B"
    lines: list[str] = [f"--- {name_a}", f"+++ {name_b}"]
    lines += _compare("recipe", _recipe_values(a), _recipe_values(b))
    lines += _compare("derived", _derived_values(a), _derived_values(b))
    pa, pb = a.plan, b.plan
    if pa is None or pb is None:
        for tag, res in (("A", a), ("B", b)):
            if res.plan is None:
                errors = sum(1 for d in res.diagnostics if d.severity == "error")
                lines.append(f"plan {tag}: none ({errors} error(s))")
    else:
        lines += _compare("cluster", _cluster_values(pa), _cluster_values(pb))
        lines += _compare("roles", _role_values(pa), _role_values(pb))
        lines += _compare("placement groups", _pg_values(pa), _pg_values(pb))
        map_a, map_b = grouped_nodes(pa.gpu_map), grouped_nodes(pb.gpu_map)
        if map_a != map_b:
            lines.append("device map:")
            lines += [f"  - {n}: {s}" for n, s, _ in map_a if (n, s) not in {(x, y) for x, y, _ in map_b}]
            lines += [f"  + {n}: {s}" for n, s, _ in map_b if (n, s) not in {(x, y) for x, y, _ in map_a}]
            if len(lines) and lines[-1] == "device map:":
                lines += _compare("  per device", _map_values(pa), _map_values(pb))[1:]
    fa = getattr(pa, "fingerprint", None)
    fb = getattr(pb, "fingerprint", None)
    recipe_same = _recipe_values(a) == _recipe_values(b)
    plans_same = fa == fb
    if fa != fb:
        lines.append(f"fingerprint: {fa or 'none'} -> {fb or 'none'}")
    changed = not (recipe_same and plans_same)
    lines.append("plans differ" if changed else "no differences: the recipes resolve to the same plan")
    return lines, changed


def diff_values(a: Any, b: Any) -> tuple[dict[str, dict[str, list[Any]]], bool]:
    """The changes of `diff_results` as data: {section: {key: [value in A, value in B]}} (None: absent), and
    whether the recipes differ. `molt-compile diff --format json` prints it."""
    pairs = [("recipe", _recipe_values(a), _recipe_values(b)), ("derived", _derived_values(a), _derived_values(b))]
    if a.plan is not None and b.plan is not None:
        pairs += [
            ("cluster", _cluster_values(a.plan), _cluster_values(b.plan)),
            ("roles", _role_values(a.plan), _role_values(b.plan)),
            ("placement groups", _pg_values(a.plan), _pg_values(b.plan)),
            ("device map", _map_values(a.plan), _map_values(b.plan)),
        ]
    sections = {
        name: {k: [va.get(k), vb.get(k)] for k in sorted(va.keys() | vb.keys()) if va.get(k) != vb.get(k)}
        for name, va, vb in pairs
    }
    sections = {name: changes for name, changes in sections.items() if changes}
    changed = bool(sections) or getattr(a.plan, "fingerprint", None) != getattr(b.plan, "fingerprint", None)
    return sections, changed
