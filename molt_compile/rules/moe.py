"""MoE and expert parallelism: EP sizes and groups, dispatchers, the backend that runs experts (molt_rules.md §2.F;
routing replay and MTP are in `routing.py`)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import TP_ARCHITECTURES, model_facts, moe_dispatcher, role_facts
from molt_compile.rules._base import diag, dv, fsdp_roles, role_size_keys, runs_on_hf
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe


def _moe_roles(recipe, derived, source):
    """(role, facts) for each built FSDP role whose checkpoint is MoE, one per distinct architecture."""
    seen = set()
    for role in fsdp_roles(recipe, derived):
        facts = role_facts(recipe, source, role)
        if facts is not None and facts.is_moe and facts.key not in seen:
            seen.add(facts.key)
            yield role, facts


def moe_without_expert_parallel(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    An MoE checkpoint (actor, reference/teacher or critic) with `actor.mesh.ep: 1`.

    ## Why it matters
    AutoModel's custom MoE path needs an expert mesh; Molt raises "MoE models require --fsdp.ep_size > 1" when the
    model is built inside each actor. MoE is detected as Molt does: `Moe`/`MoE` in the architecture name or an
    expert count > 1 in config.json. All FSDP roles share `actor.mesh.ep`.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 1}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    ```

    ## References
    molt_rules.md F6, B24
    """
    ep = recipe.actor.mesh.ep
    for role, facts in _moe_roles(recipe, derived, source):
        if ep == 1 and not runs_on_hf(derived, facts):
            yield diag(
                source,
                "actor.mesh.ep",
                f"{role} model {facts.key} is MoE ({facts.experts} experts) but actor.mesh.ep is 1",
                "set actor.mesh.ep to a divisor of the expert count and of the world (e.g. the GPUs per node)",
                ["model.arch" if role == "actor" else f"{role}.path"],
            )


