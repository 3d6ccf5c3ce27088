"""RL placement: the placement groups, the roles and their instances, and the GPU map, in Molt's creation order.

Ray places groups in the order they are created and the order decides fragmentation (`reference/molt_rules.md`
§3.1):

1. rollout engines: one PACK group; mp -> one bundle of tp x dp GPUs per engine (must fit one node); uni/ray ->
   one bundle of 1 GPU per engine GPU (a ray engine's bundles are kept node-grouped per TP group);
2. router (1 CPU);
3. the FSDP group(s): colocated ref/critic share the actor's PACK group (each worker 0.2 GPU, 0.2 CPU); a separate
   ref/critic gets its own PACK group of {GPU 1, CPU 1} bundles;
4. controller, lock, two queues, generator, trainer driver (0 CPU, head node);
5. agent runners, SPREAD, 1 CPU each.

Deliberate differences from Molt: the actor always gets a PACK group (Molt skips it for one GPU per node, so its
ranks land wherever Ray puts them), and the light actors of step 4 request 0 CPU instead of Ray's default (1 CPU to
schedule), so they never hold up placement on a small cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.lower.binpack import PlaceError, Placer, placement_unit
from molt_compile.lower.common import agent_env, bundle, diag, engine_env, instance, ray_options, role_plan
from molt_compile.source import SourceMap
from schemas.plan import PlacementGroupPlan, RolePlan
from schemas.recipe import RlRecipe


@dataclass
class Placement:
    """What placement built: the groups, the roles, the GPU map and the CPUs the fullest node needs."""

    pgs: list[PlacementGroupPlan]
    roles: list[RolePlan]
    gpu_map: list[list[list[str]]]
    cpus_needed: float


def place_rl(r: RlRecipe, d: Derived, source: SourceMap | None) -> tuple[Placement, list[Diagnostic]]:
    c = r.cluster
    on_cpu = d.value("cluster.device") == "cpu"
    g = c.gpus_per_node
    placer = Placer(c.nodes, g, d.value("cluster.cpus_per_node"))
    gpu_map: list[list[list[str]]] = [[[] for _ in range(g)] for _ in range(c.nodes)]
    pgs: list[PlacementGroupPlan] = []
    roles: list[RolePlan] = []
    warnings: list[Diagnostic] = []

    # 1. rollout engines (first, so whole-node mp bundles are not fragmented by 1-GPU bundles); colocated engines
    # go into the actor's bundles once the FSDP group exists (step 3)
    colocated = d.value("rollout.colocated")
    if not colocated:
        roles.append(_place_engines(r, d, placer, gpu_map, pgs, on_cpu))

    # 2. router
    roles.append(_cpu_role("router", "Router", 1, 1.0, placer, on_cpu, "DEFAULT"))

    # 3. FSDP groups
    if not r.eval.only:
        warnings += _place_fsdp(r, d, placer, gpu_map, pgs, roles, on_cpu, source)
    if colocated:
        roles.insert(0, _colocate_engines(r, d, gpu_map, pgs, roles, on_cpu))

    # 4. light actors on the head node; 5. runners
    for name, cls in (
        ("controller", "Controller"),
        ("lock", "EngineLock"),
        ("queue.rollout", "Queue"),
        ("queue.slots", "Queue"),
        ("generator", "Generator"),
    ):
        roles.append(_cpu_role(name, cls, 1, 0.0, placer, on_cpu, "DEFAULT"))
    roles.append(
        _cpu_role(
            "runner", "AgentRunner", d.value("rollout.runners"), 1.0, placer, on_cpu, "SPREAD", env=agent_env(r, d)
        )
    )
    if not r.eval.only:
        roles.append(_cpu_role("trainer", "TrainingDriver", 1, 0.0, placer, on_cpu, "DEFAULT"))
    return Placement(pgs, roles, gpu_map, max(placer.cpu_used) if placer.cpu_used else 0.0), warnings


def _place_engines(r: RlRecipe, d: Derived, placer: Placer, gpu_map: list, pgs: list, on_cpu: bool) -> RolePlan:
    """Engines on GPUs of their own: one PACK group, created first."""
    g = r.cluster.gpus_per_node
    ro = r.rollout
    per_engine = d.value("rollout.gpus_per_engine")
    bundle_devs = d.value("rollout.bundle_gpus")
    n_bundles = d.value("rollout.bundles")
    unit = placement_unit([ro.mesh.tp], g) if bundle_devs == 1 and per_engine > 1 else 1
    placed, _ = placer.place_group("rollout", [(bundle_devs, 0.0)] * n_bundles, unit)
    pgs.append(
        PlacementGroupPlan.model_construct(
            name="rollout",
            strategy="PACK",
            bundles=[bundle(bundle_devs, 0, on_cpu)] * n_bundles,
            bundle_nodes=[n for n, _ in placed],
        )
    )
    per_instance = 1 if bundle_devs > 1 or per_engine == 1 else per_engine
    instances = []
    for i in range(ro.engines):
        idx = list(range(i * per_instance, (i + 1) * per_instance))
        devices = [[placed[b][0], dev] for b in idx for dev in placed[b][1]]
        label = f"rollout.engine[{i}]"
        for n, dev in devices:
            gpu_map[n][dev].append(label)
        instances.append(instance(index=i, label=label, node=devices[0][0], bundle_indices=idx, devices=devices))
    engine_units = d.value("rollout.engine_num_gpus")
    return role_plan(
        name="rollout.engine",
        actor_class="RolloutEngine",
        count=ro.engines,
        num_gpus=engine_units,
        num_cpus=0,
        placement_group="rollout",
        scheduling="placement_group",
        ray_options=ray_options(engine_units, 0, on_cpu),
        instances=instances,
        env=engine_env(r, on_cpu),
    )


def _colocate_engines(r: RlRecipe, d: Derived, gpu_map: list, pgs: list, roles: list, on_cpu: bool) -> RolePlan:
    """Engine i in actor rank i's bundle (rollout.placement: colocate; one GPU per engine, engines <= ranks: the
    placement rules hold that)."""
    actor = next(role for role in roles if role.name == "actor")
    instances = []
    for i in range(r.rollout.engines):
        rank = actor.instances[i]
        label = f"rollout.engine[{i}]"
        for n, dev in rank.devices:
            gpu_map[n][dev].append(label)
        instances.append(
            instance(
                index=i,
                label=label,
                node=rank.node,
                bundle_indices=list(rank.bundle_indices),
                devices=[list(x) for x in rank.devices],
            )
        )
    units = d.value("rollout.engine_num_gpus")
    return role_plan(
        name="rollout.engine",
        actor_class="RolloutEngine",
        count=r.rollout.engines,
        num_gpus=units,
        num_cpus=0,
        placement_group=actor.placement_group,
        scheduling="placement_group",
        ray_options=ray_options(units, 0, on_cpu),
        instances=instances,
        env=engine_env(r, on_cpu),
    )


def _cpu_role(
    name: str,
    cls: str,
    count: int,
    cpus: float,
    placer: Placer,
    on_cpu: bool,
    scheduling: str,
    env: dict[str, str] | None = None,
) -> RolePlan:
    instances = []
    for i in range(count):
        node = placer.place_cpu(cpus, prefer=i if scheduling == "SPREAD" else 0)
        if node is None:
            free = placer.cpu_cap
            raise PlaceError(
                "PLACE103",
                f"{name}[{i}] needs {cpus:g} CPU but every node's {free:g} CPUs are taken "
                f"(FSDP bundles take 1 CPU each, runners and the router 1 each)",
                "lower rollout.runners or raise cluster.cpus_per_node",
            )
        instances.append(instance(index=i, label=f"{name}[{i}]", node=node, bundle_indices=[], devices=[]))
    return role_plan(
        name=name,
        actor_class=cls,
        count=count,
        num_gpus=0,
        num_cpus=cpus,
        placement_group=None,
        scheduling=scheduling,
        ray_options=ray_options(0, cpus, on_cpu),
        instances=instances,
        env=env or {},
    )


def _place_fsdp(
    r: RlRecipe,
    d: Derived,
    placer: Placer,
    gpu_map: list,
    pgs: list,
    roles: list,
    on_cpu: bool,
    source: SourceMap | None,
) -> list[Diagnostic]:
    mesh = r.actor.mesh
    sizes = [mesh.ep, mesh.cp * mesh.tp]
    g = r.cluster.gpus_per_node
    unit = placement_unit(sizes, g)
    warnings: list[Diagnostic] = []
    colocate = d.value("fsdp.colocate")
    members = [("actor", "PolicyWorker")]
    separate: list[tuple[str, str]] = []
    for role, cls in (("ref", "ReferenceWorker"), ("critic", "CriticWorker")):
        if d.value(f"{role}.exists"):
            (members if d.value(f"{role}.colocated") else separate).append((role, cls))
    groups = [("fsdp" if colocate else "actor", members)] + [(role, [(role, cls)]) for role, cls in separate]
    for pg_name, group_roles in groups:
        world = d.value(f"{group_roles[0][0]}.world")
        placed, _ = placer.place_group(pg_name, [(1, 1.0)] * world, unit)
        pgs.append(
            PlacementGroupPlan.model_construct(
                name=pg_name,
                strategy="PACK",
                bundles=[bundle(1, 1, on_cpu)] * world,
                bundle_nodes=[n for n, _ in placed],
            )
        )
        for role, cls in group_roles:
            units = d.value(f"{role}.num_gpus")
            instances = []
            for rank in range(d.value(f"{role}.world")):
                node, devs = placed[rank]
                label = f"{role}.rank[{rank}]"
                gpu_map[node][devs[0]].append(label)
                instances.append(
                    instance(index=rank, label=label, node=node, bundle_indices=[rank], devices=[[node, devs[0]]])
                )
            roles.append(
                role_plan(
                    name=role,
                    actor_class=cls,
                    count=len(instances),
                    num_gpus=units,
                    num_cpus=units,
                    placement_group=pg_name,
                    scheduling="placement_group",
                    ray_options=ray_options(units, units, on_cpu),
                    instances=instances,
                )
            )
        warnings += _split_groups(pg_name, [n for n, _ in placed], sizes, ("EP", "CP x TP"), g, source)
    return warnings


def _split_groups(
    pg: str, nodes: list[int], sizes: list[int], names: tuple[str, ...], g: int, source: SourceMap | None
) -> list[Diagnostic]:
    """PLACE104 for each group kind whose groups could have stayed on one node but did not."""
    out = []
    for size, what in zip(sizes, names, strict=True):
        if size <= 1 or g <= 0 or g % size:
            continue
        split = [i for i in range(0, len(nodes) - size + 1, size) if len(set(nodes[i : i + size])) > 1]
        if split:
            first = split[0]
            out.append(
                diag(
                    "PLACE104",
                    f"{what} group of ranks {first}-{first + size - 1} in `{pg}` spans nodes "
                    f"{sorted(set(nodes[first : first + size]))} ({len(split)} group(s) split) although {size} "
                    f"divides the node size {g}",
                    "give the FSDP group whole nodes: change the engines' footprint so they fill whole nodes",
                    "actor.mesh",
                    source,
                )
            )
    return out
