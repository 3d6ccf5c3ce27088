"""GPU counts and role shapes against the cluster (molt_rules.md §2.J, §3.2).

These rules use only derived counts. The per-node bin packing of every placement group (Ray PACK order, CPUs,
groups split across nodes) is modelled by `lower/` (PLACE1xx), which runs only when no rule reported an error.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.catalog import GPUS
from schemas.recipe import RlRecipe, SftRecipe


def gpus_exceed_cluster(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The GPUs of all roles — FSDP groups (a colocated ref/critic adds none) plus rollout engines
    (`engines × tp × pp × dp`) — fit in `cluster.nodes × cluster.gpus_per_node`.

    ## Why it matters
    Molt checks this only after the vLLM engines are created, and without it Ray placement deadlocks forever.

    ## Example
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {engines: 6}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {engines: 12}
    ```

    ## References
    molt_rules.md J1, J4, §3.2
    """
    idle = dv(derived, "cluster.idle_gpus")
    if idle is None or idle >= 0:
        return
    used, total = dv(derived, "cluster.used_gpus"), dv(derived, "cluster.total_gpus")
    c = recipe.cluster
    if recipe.kind == "sft":
        what = f"the SFT world needs {used} GPUs"
    else:
        what = (
            f"FSDP roles need {dv(derived, 'fsdp.total_gpus')} GPUs + rollout {recipe.rollout.engines} engines × "
            f"{dv(derived, 'rollout.gpus_per_engine')} = {dv(derived, 'rollout.total_gpus')} GPUs = {used}"
        )
    need_nodes = -(-used // c.gpus_per_node) if c.gpus_per_node else used
    yield diag(
        source,
        "cluster.nodes",
        f"{what} > cluster {c.nodes} × {c.gpus_per_node} = {total} GPUs",
        f"set cluster.nodes: {need_nodes}, or use fewer engines / a smaller actor",
        ["actor.gpus_per_node", "rollout.engines"] if recipe.kind == "rl" else ["actor.gpus_per_node"],
    )


def role_wider_than_cluster(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Each FSDP role's shape fits the cluster per node: `gpus_per_node <= cluster.gpus_per_node` and
    `nodes <= cluster.nodes` (actor, separate ref, SFT model).

    ## Why it matters
    A role's ranks are placed node by node; a role asking for 8 GPUs per node on 4-GPU nodes cannot be placed even
    when the total GPU count fits, and Ray waits forever.

    ## Example
    ```yaml
    cluster: {nodes: 3, gpus_per_node: 4}
    actor: {nodes: 1, gpus_per_node: 8}
    rollout: {engines: 4}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 3, gpus_per_node: 4}
    actor: {nodes: 2, gpus_per_node: 4}
    rollout: {engines: 4}
    ```

    ## References
    molt_rules.md J5, §3.1, §3.3
    """
    c = recipe.cluster
    roles = [("actor", recipe.actor.nodes, recipe.actor.gpus_per_node)]
    if recipe.kind == "rl" and dv(derived, "ref.exists") and not dv(derived, "ref.colocated"):
        ref = recipe.ref
        roles.append(
            (
                "ref",
                (ref.nodes if ref else None) or recipe.actor.nodes,
                (ref.gpus_per_node if ref else None) or recipe.actor.gpus_per_node,
            )
        )
    for role, nodes, gpn in roles:
        if gpn > c.gpus_per_node:
            yield diag(
                source,
                f"{role}.gpus_per_node",
                f"{role}.gpus_per_node {gpn} > cluster.gpus_per_node {c.gpus_per_node}",
                f"spread the {nodes * gpn} GPUs over more nodes (e.g. nodes "
                f"{-(-nodes * gpn // max(c.gpus_per_node, 1))}, gpus_per_node {c.gpus_per_node})",
                ["cluster.gpus_per_node"],
            )
        if nodes > c.nodes:
            yield diag(
                source,
                f"{role}.nodes",
                f"{role}.nodes {nodes} > cluster.nodes {c.nodes}",
                f"set cluster.nodes to at least {nodes}",
                ["cluster.nodes"],
            )


def colocated_role_size_mismatch(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A colocated reference model (`ref.placement: colocate`) sets `nodes`/`gpus_per_node` different from the actor's.

    ## Why it matters
    Colocated roles share the actor's placement group, rank for rank, so their sizes must be equal; Molt asserts
    "num_nodes and num_gpus_per_node must match when colocating the actor and ref model".

    ## Example
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k2, use_loss: true}}
    ref: {placement: colocate, gpus_per_node: 2}
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k2, use_loss: true}}
    ref: {placement: colocate}
    ```

    ## References
    molt_rules.md J2, B33
    """
    ref = getattr(recipe, "ref", None)
    if ref is None or ref.placement != "colocate":
        return
    for key in ("nodes", "gpus_per_node"):
        own, actor = getattr(ref, key), getattr(recipe.actor, key)
        if own is not None and own != actor:
            yield diag(
                source,
                f"ref.{key}",
                f"ref.{key} {own} differs from actor.{key} {actor}, but a colocated ref shares the actor's GPUs",
                f"remove ref.{key} (colocated roles take the actor's size), or set ref.placement: separate",
                [f"actor.{key}", "ref.placement"],
            )


def colocated_engines_exceed_ranks(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    With `rollout.placement: colocate`, every engine takes one actor rank's GPU: each engine is one GPU
    (`rollout.mesh` tp × pp × dp = 1), there are at most as many engines as actor ranks, and there is a trainer
    (not `eval.only`).

    ## Why it matters
    A colocated engine lives in its actor rank's bundle; an engine wider than one GPU, or more engines than ranks,
    has no bundle to go to, and Ray would wait for it forever.

    ## Example
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 1, gpu: h200}
    actor: {nodes: 1, gpus_per_node: 1}
    rollout: {engine: hf, engines: 2, placement: colocate}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 1, gpu: h200}
    actor: {nodes: 1, gpus_per_node: 1}
    rollout: {engine: hf, engines: 1, placement: colocate}
    ```

    ## References
    DESIGN.md (weight sync: CUDA IPC when trainer and engine share a GPU); molt_rules.md B33
    """
    if recipe.kind != "rl" or recipe.rollout.placement != "colocate":
        return
    ro = recipe.rollout
    per_engine = dv(derived, "rollout.gpus_per_engine")
    ranks = dv(derived, "actor.world")
    if recipe.eval.only:
        yield diag(
            source,
            "rollout.placement",
            "rollout.placement: colocate shares the actor's GPUs, but eval.only builds no actor",
            "set rollout.placement: separate for an evaluation-only run",
            ["eval.only"],
        )
    elif per_engine is not None and per_engine > 1:
        yield diag(
            source,
            "rollout.placement",
            f"a colocated engine takes one actor rank's GPU, but each engine needs {per_engine} "
            f"(rollout.mesh tp × pp × dp)",
            "set rollout.mesh to tp 1, pp 1, dp 1, or rollout.placement: separate",
            ["rollout.mesh"],
        )
    elif ranks is not None and ro.engines > ranks:
        yield diag(
            source,
            "rollout.engines",
            f"{ro.engines} colocated engines but the actor has {ranks} ranks (one engine per rank's GPU)",
            f"set rollout.engines: {ranks} or fewer, or rollout.placement: separate",
            ["rollout.placement"],
        )


def unknown_gpu_type(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `cluster.gpu` is a key of the GPU catalog (`schemas/catalog.py`) or `cpu`.

    ## Why it matters
    The GPU type gives the memory every estimate is checked against and the node's CPU count; a typo would
    silently skip those checks.

    ## Example
    ```yaml
    cluster: {gpu: h100}
    ```

    ## Use instead
    ```yaml
    cluster: {gpu: h100-80gb}
    ```

    ## References
    molt_rules.md J5; schemas/catalog.py
    """
    gpu = recipe.cluster.gpu
    if gpu not in GPUS:
        import difflib  # a did-you-mean only: not imported by every compile

        close = difflib.get_close_matches(gpu, GPUS, n=1, cutoff=0.3)
        yield diag(
            source,
            "cluster.gpu",
            f"cluster.gpu {gpu!r} is not in the GPU catalog",
            (f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(GPUS)}",
        )


def idle_gpus(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    GPUs of the cluster that no role uses.

    ## Why it matters
    Idle GPUs are paid for and do nothing (Molt's omni3 recipe leaves 8 of 32 idle by default). If it is on purpose
    (a node kept for debugging), say so: `ignore: {PLACE007: "reason"}`.

    ## Example
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {engines: 4}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {engines: 4}
    ```

    ## References
    molt_rules.md J1, §5.3 (omni3 24/32)
    """
    idle = dv(derived, "cluster.idle_gpus")
    if idle is not None and idle > 0:
        used, total = dv(derived, "cluster.used_gpus"), dv(derived, "cluster.total_gpus")
        yield diag(
            source,
            "cluster.nodes",
            f"{idle} of {total} GPUs are idle (roles use {used})",
            'shrink the cluster, add engines, or suppress with ignore: {PLACE007: "why"}',
            ["cluster.gpus_per_node"],
        )
