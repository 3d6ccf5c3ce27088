"""FSDP roles: world, dp and grad_accum of the actor, reference and critic; colocation and per-rank GPU fractions;
the actor's extras (packing, temperature, dynamic batching, shuffling, LoRA)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from molt_compile.derive.values import Builder

if TYPE_CHECKING:
    from molt_compile.source import SourceMap
    from schemas.recipe import Actor, Critic, FsdpMesh, RlRecipe, SftActor

COLOCATED_GPU_FRACTION = 0.2
"""What each colocated FSDP worker requests (Molt B33): actor + ref + critic = 0.6 of one GPU bundle."""


@dataclass(frozen=True)
class RoleWorld:
    """A role's rank count, with the reason and recipe keys `explain` shows for `<role>.world`."""

    size: int
    reason: str
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class BatchSplit:
    """What splits the batch over a role's ranks: the actor's mesh (every FSDP role shares it) and `train:`'s sizes."""

    mesh: FsdpMesh
    batch: int
    micro: int
    dynamic: bool


def fsdp_role(b: Builder, role: str, world_of: RoleWorld, split: BatchSplit, runs_cp: bool = True) -> None:
    """world, model_parallel, dp and grad_accum of one FSDP role (actor, ref, critic or the SFT model); `runs_cp`:
    the role splits sequences over the mesh's cp (the critic does not: its dp ranks are world / tp)."""
    mesh_key, train_key = "actor.mesh", "train"
    mesh, batch, micro, dynamic = split.mesh, split.batch, split.micro, split.dynamic
    world = world_of.size
    b.add(f"{role}.world", world, world_of.reason, world_of.inputs)
    axes: tuple[str, ...]
    if runs_cp:
        mp, shape, axes = mesh.tp * mesh.cp, f"tp × cp = {mesh.tp * mesh.cp}", ("tp", "cp")
        why = f"tp {mesh.tp} × cp {mesh.cp}; EP is not counted (G2)"
    else:
        mp, shape, axes = mesh.tp, f"tp = {mesh.tp}", ("tp",)
        why = f"tp {mesh.tp}: the {role} runs whole sequences (no cp); EP is not counted (G2)"
    b.add(f"{role}.model_parallel", mp, why, tuple(f"{mesh_key}.{axis}" for axis in axes))
    if world % mp:
        b.add(
            f"{role}.dp",
            None,
            f"world {world} is not divisible by {shape} (G3)",
            (f"{role}.world", f"{role}.model_parallel"),
        )
    else:
        b.add(f"{role}.dp", world // mp, f"world {world} / ({shape})", (f"{role}.world", f"{role}.model_parallel"))
    dp = b.v(f"{role}.dp")
    if role == "actor":
        _device_mesh(b, mesh, world, dp)
    inputs = (f"{train_key}.batch_size", f"{train_key}.micro_batch_size", f"{role}.dp")
    if dynamic:
        b.add(
            f"{role}.grad_accum",
            1,
            "dynamic batching builds microbatches by tokens: one window (B25)",
            ("train.dynamic_batch",),
        )
    elif dp is None:
        b.add(f"{role}.grad_accum", None, "dp is undefined", inputs)
    elif batch % (micro * dp):
        b.add(
            f"{role}.grad_accum",
            None,
            f"batch_size {batch} is not a multiple of micro_batch_size {micro} × dp {dp} = {micro * dp} (G4)",
            inputs,
        )
    else:
        b.add(
            f"{role}.grad_accum",
            batch // (micro * dp),
            f"batch_size {batch} / (micro_batch_size {micro} × dp {dp})",
            inputs,
        )


def _device_mesh(b: Builder, mesh: FsdpMesh, world: int, dp: int | None) -> None:
    """The trainer's meshes as nemo-automodel lays them out (`explain` shows what each rank holds): the world mesh
    (dp_replicate, dp_shard, cp, tp) and, with experts, the (ep_shard, ep) mesh carved out of the same ranks."""
    inputs = ("actor.world", "actor.mesh.tp", "actor.mesh.cp", "actor.mesh.ep", "actor.mesh.dp_replicate")
    if dp is None or dp % mesh.dp_replicate or world % mesh.ep:
        b.add("actor.device_mesh", None, "the mesh sizes do not divide the actor's ranks", inputs)
        return
    layout = f"dp_replicate {mesh.dp_replicate} × dp_shard {dp // mesh.dp_replicate} × cp {mesh.cp} × tp {mesh.tp}"
    if mesh.ep > 1:
        layout += f"; experts: ep_shard {world // mesh.ep} × ep {mesh.ep}"
    b.add(
        "actor.device_mesh",
        layout,
        f"{world} ranks: FSDP2 shards over dp_shard (replicated over dp_replicate), cp splits each sequence, tp each "
        "matrix; each MoE layer's experts split over ep and shard over ep_shard",
        inputs,
    )


def actor_world(a: Actor | SftActor) -> RoleWorld:
    """The actor's world: nodes × GPUs per node (RL and SFT alike)."""
    return RoleWorld(
        a.nodes * a.gpus_per_node,
        f"actor.nodes {a.nodes} × actor.gpus_per_node {a.gpus_per_node}",
        ("actor.nodes", "actor.gpus_per_node"),
    )


def derive_rl_roles(b: Builder, r: RlRecipe, source: SourceMap | None = None) -> None:
    a, t = r.actor, r.train
    split = BatchSplit(a.mesh, t.batch_size, t.micro_batch_size, dynamic=t.dynamic_batch is not None)
    fsdp_role(b, "actor", actor_world(a), split)
    # ref: exists exactly when the section is present (Recipe v1 makes Molt's hidden kl.coef > 0 switch explicit)
    if r.ref is None:
        bare = source is not None and source.is_set("ref")  # `ref:` alone is YAML null: no reference model
        b.add(
            "ref.exists",
            False,
            "`ref:` is empty (YAML null): no reference model" if bare else "no `ref:` section",
            ("ref",),
        )
    else:
        why = "teacher of on_policy_distill" if r.algo.estimator == "on_policy_distill" else "KL reference model"
        b.add("ref.exists", True, f"`ref:` section present ({why})", ("ref",))
        b.add(
            "ref.path",
            r.ref.path or r.model.path,
            "ref.path" if r.ref.path else "ref.path unset: the policy checkpoint (B9)",
            ("ref.path", "model.path"),
        )
        colocated = r.ref.placement == "colocate"
        b.add("ref.colocated", colocated, f"ref.placement is {r.ref.placement}", ("ref.placement",))
        nodes = r.ref.nodes or a.nodes
        gpn = r.ref.gpus_per_node or a.gpus_per_node
        fsdp_role(
            b,
            "ref",
            RoleWorld(
                nodes * gpn,
                f"ref nodes {nodes} × gpus_per_node {gpn} (unset: the actor's)",
                ("ref.nodes", "ref.gpus_per_node", "actor.nodes", "actor.gpus_per_node"),
            ),
            split,
        )
    # critic: Molt builds one exactly for gae (B8); the section only configures it
    if r.algo.estimator != "gae":
        b.add("critic.exists", False, f"estimator {r.algo.estimator} needs no value model", ("algo.estimator",))
    else:
        critic = r.critic if r.critic is not None else default_critic()
        b.add("critic.exists", True, "estimator gae needs a value model (B8)", ("algo.estimator",))
        b.add(
            "critic.path",
            critic.path or r.model.path,
            "critic.path" if critic.path else "critic.path unset: the policy checkpoint (B9)",
            ("critic.path", "model.path"),
        )
        b.add(
            "critic.colocated",
            critic.placement == "colocate",
            f"critic.placement is {critic.placement}",
            ("critic.placement",),
        )
        # the critic's mesh is the actor's tp alone (CriticPlan.mesh): its dp, windows and local batch are its own
        fsdp_role(
            b,
            "critic",
            RoleWorld(b.v("actor.world"), "the critic always has the actor's size (J3)", ("actor.world",)),
            split,
            runs_cp=False,
        )
        local_batch_size(b, "critic", t.batch_size, dynamic=split.dynamic)
        b.add(
            "critic.max_epochs",
            critic.max_epochs or t.max_epochs,
            "critic.max_epochs" if critic.max_epochs else "critic.max_epochs unset: train.max_epochs (B9)",
            ("critic.max_epochs", "train.max_epochs"),
        )
        b.add(
            "critic.value_clip",
            critic.value_clip,
            "critic.value_clip" if r.critic is not None else "no `critic:` section: the schema's default",
            ("critic.value_clip",),
        )
        b.add(
            "critic.freeze_moe_router",
            critic.freeze_moe_router or a.freeze.moe_router,
            "critic.freeze_moe_router or actor.freeze.moe_router (B9)",
            ("critic.freeze_moe_router", "actor.freeze.moe_router"),
        )
    ref_col = b.v("ref.exists") and b.v("ref.colocated")
    critic_col = b.v("critic.exists") and b.v("critic.colocated")
    colocate = bool(ref_col or critic_col)
    if colocate:
        who = " and ".join(n for n, c in (("ref", ref_col), ("critic", critic_col)) if c)
        b.add(
            "fsdp.colocate",
            True,
            f"{who} colocated with the actor: one shared PACK group (B8)",
            ("ref.placement", "critic.placement"),
        )
    else:
        b.add("fsdp.colocate", False, "no ref or critic shares the actor's GPUs", ("ref.placement", "critic.placement"))
    frac = COLOCATED_GPU_FRACTION
    shared = colocate or r.rollout.placement == "colocate"
    b.add(
        "actor.num_gpus",
        frac if shared else 1,
        "colocated: each model (and an engine) takes 0.2 GPU (B33)" if shared else "one whole GPU per rank",
        ("fsdp.colocate", "rollout.placement"),
    )
    for role, col in (("ref", ref_col), ("critic", critic_col)):
        if b.v(f"{role}.exists"):
            b.add(
                f"{role}.num_gpus",
                frac if col else 1,
                "colocated: 0.2 GPU of the actor's bundle (B33)" if col else "its own GPUs, one per rank",
                (f"{role}.colocated",),
            )
    _fsdp_total(b, r, ref_col, critic_col)
    _row_multiple(b)


def default_critic() -> Critic:
    """The critic section a gae recipe without `critic:` gets (its schema defaults; lowering reads the optimizer)."""
    from schemas.recipe import Critic  # only for gae recipes without a critic section

    return Critic()


def _fsdp_total(b: Builder, r: RlRecipe, ref_col: bool, critic_col: bool) -> None:
    if r.eval.only:
        b.add("fsdp.total_gpus", 0, "eval.only builds no FSDP model (J4)", ("eval.only",))
        return
    parts = [f"actor {b.v('actor.world')}"]
    total = b.v("actor.world")
    for role, col in (("ref", ref_col), ("critic", critic_col)):
        if not b.v(f"{role}.exists"):
            continue
        if col:
            parts.append(f"{role} colocated (+0)")
        else:
            parts.append(f"{role} {b.v(f'{role}.world')}")
            total += b.v(f"{role}.world")
    b.add(
        "fsdp.total_gpus",
        total,
        " + ".join(parts) + " (§3.2)",
        ("actor.world", "ref.world", "critic.world", "fsdp.colocate"),
    )


def _row_multiple(b: Builder) -> None:
    worlds = {"actor": b.v("actor.world")}
    worlds |= {role: b.v(f"{role}.world") for role in ("ref", "critic") if b.v(f"{role}.exists")}
    b.add(
        "fsdp.row_multiple",
        math.lcm(*worlds.values()),
        "lcm of the FSDP worlds ("
        + ", ".join(f"{role} {world}" for role, world in worlds.items())
        + "): every group of a step gets equal rows per rank",
        tuple(f"{role}.world" for role in worlds),
    )


def derive_actor_extras(b: Builder, r: RlRecipe) -> None:
    a, t = r.actor, r.train
    # as written: a VLM run with packing is an error (DATA002), not silently unpacked as Molt's RL CLI does
    b.add("actor.packing", a.packing, "actor.packing", ("actor.packing",))
    b.add(
        "actor.temperature",
        r.rollout.temperature,
        "trained models divide logits by rollout.temperature (B17)",
        ("rollout.temperature",),
    )
    mp = a.mesh.tp * a.mesh.cp
    shuffle = mp <= 1 and t.dynamic_batch is None
    b.add(
        "actor.shuffle_microbatches",
        shuffle,
        "only without tp/cp and without dynamic batching (G11)",
        ("actor.mesh.tp", "actor.mesh.cp", "train.dynamic_batch"),
    )
    b.add(
        "actor.micro_batches_by_length",
        shuffle and not b.v("actor.packing"),
        (
            "micro-batches shuffled (G11) and padded: any grouping of a window's rows is one Molt's shuffle could "
            "draw, so the longest rows go together and each micro-batch pads least (same windows, counts and sizes)"
            if shuffle and not b.v("actor.packing")
            else "off: packed micro-batches compute no padding, so they keep rollout order"
            if shuffle
            else "off: Molt keeps micro-batches in order here (no shuffle, G11)"
        ),
        ("actor.shuffle_microbatches", "actor.packing"),
    )
    if t.dynamic_batch is None:
        b.add("actor.dynamic_batch_max_tokens", None, "dynamic batching off", ("train.dynamic_batch",))
    else:
        cap = t.dynamic_batch.max_tokens_per_gpu * mp
        b.add(
            "actor.dynamic_batch_max_tokens",
            cap,
            f"max_tokens_per_gpu {t.dynamic_batch.max_tokens_per_gpu} × cp × tp {mp} (G9)",
            ("train.dynamic_batch.max_tokens_per_gpu", "actor.mesh.tp", "actor.mesh.cp"),
        )
    local_batch_size(b, "actor", t.batch_size, dynamic=t.dynamic_batch is not None)


def local_batch_size(b: Builder, role: str, batch: int, dynamic: bool) -> None:
    """`<role>.local_batch_size`: the rows of one optimizer-step window of a rank under dynamic batching, the batch
    over the role's own dp (None when off)."""
    if not dynamic:
        b.add(f"{role}.local_batch_size", None, "dynamic batching off", ("train.dynamic_batch",))
        return
    dp = b.v(f"{role}.dp")
    b.add(
        f"{role}.local_batch_size",
        None if dp is None else batch // dp,
        "dp undefined" if dp is None else f"batch_size {batch} // dp {dp}; a remainder is dropped (G9)",
        ("train.batch_size", f"{role}.dp"),
    )
