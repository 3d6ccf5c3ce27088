"""FSDP2 / AutoModel mesh rules (molt_rules.md §2.G, §2.H, §3.3)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import TP_ARCHITECTURES, model_facts
from molt_compile.rules._base import diag, dv, fsdp_roles, role_size_keys
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe


def pipeline_parallel_trainer(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.mesh.pp > 1`.

    ## Why it matters
    Molt's trainers are not pipeline-parallel aware; the RL and SFT CLIs and the FSDP strategy all raise
    `NotImplementedError`.

    ## Example
    ```yaml
    actor: {mesh: {pp: 2}}
    ```

    ## Use instead
    ```yaml
    actor: {mesh: {pp: 1, tp: 2}}
    ```

    ## References
    molt_rules.md G1
    """
    pp = recipe.actor.mesh.pp
    if pp > 1:
        yield diag(
            source,
            "actor.mesh.pp",
            f"actor.mesh.pp {pp}: Molt's trainers support only pp 1",
            "set actor.mesh.pp: 1 and shard with tp, cp or ep instead",
        )


def world_not_divisible_by_model_parallel(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Every FSDP role's world (`nodes × gpus_per_node`) is divisible by `tp × cp × pp`.

    ## Why it matters
    dp = world / (tp × cp) must be an integer; AutoModel raises "world_size must be divisible by
    (tp_size * cp_size * pp_size)" when the mesh is built inside each Ray actor.

    ## Example
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4, mesh: {tp: 3}}
    ```

    ## Use instead
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4, mesh: {tp: 2}}
    train: {batch_size: 64}
    ```

    ## References
    molt_rules.md G3, G2
    """
    m = recipe.actor.mesh
    unit = m.tp * m.cp * m.pp
    path = "actor.mesh.cp" if m.cp > 1 else "actor.mesh.tp" if m.tp > 1 else "actor.mesh.pp"
    seen = set()
    for role in fsdp_roles(recipe, derived):
        world = dv(derived, f"{role}.world")
        if world is None or world in seen or world % unit == 0:
            continue
        seen.add(world)
        yield diag(
            source,
            path,
            f"{role} world {world} is not divisible by tp {m.tp} × cp {m.cp} × pp {m.pp} = {unit}",
            f"choose tp × cp dividing {world}, or change {role_size_keys(role)[1]}",
            list(role_size_keys(role)),
        )


def model_parallel_group_crosses_node(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    On a role that spans several nodes, each TP×CP group (tp·cp consecutive ranks) stays inside one node:
    `tp·cp` divides the role's `gpus_per_node`.

    ## Why it matters
    TP and CP exchange activations on every layer; a group that straddles nodes runs that traffic over the network
    instead of NVLink. It works (Molt's GLM-5.2 recipe runs CP16 over two 8-GPU nodes on purpose) but is slow,
    so it should be a decision: suppress with `ignore: {PAR003: "reason"}`.

    ## Example
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {nodes: 2, gpus_per_node: 6, mesh: {cp: 4, ep: 4}}
    rollout: {engines: 4}
    train: {batch_size: 48}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {nodes: 2, gpus_per_node: 4, mesh: {cp: 4, ep: 4}}
    rollout: {engines: 8}
    train: {batch_size: 64}
    ```

    ## References
    molt_rules.md §3.3, §3.4
    """
    a = recipe.actor
    group = a.mesh.tp * a.mesh.cp
    if a.nodes > 1 and group > 1 and a.gpus_per_node % group:
        yield diag(
            source,
            "actor.mesh.cp" if a.mesh.cp > 1 else "actor.mesh.tp",
            f"tp × cp = {group} consecutive ranks do not fit the {a.gpus_per_node} actor GPUs per node: "
            "some TP/CP groups span two nodes",
            f"use tp × cp dividing {a.gpus_per_node}",
            ["actor.gpus_per_node", "actor.nodes"],
        )


