"""Length penalties: DAPO overlong and ProRL stop-properly (Molt 0.2.1 `--reward.*`; molt_0_2_1.md §2.1, §3.6).

Both shape the rollout's reward before `algo.reward_clip`. Molt checks their ranges in its CLI (V1–V4).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag, is_set
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def overlong_penalty_factor_invalid(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.overlong_penalty_factor` is finite and ≥ 0 — checked always, even with the overlong penalty off.

    ## Why it matters
    The factor is the largest penalty subtracted from an overlong rollout's reward; a negative one would reward
    running long. Molt refuses it in its CLI whether or not the buffer is set.

    ## Example
    ```yaml
    algo: {overlong_penalty_factor: -1.0}
    ```

    ## Use instead
    ```yaml
    algo: {overlong_penalty_factor: 1.0}
    ```

    ## References
    molt_0_2_1.md V1, §3.6 (molt_rules.md B11)
    """
    f = recipe.algo.overlong_penalty_factor
    if not math.isfinite(f) or f < 0:
        yield diag(
            source,
            "algo.overlong_penalty_factor",
            f"algo.overlong_penalty_factor {f} must be finite and nonnegative",
            "use a value in [0, 1] such as 1.0",
        )


def overlong_buffer_out_of_range(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.overlong_buffer_len`, when set, is finite and in `(0, data.max_len]`.

    ## Why it matters
    The penalty ramps over the last B tokens of the context budget; B ≤ 0 divides by zero and B > max_len starts
    the ramp before the first token. Molt refuses it in its CLI.

    ## Example
    ```yaml
    algo: {overlong_buffer_len: 4096}
    data: {max_len: 2048}
    ```

    ## Use instead
    ```yaml
    algo: {overlong_buffer_len: 512}
    data: {max_len: 2048}
    ```

    ## References
    molt_0_2_1.md V2, §3.6 (molt_rules.md B16)
    """
    b, max_len = recipe.algo.overlong_buffer_len, recipe.data.max_len
    if b is not None and not (math.isfinite(b) and 0 < b <= max_len):
        yield diag(
            source,
            "algo.overlong_buffer_len",
            f"algo.overlong_buffer_len {b} must be finite and in (0, data.max_len {max_len}]",
            f"use at most {max_len}, e.g. {max(1, max_len // 8)}",
            ["data.max_len"],
        )


def stop_properly_coef_above_one(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.stop_properly_penalty_coef`, when set, is finite and ≤ 1.

    ## Why it matters
    A coefficient C ∈ [0, 1] scales a truncated rollout's reward and a negative C replaces it; C > 1 would reward
    truncation. Molt refuses it in its CLI.

    ## Example
    ```yaml
    algo: {stop_properly_penalty_coef: 1.5}
    ```

    ## Use instead
    ```yaml
    algo: {stop_properly_penalty_coef: -1.0}
    ```

    ## References
    molt_0_2_1.md V3, §3.6 (molt_rules.md B11)
    """
    c = recipe.algo.stop_properly_penalty_coef
    if c is not None and (not math.isfinite(c) or c > 1):
        yield diag(
            source,
            "algo.stop_properly_penalty_coef",
            f"algo.stop_properly_penalty_coef {c} must be finite and <= 1 (a negative value replaces the reward)",
            "use a value in [0, 1) to scale, or a negative one such as -1.0 to replace",
        )


def length_penalties_both_set(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Both `algo.overlong_buffer_len` and `algo.stop_properly_penalty_coef` set.

    ## Why it matters
    The two penalties shape the same truncated rollouts in different ways; Molt refuses the pair ("pick one").

    ## Example
    ```yaml
    algo: {overlong_buffer_len: 256, stop_properly_penalty_coef: 0.0}
    ```

    ## Use instead
    ```yaml
    algo: {overlong_buffer_len: 256}
    ```

    ## References
    molt_0_2_1.md V4, §3.6 (molt_rules.md B11)
    """
    a = recipe.algo
    if a.overlong_buffer_len is not None and a.stop_properly_penalty_coef is not None:
        yield diag(
            source,
            "algo.stop_properly_penalty_coef",
            "the overlong and stop-properly penalties are mutually exclusive",
            "keep one: remove algo.stop_properly_penalty_coef or algo.overlong_buffer_len",
            ["algo.overlong_buffer_len"],
        )


def stop_properly_scale_with_negative_rewards(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A scaling stop-properly coefficient C ∈ [0, 1) while rewards may be negative (`algo.reward_clip` low < 0).

    ## Why it matters
    Scaling a negative reward by C < 1 moves it toward 0: a truncated *failure* is then penalised less than a
    finished one. The penalty also runs before `reward_clip` and after dynamic filtering, which never sees it.

    ## Example
    ```yaml
    algo: {stop_properly_penalty_coef: 0.5, reward_clip: [-1.0, 1.0]}
    ```

    ## Use instead
    ```yaml
    algo: {stop_properly_penalty_coef: 0.5, reward_clip: [0.0, 1.0]}
    ```

    ## References
    molt_0_2_1.md I12, §3.6 (molt_rules.md B11)
    """
    a = recipe.algo
    c = a.stop_properly_penalty_coef
    if c is not None and 0 <= c < 1 and a.reward_clip[0] < 0:
        yield diag(
            source,
            "algo.stop_properly_penalty_coef",
            f"coefficient {c} scales truncated "
            f"rollouts' rewards, and algo.reward_clip allows negative ones (low {a.reward_clip[0]}): a "
            "truncated failure is penalised less than a finished one",
            "use a negative coefficient (replace: e.g. -1.0), or algo.reward_clip with low >= 0",
            ["algo.reward_clip"],
        )


def overlong_factor_without_buffer(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.overlong_penalty_factor` written while `algo.overlong_buffer_len` is unset.

    ## Why it matters
    The factor only scales the overlong ramp; without a buffer the penalty is off and the factor does nothing.

    ## Example
    ```yaml
    algo: {overlong_penalty_factor: 0.5}
    ```

    ## Use instead
    ```yaml
    algo: {overlong_penalty_factor: 0.5, overlong_buffer_len: 256}
    ```

    ## References
    molt_0_2_1.md F9 (molt_rules.md §1)
    """
    a = recipe.algo
    if is_set(source, "algo.overlong_penalty_factor") and a.overlong_buffer_len is None:
        yield diag(
            source,
            "algo.overlong_penalty_factor",
            "algo.overlong_penalty_factor has no effect without algo.overlong_buffer_len",
            "set algo.overlong_buffer_len, or remove the factor",
            ["algo.overlong_buffer_len"],
        )
