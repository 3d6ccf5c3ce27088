"""Score centering on the sampler's top-k log-probs (Molt 0.2.1 `score_centering_top_k`; molt_0_2_1.md §2, §3.4).

The correction is exact at ratio 1 with an untempered-by-top-p sampler and composes only with a per-token ratio
weight. Molt checks part of this in its CLI (V7–V9) and the rest in PolicyLoss inside every actor (L1).
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def _on(recipe) -> bool:
    return recipe.algo.score_centering_top_k >= 2


def score_centering_top_k_invalid(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.score_centering_top_k` is 0 (off) or at least 2.

    ## Why it matters
    k = 1 records no top-k (every capture tests `logprobs > 1`) while the loss still turns centering on, so the
    first train step fails (L6). A negative k passes Molt's CLI, disables centering and still sends `logprobs=k`
    to vLLM.

    ## Example
    ```yaml
    algo: {score_centering_top_k: 1}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8}
    ```

    ## References
    molt_0_2_1.md I3, L6 (molt_rules.md B14)
    """
    k = recipe.algo.score_centering_top_k
    if k < 0 or k == 1:
        yield diag(
            source,
            "algo.score_centering_top_k",
            f"algo.score_centering_top_k {k}: score centering needs k >= 2 (or 0 for off)",
            "use 0 (off) or k >= 2, e.g. 8",
        )


def score_centering_with_several_epochs(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Score centering with `train.max_epochs` other than 1.

    ## Why it matters
    The head correction is exact only where the PPO ratio is 1, i.e. one update per rollout batch; a second epoch
    trains on updated weights. Molt refuses it in its CLI ("needs one update per batch").

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8}
    train: {max_epochs: 2}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8}
    train: {max_epochs: 1}
    ```

    ## References
    molt_0_2_1.md V7 (molt_rules.md G8)
    """
    if _on(recipe) and recipe.train.max_epochs != 1:
        yield diag(
            source,
            "train.max_epochs",
            f"score centering needs one update per rollout batch, but train.max_epochs is {recipe.train.max_epochs}",
            "set train.max_epochs: 1",
            ["algo.score_centering_top_k"],
        )


def score_centering_sampling(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Score centering with `rollout.top_p < 1`.

    ## Why it matters
    The correction models the sampler's distribution as its top-k head plus a proportional tail; nucleus
    truncation breaks that model. Molt refuses it in its CLI ("needs top_p 1.0 and temperature > 0"; the
    temperature half is the schema's `temperature > 0`).

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8}
    rollout: {top_p: 0.95}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8}
    rollout: {top_p: 1.0}
    ```

    ## References
    molt_0_2_1.md V8 (molt_rules.md D4)
    """
    if _on(recipe) and recipe.rollout.top_p != 1.0:
        yield diag(
            source,
            "rollout.top_p",
            f"score centering needs rollout.top_p 1.0, not {recipe.rollout.top_p}",
            "set rollout.top_p: 1.0",
            ["algo.score_centering_top_k"],
        )


def score_centering_with_tensor_parallel(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Score centering with `actor.mesh.tp > 1`.

    ## Why it matters
    The top-k gather reads the full-vocabulary head; Molt's is not vocab-parallel yet and refuses TP in its CLI
    (and again in the forward, L8).

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8}
    actor: {mesh: {tp: 2}}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8}
    actor: {mesh: {tp: 1}}
    ```

    ## References
    molt_0_2_1.md V9, L8 (molt_rules.md G2)
    """
    if _on(recipe) and recipe.actor.mesh.tp > 1:
        yield diag(
            source,
            "actor.mesh.tp",
            f"score centering does not support actor.mesh.tp {recipe.actor.mesh.tp} (the head is not vocab-parallel)",
            "set actor.mesh.tp: 1",
            ["algo.score_centering_top_k"],
        )


def score_centering_with_sequence_is(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Score centering with `algo.is_correction.level` seq or geo.

    ## Why it matters
    The centering term uses the per-token IS weight of the sampled token; a sequence-level gate has no per-token
    weight to compose with. Molt raises in every actor's PolicyLoss (L1).

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8, is_correction: {level: seq, threshold: [0.5, 2.0]}}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8, is_correction: {level: token, threshold: [0.5, 2.0]}}
    ```

    ## References
    molt_0_2_1.md L1, §3.4 (molt_rules.md D5)
    """
    level = recipe.algo.is_correction.level
    if _on(recipe) and level not in ("off", "token"):
        yield diag(
            source,
            "algo.is_correction.level",
            f"score centering composes only with token-level IS, not level {level}",
            "set algo.is_correction.level: token (or off)",
            ["algo.score_centering_top_k"],
        )


def score_centering_with_divergence_gating(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Score centering with `algo.is_correction.gating` other than ratio — even with IS off.

    ## Why it matters
    The head weights apply the IS weight function to probability ratios; a divergence gate has none. Molt's
    PolicyLoss raises for any gating but ratio under centering, also when the level is off and the gate would do
    nothing (L1, I6).

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8, is_correction: {level: "off", gating: tv}}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8, is_correction: {level: "off", gating: ratio}}
    ```

    ## References
    molt_0_2_1.md L1, I6 (molt_rules.md D5)
    """
    gating = recipe.algo.is_correction.gating
    if _on(recipe) and gating != "ratio":
        yield diag(
            source,
            "algo.is_correction.gating",
            f"score centering needs gating ratio, not {gating}",
            "set algo.is_correction.gating: ratio",
            ["algo.score_centering_top_k"],
        )


def score_centering_ratio_drifts(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Score centering where a rollout batch is trained in several optimizer steps: `train.batch_size` below
    `rollout.batch_size × n_samples_per_prompt` without `train.force_on_policy`.

    ## Why it matters
    The correction is exact at ratio 1. Molt checks only `max_epochs = 1`; with several windows per batch, later
    windows train on updated weights, so the ratio drifts from 1 and the head correction is biased.

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8}
    train: {batch_size: 32}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 8}
    train: {batch_size: 64}
    ```

    ## References
    molt_0_2_1.md I4 (molt_rules.md G8)
    """
    ro, t = recipe.rollout, recipe.train
    samples = ro.batch_size * ro.n_samples_per_prompt
    if _on(recipe) and not t.force_on_policy and t.batch_size < samples:
        yield diag(
            source,
            "train.batch_size",
            f"train.batch_size {t.batch_size} < {samples} samples per "
            "rollout batch: later optimizer steps see ratios away from 1 and score centering drifts",
            f"set train.batch_size: {samples}, or train.force_on_policy: true",
            ["algo.score_centering_top_k", "rollout.batch_size"],
        )