def hf_fallback_with_model_parallel(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A model on the HF transformers path (`model.backend: hf`, or an architecture without an AutoModel custom class)
    with `tp > 1`, `cp > 1`, or (dense model) `ep > 1`. MoE on the HF path is MOE005. At `tp > 1` a dense Qwen2,
    Qwen3 or Llama takes the automodel backend unless `model.backend: hf` says otherwise (PAR008).

    ## Why it matters
    The HF fallback has no TP/CP plan of AutoModel's custom models (Molt's README: "text + flash_attention_2 +
    packing only — no CP / EP / TP"). Molt's code rejects EP on HF when each actor builds its model ("The HF
    fallback is forbidden under EP"); TP/CP fail or silently misbehave later.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, backend: hf}
    actor: {mesh: {tp: 2}}
    train: {batch_size: 64}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {mesh: {tp: 1}}
    ```

    ## References
    molt_rules.md H9, F7, Appendix A item 8
    """
    facts = model_facts(recipe, source)
    if dv(derived, "model.backend") != "hf":
        return
    why = (
        "model.backend is hf"
        if recipe.model.backend == "hf"
        else f"{facts.architecture} has no AutoModel custom implementation"
    )
    axes = ("tp", "cp") if facts is not None and facts.is_moe else ("tp", "cp", "ep")
    for axis in axes:
        size = getattr(recipe.actor.mesh, axis)
        if size > 1:
            yield diag(
                source,
                f"actor.mesh.{axis}",
                f"actor.mesh.{axis} {size} on the HF transformers fallback ({why}), which has no TP/CP/EP",
                f"set actor.mesh.{axis}: 1 and scale with data parallelism",
                ["model.backend", "model.arch"],
            )


def critic_with_sequence_parallel(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.sequence_parallel: true` when a critic is built (estimator gae).

    ## Why it matters
    The critic reuses the actor's FSDP settings, and its value head is not sequence-parallel-safe: Molt asserts
    when the critic actor is constructed.

    ## Example
    ```yaml
    algo: {estimator: gae}
    critic: {placement: colocate}
    actor: {sequence_parallel: true}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: gae}
    critic: {placement: colocate}
    actor: {sequence_parallel: false}
    ```

    ## References
    molt_rules.md H10, B9
    """
    if recipe.actor.sequence_parallel and dv(derived, "critic.exists", recipe.algo.estimator == "gae"):
        yield diag(
            source,
            "actor.sequence_parallel",
            "actor.sequence_parallel is shared with the critic (gae), whose value head is not sequence-parallel-safe",
            "set actor.sequence_parallel: false",
            ["algo.estimator"],
        )


def dp_replicate_does_not_split_dp(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.mesh.dp_replicate` (HSDP) divides the actor's data-parallel size `dp = world / (tp × cp)` and leaves at
    least two ranks to shard over (`dp / dp_replicate > 1`).

    ## Why it matters
    HSDP lays the data-parallel ranks out as (dp_replicate, dp_shard); AutoModel raises "dp_size must be a multiple
    of dp_replicate_size" or "dp_replicate_size … must be less than dp_size since DDP usecase is not supported by
    FSDP2" when the mesh is built inside each Ray actor.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-4B, arch: qwen3-4b}
    actor: {nodes: 1, gpus_per_node: 4, mesh: {dp_replicate: 3}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-4B, arch: qwen3-4b}
    actor: {nodes: 1, gpus_per_node: 4, mesh: {dp_replicate: 2}}
    ```

    ## References
    molt_rules.md §3.3 (AutoModel's mesh order)
    """
    replicate = recipe.actor.mesh.dp_replicate
    dp = dv(derived, "actor.dp")
    if replicate == 1 or dp is None or (dp % replicate == 0 and dp // replicate > 1):
        return
    yield diag(
        source,
        "actor.mesh.dp_replicate",
        f"actor.mesh.dp_replicate {replicate} does not split the actor's {dp} data-parallel ranks into replicas "
        "of two or more shards",
        f"choose a divisor of {dp} below it, or actor.mesh.dp_replicate: 1",
        list(role_size_keys("actor")),
    )


def tensor_parallel_without_a_plan(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.mesh.tp > 1` on the automodel backend for a dense architecture for which nemo-automodel registers no
    tensor-parallel plan (its plans: Qwen2, Qwen3 and Llama, `model_facts.TP_ARCHITECTURES`; MoE models are MOE002,
    the HF path PAR004).

    ## Why it matters
    The trainer's tensor parallelism is nemo-automodel's dense parallelizer with the plan it registers for the model
    class (`optimized_tp_plans`); without one it falls back to a generic llama-style plan that does not know the
    architecture's layers (Nemotron-H's Mamba mixers), which this project has not run.

    ## Example
    ```yaml
    model: {path: ./models/tiny-dense-native, arch: null, attn: sdpa}
    actor: {mesh: {tp: 2}}
    ```

    ## Use instead
    ```yaml
    model: {path: ./models/tiny-dense-native, arch: null, attn: sdpa}
    actor: {mesh: {tp: 1}}
    ```

    ## References
    nemo_automodel 0.7.0 `components/distributed/optimized_tp_plans.py` (PARALLELIZE_FUNCTIONS); molt_rules.md H9
    """
    facts = model_facts(recipe, source)
    tp = recipe.actor.mesh.tp
    if tp == 1 or facts is None or facts.is_moe or dv(derived, "model.backend") != "automodel":
        return
    if facts.architecture not in TP_ARCHITECTURES:
        yield diag(
            source,
            "actor.mesh.tp",
            f"actor.mesh.tp {tp}: nemo-automodel registers no tensor-parallel plan for {facts.architecture}",
            "set actor.mesh.tp: 1 and scale with data parallelism (tensor parallelism: "
            + ", ".join(sorted(TP_ARCHITECTURES))
            + ")",
            ["model.arch", "model.path"],
        )


def automodel_asked_runs_on_hf(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `model.backend: automodel` written in the recipe (or `--set`) for an architecture that nemo-automodel has no
    custom implementation of, so the plan trains it on HF transformers anyway (the derived `model.backend` is `hf`).

    ## Why it matters
    The recipe says one backend and the job runs another: nemo-automodel's own layers, dispatchers, LoRA and
    parallelizers are not what trains, and nothing but `molt-compile explain` would say so. Molt prints the same
    at model build time (H9); here it is said before the job is submitted. Left unset, the backend is derived
    silently (the default `automodel` means "where it exists").

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, backend: automodel}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, backend: hf}
    ```

    ## References
    molt_rules.md H9; molt_compile/derive/cluster.py `derive_backend`
    """
    if recipe.model.backend != "automodel" or not source.is_set("model.backend"):
        return
    if dv(derived, "model.backend") != "hf":
        return
    facts = model_facts(recipe, source)
    name = facts.key if facts is not None else recipe.model.path
    yield diag(
        source,
        "model.backend",
        f"model.backend: automodel, but {name} has no nemo-automodel custom implementation: the plan trains it on "
        "HF transformers (Molt H9)",
        "set model.backend: hf to say what runs, or use an architecture nemo-automodel implements "
        "(`molt-compile catalog models`)",
        ["model.arch", "model.path"],
    )