def moe_with_tensor_parallel(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    An MoE checkpoint with `actor.mesh.tp > 1`.

    ## Why it matters
    nemo-automodel 0.7.0's MoE parallelizer takes tensor parallelism only from a TP plan registered for the model
    class, and registers none for its own MoE implementations ("No safe tensor-parallel plan is registered for custom
    MoE model ..."): the actor would die building its model. Dense models have TP (PAR006, the capability table).

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {tp: 2, ep: 2}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {tp: 1, ep: 4}}
    ```

    ## References
    molt_rules.md F9
    """
    tp = recipe.actor.mesh.tp
    for role, facts in _moe_roles(recipe, derived, source):
        if tp > 1:
            yield diag(
                source,
                "actor.mesh.tp",
                f"{role} model {facts.key} is MoE: AutoModel's MoE parallelizer supports tp 1 only, got {tp}",
                "set actor.mesh.tp: 1 and use ep (and cp for long sequences)",
                ["actor.mesh.ep"],
            )


def experts_not_divisible_by_ep(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The routed-expert count of each MoE checkpoint is divisible by `actor.mesh.ep`.

    ## Why it matters
    Each EP rank holds `experts / ep` experts; AutoModel asserts `n_routed_experts % ep_size == 0` while building
    the model.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    cluster: {nodes: 1, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 6, mesh: {ep: 6}}
    rollout: {engines: 2}
    train: {batch_size: 48}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    cluster: {nodes: 1, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 4, mesh: {ep: 4}}
    rollout: {engines: 4}
    ```

    ## References
    molt_rules.md F9
    """
    ep = recipe.actor.mesh.ep
    for role, facts in _moe_roles(recipe, derived, source):
        if ep > 1 and facts.experts % ep:
            divisors = [d for d in range(2, min(facts.experts, 64) + 1) if facts.experts % d == 0][:6]
            yield diag(
                source,
                "actor.mesh.ep",
                f"{role} model {facts.key} has {facts.experts} routed experts, not divisible by ep {ep}",
                f"choose ep among {', '.join(map(str, divisors))}, …",
                ["model.arch"],
            )


def ep_not_dividing_world(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    For every FSDP role: `dp × cp × tp` (the non-pipeline world) is a multiple of `actor.mesh.ep`.

    ## Why it matters
    The expert mesh unflattens all ranks as `(world / ep, ep)`; AutoModel raises "non_pp_size=… must be a multiple
    of ep_size" in every actor of the group — including a separately sized reference model.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    cluster: {nodes: 1, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 6, mesh: {ep: 4}}
    rollout: {engines: 2}
    train: {batch_size: 48}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    cluster: {nodes: 1, gpus_per_node: 8}
    actor: {nodes: 1, gpus_per_node: 4, mesh: {ep: 4}}
    rollout: {engines: 4}
    ```

    ## References
    molt_rules.md F10, §3.3
    """
    ep = recipe.actor.mesh.ep
    if ep <= 1:
        return
    seen = set()
    for role in fsdp_roles(recipe, derived):
        world = dv(derived, f"{role}.world")
        if world is None or world in seen:
            continue
        seen.add(world)
        if world % ep:
            yield diag(
                source,
                "actor.mesh.ep",
                f"{role} world {world} (dp × cp × tp) is not a multiple of ep {ep}",
                f"choose ep dividing {world}",
                list(role_size_keys(role)),
            )


def moe_on_hf_fallback(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    An MoE checkpoint on the HF transformers path (`model.backend: hf`, or an architecture without an AutoModel
    custom class).

    ## Why it matters
    HF transformers has no expert-parallel dispatch, and the custom MoE path is the only one with EP; Molt forbids
    the HF fallback under EP ("The HF fallback is forbidden under EP") and MoE needs EP.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, backend: hf}
    actor: {mesh: {ep: 4}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, backend: automodel}
    actor: {mesh: {ep: 4}}
    ```

    ## References
    molt_rules.md F7, H9, §2.O item 3
    """
    for role, facts in _moe_roles(recipe, derived, source):
        if runs_on_hf(derived, facts):
            path = "model.backend" if recipe.model.backend == "hf" else "model.arch"
            yield diag(
                source,
                path,
                f"{role} model {facts.key} is MoE, but runs on the HF transformers path, which has no "
                "expert parallelism",
                "set model.backend: automodel (with an architecture AutoModel implements)",
                ["actor.mesh.ep"],
            )


def ep_group_crosses_node(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    On an MoE actor spanning several nodes, each expert-parallel group (`ep` consecutive ranks) stays inside one
    node — `ep` divides the actor's `gpus_per_node` — unless `model.moe_dispatcher: torch` (the default).

    ## Why it matters
    The hybridep/deepep dispatchers (Molt's default) use intra-node NVLink; a peer on another node gives "illegal
    memory access" in the first MoE forward. Molt's GLM-5.2 recipe spans EP256 over 32 nodes only with the torch
    dispatcher (all-to-all over the network).

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, moe_dispatcher: hybridep}
    cluster: {nodes: 3, gpus_per_node: 8}
    actor: {nodes: 2, gpus_per_node: 8, mesh: {ep: 16}}
    rollout: {engines: 8}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, moe_dispatcher: hybridep}
    cluster: {nodes: 3, gpus_per_node: 8}
    actor: {nodes: 2, gpus_per_node: 8, mesh: {ep: 8}}
    rollout: {engines: 8}
    ```

    ## References
    molt_rules.md §3.3, §3.4, B19
    """
    a = recipe.actor
    ep = a.mesh.ep
    facts = model_facts(recipe, source)
    if ep <= 1 or a.nodes <= 1 or (facts is not None and not facts.is_moe):
        return
    if a.gpus_per_node % ep and moe_dispatcher(recipe) != "torch":
        yield diag(
            source,
            "actor.mesh.ep",
            f"ep {ep} consecutive ranks do not fit the {a.gpus_per_node} actor GPUs per node: EP groups span "
            f"nodes, which the {moe_dispatcher(recipe)} dispatcher cannot do (illegal memory access)",
            f"use ep dividing {a.gpus_per_node}, or set model.moe_dispatcher: torch",
            ["actor.gpus_per_node", "actor.nodes", "model.moe_dispatcher"],
        )


def dispatcher_in_env(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `env.MOLT_MOE_DISPATCHER` is set (Molt's way to pick the MoE token dispatcher).

    ## Why it matters
    This runtime takes the dispatcher from the recipe key `model.moe_dispatcher` (default torch), carried by the
    plan; the job env variable is read by nothing here, so a recipe ported from Molt would silently run another
    dispatcher than the one it names.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    env: {MOLT_MOE_DISPATCHER: torch}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, moe_dispatcher: torch}
    ```

    ## References
    molt_rules.md §1 (MOLT_MOE_DISPATCHER), B19
    """
    value = recipe.env.get("MOLT_MOE_DISPATCHER")
    if value is None:
        return
    yield diag(
        source,
        "env.MOLT_MOE_DISPATCHER",
        f"env.MOLT_MOE_DISPATCHER: {value} is Molt's knob, which this runtime does not read; the "
        f"{recipe.model.moe_dispatcher} dispatcher of model.moe_dispatcher would run",
        f"remove it and set model.moe_dispatcher: {value}",
        ["model.moe_dispatcher"],
    )


def expert_parallel_on_dense_model(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.mesh.ep > 1` or `rollout.expert_parallel: true` on a dense model.

    ## Why it matters
    A dense model has no experts to distribute: the setting does nothing except build an unused expert mesh, and it
    usually means the recipe was copied from an MoE one with the model changed.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    rollout: {expert_parallel: true}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    rollout: {expert_parallel: false}
    ```

    ## References
    molt_rules.md B24, I8
    """
    facts = model_facts(recipe, source)
    if facts is None or facts.is_moe:
        return
    if recipe.actor.mesh.ep > 1 and dv(derived, "model.backend") != "hf":  # on the HF path it is an error (PAR004)
        yield diag(
            source,
            "actor.mesh.ep",
            f"actor.mesh.ep {recipe.actor.mesh.ep} on dense model {facts.key}: there are no experts to shard",
            "set actor.mesh.ep: 1",
            ["model.arch"],
        )
    if recipe.kind == "rl" and recipe.rollout.expert_parallel:
        yield diag(
            source,
            "rollout.expert_parallel",
            f"rollout.expert_parallel on dense model {facts.key}: there are no experts to shard",
            "set rollout.expert_parallel: false",
            ["model.arch"],
        )


def tied_embeddings_on_automodel(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A policy that trains on nemo-automodel's own implementation (`model.backend: automodel` on an architecture it
    implements) whose checkpoint ties its input and output embeddings (`tie_word_embeddings: true`).

    ## Why it matters
    nemo-automodel's implementations of every architecture the compiler sends to it (Qwen3-MoE, Qwen3-Next,
    Qwen3.5-MoE, DeepSeek-V3/V3.2, GLM-4.5 and GLM-5 MoE, Nemotron-H, Nemotron Omni, gpt-oss) keep separate
    embeddings and refuse to build a tied checkpoint ("... has separate input and output embeddings and does not
    support tie_word_embeddings=True"): the run would die at trainer start-up. Its dense Qwen2, Qwen3 and Llama, which
    the compiler sends to it at actor tp > 1 only (tensor parallelism), take tied embeddings too.

    ## Example
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8}
    model: {path: ./models/tiny-moe-tied, arch: null}
    actor: {gpus_per_node: 4, mesh: {ep: 4}}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8}
    model: {path: ./models/tiny-moe-mtp, arch: null}
    actor: {gpus_per_node: 4, mesh: {ep: 4}}
    ```

    ## References
    nemo_automodel 0.7.0 `components/models/*/model.py` (`tie_word_embeddings_support = UNTIED_ONLY`);
    molt_rules.md H9
    """
    facts = model_facts(recipe, source)
    tied_ok = facts is not None and facts.architecture in TP_ARCHITECTURES
    if facts is not None and facts.tie_embeddings and dv(derived, "model.backend") != "hf" and not tied_ok:
        yield diag(
            source,
            "model.path",
            f"{facts.key} ties its output embeddings to its input embeddings, which nemo-automodel's implementation "
            "of it refuses",
            "untie them in the checkpoint (its own lm_head.weight), or set model.backend: hf",
            ["model.backend"],
        )
