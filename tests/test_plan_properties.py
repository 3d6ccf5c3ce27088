"""Property tests of the lowering over random legal meshes and cluster shapes (hypothesis).

For every generated recipe: a plan exists exactly when the demand fits the cluster; no device is shared except by
the colocated ranks of one rank index; no node is over its devices or CPUs; every role instance is placed with the
devices it needs; mp engines and EP / CP x TP groups whose size divides the node stay on one node.
"""

from __future__ import annotations

import re
from collections import defaultdict

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from plan_support import rl

from molt_compile.derive import derive
from molt_compile.lower import lower
from schemas.plan import Plan

_LABEL = re.compile(r"^(.+)\[(\d+)\]$")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def recipes(draw):
    g = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, 10))
    actor_gpn = draw(st.sampled_from([d for d in (1, 2, 4, 8) if d <= g]))
    actor_nodes = draw(st.integers(1, nodes))
    world = actor_nodes * actor_gpn
    tp = draw(st.sampled_from(_divisors(world)))
    cp = draw(st.sampled_from(_divisors(world // tp)))
    ep = draw(st.sampled_from(_divisors(world)))
    micro = draw(st.sampled_from([1, 2]))
    # a multiple of the actor's dp, world / (tp x cp), and of gae's critic's, world / tp (it runs no cp)
    batch = micro * (world // tp) * draw(st.integers(1, 3))
    executor = draw(st.sampled_from(["uni", "mp", "ray"]))
    if executor == "uni":
        vmesh = {"tp": 1, "pp": 1, "dp": 1}
    elif executor == "mp":
        vmesh = {"tp": draw(st.sampled_from([1, 2, 4, 8])), "pp": 1, "dp": draw(st.sampled_from([1, 2]))}
    else:
        vmesh = {"tp": draw(st.sampled_from([1, 2, 4, 8, 16])), "pp": draw(st.sampled_from([1, 2])), "dp": 1}
    over = {
        "cluster": {"nodes": nodes, "gpus_per_node": g, "gpu": draw(st.sampled_from(["h100-80gb", "cpu"]))},
        "actor": {"nodes": actor_nodes, "gpus_per_node": actor_gpn, "mesh": {"tp": tp, "cp": cp, "ep": ep}},
        "train": {"batch_size": batch, "micro_batch_size": micro},
        "rollout": {"engines": draw(st.integers(1, 6)), "mesh": vmesh, "executor": executor,
                    "runners": draw(st.integers(1, 4))},
    }
    ref = draw(st.sampled_from([None, "colocate", "separate"]))
    if ref:
        over["ref"] = {"placement": ref}
    if draw(st.booleans()):
        over["algo"] = {"estimator": "gae"}
        over["critic"] = {"placement": draw(st.sampled_from(["colocate", "separate"]))}
    return rl(**over)


def _fits(r, d) -> bool:
    """Independent feasibility: engines go first onto empty nodes, then 1-device bundles fill any free device."""
    c, ro = r.cluster, r.rollout
    capacity = c.nodes * c.gpus_per_node
    if d.value("rollout.executor") == "mp":
        b = ro.mesh.tp * ro.mesh.dp
        if b > c.gpus_per_node or ro.engines > c.nodes * (c.gpus_per_node // b):
            return False
    return d.value("rollout.total_gpus") + d.value("fsdp.total_gpus") <= capacity


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_lowering_invariants(r) -> None:
    d = derive(r)
    plan, diags = lower(r, d)
    assert (plan is not None) == _fits(r, d), [x.message for x in diags]
    event("placed" if plan is not None else "does not fit")
    if plan is None:
        assert diags and {x.code for x in diags} <= {"PLACE101", "PLACE102"}
        return
    g = r.cluster.gpus_per_node
    assert diags == []  # nothing splits when only devices are scarce

    # shape of the map; nothing double-booked except colocated ranks of the same index
    assert len(plan.gpu_map) == r.cluster.nodes and all(len(node) == g for node in plan.gpu_map)
    colocated = {"actor"} | {role for role in ("ref", "critic") if d.value(f"{role}.exists", False)
                             and d.value(f"{role}.colocated")}
    occupied = 0
    for node in plan.gpu_map:
        for labels in node:
            if not labels:
                continue
            occupied += 1
            if len(labels) > 1:
                parsed = [_LABEL.match(x).groups() for x in labels]
                roles = {p[0].removesuffix(".rank") for p in parsed}
                assert roles <= colocated and len({p[1] for p in parsed}) == 1, labels
                assert len(roles) == len(labels)
    assert occupied == plan.cluster.used_gpus == d.value("cluster.used_gpus")

    # every instance placed with the devices it needs, inside the node
    per_engine = d.value("rollout.gpus_per_engine")
    for role in plan.roles:
        assert role.count == len(role.instances)
        for inst in role.instances:
            assert all(0 <= n < r.cluster.nodes and 0 <= dev < g for n, dev in inst.devices)
            if role.name == "rollout.engine":
                assert len(inst.devices) == per_engine
                if d.value("rollout.executor") == "mp":
                    assert len({n for n, _ in inst.devices}) == 1  # an mp engine never leaves its node
                elif r.rollout.mesh.tp <= g and g % r.rollout.mesh.tp == 0:
                    tp = r.rollout.mesh.tp
                    for k in range(0, per_engine, tp):  # each PP stage's TP group on one node
                        assert len({n for n, _ in inst.devices[k:k + tp]}) == 1
            elif role.name in ("actor", "ref", "critic"):
                assert len(inst.devices) == 1

    # CPUs per node within what the cluster offers
    cpu = defaultdict(float)
    for pg in plan.placement_groups:
        for bundle, node in zip(pg.bundles, pg.bundle_nodes, strict=True):
            cpu[node] += bundle.get("CPU", 0.0)
    for role in plan.roles:
        if role.placement_group is None:
            for inst in role.instances:
                cpu[inst.node] += role.ray_options.num_cpus
    assert max(cpu.values()) <= plan.cluster.cpus_per_node + 1e-9

    # groups of consecutive ranks whose size divides the node stay on one node
    mesh = r.actor.mesh
    for role in ("actor", "ref", "critic"):
        if not plan.has_role(role):
            continue
        nodes = [i.node for i in plan.role(role).instances]
        for size in (mesh.ep, mesh.cp * mesh.tp):
            if size > 1 and g % size == 0:
                for k in range(0, len(nodes), size):
                    assert len(set(nodes[k:k + size])) == 1, (role, size, nodes)

    # deterministic, and every field has its declared type (lower builds models without validating them)
    again, _ = lower(r, derive(r))
    assert again.fingerprint == plan.fingerprint
    text = plan.to_json()
    assert Plan.from_json(text).to_json() == text
