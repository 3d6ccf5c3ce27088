"""Routing replay (R3) and multi-token prediction (MTP) on MoE models (molt_rules.md §2.F, §3.3)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag
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
