"""Rollout sampling settings beyond the engines' own limits (SAMP)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def min_new_tokens_beyond_cap(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.min_new_tokens` above `rollout.max_new_tokens`, or (no cap) not below `data.max_len`.

    ## Why it matters
    A turn stops at its cap whatever its minimum says, so a minimum above the cap never holds; vLLM refuses such a
    request outright (`min_tokens` must not exceed `max_tokens`). Without a cap, a turn has at most
    `data.max_len` minus its prompt tokens to generate.

    ## Example
    ```yaml
    rollout: {max_new_tokens: 128, min_new_tokens: 256}
    ```

    ## Use instead
    ```yaml
    rollout: {max_new_tokens: 256, min_new_tokens: 256}
    ```

    ## References
    vLLM `SamplingParams.min_tokens`; issue 29 (fixed-length responses for the throughput benchmark)
    """
    ro = recipe.rollout
    low, cap = ro.min_new_tokens, ro.max_new_tokens
    if cap is not None and low > cap:
        yield diag(
            source,
            "rollout.min_new_tokens",
            f"rollout.min_new_tokens {low} is above rollout.max_new_tokens {cap}: a turn stops at its cap",
            f"set rollout.min_new_tokens to at most {cap}",
            ["rollout.max_new_tokens"],
        )
    elif cap is None and low >= recipe.data.max_len:
        yield diag(
            source,
            "rollout.min_new_tokens",
            f"rollout.min_new_tokens {low} leaves no room for the prompt in data.max_len {recipe.data.max_len}",
            f"set rollout.min_new_tokens below {recipe.data.max_len}",
            ["data.max_len"],
        )


def min_new_tokens_in_training(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.min_new_tokens > 0` in a run that trains (not `eval.only`).

    ## Why it matters
    The engines ban every end-of-sequence token until a turn has `min_new_tokens` tokens, so the rollouts are not
    samples of the policy the trainer scores: a response the policy would have ended is made to go on. Nothing
    accounts for it: the rollout log-probs are the engine's (raw, or renormalized over the tokens left), importance
    correction and the KL see one token at a time, and the reward judges text the policy would not have written. It
    is what a throughput benchmark wants (`min_new_tokens` = `max_new_tokens`: every response full length, a stable
    tokens/s), and a deliberate choice elsewhere (keeping a collapsing policy from empty answers).

    ## Example
    ```yaml
    rollout: {max_new_tokens: 256, min_new_tokens: 256}
    ```

    ## Use instead
    ```yaml
    rollout: {max_new_tokens: 256}
    ```

    ## References
    vLLM `SamplingParams.min_tokens`; issue 29 (fixed-length responses for the throughput benchmark)
    """
    low = recipe.rollout.min_new_tokens
    if low and not recipe.eval.only:
        yield diag(
            source,
            "rollout.min_new_tokens",
            f"rollout.min_new_tokens {low} bans end-of-sequence for the first {low} tokens of every turn: the "
            "rollouts are not samples of the policy being trained, and no log-prob or correction accounts for it",
            "remove rollout.min_new_tokens, or keep it on purpose (a throughput benchmark) with "
            'ignore: {SAMP002: "<why>"}',
        )
