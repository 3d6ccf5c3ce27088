"""Async pipeline and importance-sampling correction (molt_rules.md §2.D)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def async_rollout_without_is_correction(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.async.queue_size > 1` or `train.async.partial_rollout: true` while `algo.is_correction.level` is `off`.

    ## Why it matters
    With a deeper queue, or with generation that keeps running across a weight sync, the trainer learns from tokens
    sampled by older weights. Molt's HTTP rollout path never masks those tokens (it always reports
    `off_policy_len = 0`), so only importance-sampling correction can account for them. Molt refuses this in its CLI.

    ## Example
    ```yaml
    train:
      async: {queue_size: 2}
    algo:
      is_correction: {level: "off"}
    ```

    ## Use instead
    ```yaml
    train:
      async: {queue_size: 2}
    algo:
      is_correction: {level: geo, mode: mask, threshold: [0.99, 1.01]}
    ```

    Under score centering (Molt 0.2.1, V10) the head correction accounts for the sampler, so the guard is off.
    A partial rollout forced by `rollout.generate_batch_size > rollout.batch_size` (X4, ASYNC006) counts too.

    ## References
    molt_rules.md D1, D11, D12; molt_0_2_1.md V10, X4, I15
    """
    if recipe.eval.only or recipe.algo.is_correction.level != "off" or recipe.algo.score_centering_top_k >= 2:
        return
    q = recipe.train.async_
    if q.queue_size > 1:
        yield diag(
            source,
            "train.async.queue_size",
            f"train.async.queue_size {q.queue_size} lets generation run {q.queue_size - 1} batch(es) ahead of "
            "training, but algo.is_correction.level is off: stale tokens are trained on uncorrected",
            "set algo.is_correction.level: token (or geo with mode mask), or train.async.queue_size: 1",
            ["algo.is_correction.level"],
        )
    if q.partial_rollout or dv(derived, "train.partial_rollout", False):
        forced = not q.partial_rollout
        yield diag(
            source,
            "rollout.generate_batch_size" if forced else "train.async.partial_rollout",
            (
                "rollout.generate_batch_size > rollout.batch_size turns partial rollout on (X4), which"
                if forced
                else "train.async.partial_rollout"
            )
            + " lets requests straddle a weight sync, but "
            "algo.is_correction.level is off: tokens from the old weights are trained on uncorrected",
            "set algo.is_correction.level: token, or "
            + ("rollout.generate_batch_size <= rollout.batch_size" if forced else "train.async.partial_rollout: false"),
            ["algo.is_correction.level"],
        )


def is_correction_with_top_p(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Importance-sampling correction (`algo.is_correction.level` not `off`), or KL against the rollout policy
    (`algo.kl.coef > 0`, `kl.ref: rollout`, Molt 0.2.1 V11), together with `rollout.top_p < 1`.

    ## Why it matters
    vLLM's processed log-probs are renormalized over the nucleus, so with `top_p < 1` the rollout log-probs the
    correction divides by are biased and the importance ratio is wrong for every token. Molt rejects it in its CLI.

    ## Example
    ```yaml
    rollout: {top_p: 0.9}
    algo:
      is_correction: {level: token, mode: clip}
    ```

    ## Use instead
    ```yaml
    rollout: {top_p: 1.0}
    algo:
      is_correction: {level: token, mode: clip}
    ```

    ## References
    molt_rules.md D4, B14; molt_0_2_1.md V11
    """
    level = recipe.algo.is_correction.level
    top_p = recipe.rollout.top_p
    if level != "off" and top_p < 1.0:
        yield diag(
            source,
            "rollout.top_p",
            f"rollout.top_p {top_p} renormalizes the rollout log-probs that IS correction "
            f"(level {level}) consumes: every importance ratio is biased",
            "set rollout.top_p: 1.0, or algo.is_correction.level: off",
            ["algo.is_correction.level"],
        )
    elif top_p < 1.0 and dv(derived, "algo.kl.to_rollout", False):
        yield diag(
            source,
            "rollout.top_p",
            f"rollout.top_p {top_p} renormalizes the rollout log-probs that the KL against the rollout "
            "policy uses as its reference: the KL is biased",
            "set rollout.top_p: 1.0, or algo.kl.ref: model with a `ref:` section",
            ["algo.kl.ref", "algo.kl.coef"],
        )


def seq_level_is_without_mask(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.is_correction.level` `seq` or `geo` with a `mode` other than `mask`.

    ## Why it matters
    Sequence-level and geometric-mean corrections are rejection filters, not per-token weights; Molt's loss raises
    `ValueError` for clip/trunc with them — but only when the policy trainer is built inside a Ray actor, minutes
    after the job started.

    ## Example
    ```yaml
    algo:
      is_correction: {level: geo, mode: clip}
    ```

    ## Use instead
    ```yaml
    algo:
      is_correction: {level: geo, mode: mask}
    ```

    ## References
    molt_rules.md D5
    """
    isc = recipe.algo.is_correction
    if isc.level in ("seq", "geo") and isc.mode != "mask":
        yield diag(
            source,
            "algo.is_correction.mode",
            f"algo.is_correction.level {isc.level} is a rejection filter and supports only mode mask, not {isc.mode}",
            "set algo.is_correction.mode: mask, or use level: token for clip/trunc",
            ["algo.is_correction.level"],
        )


def stale_rollouts_without_is_correction(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    IS correction off, queue size 1, no partial rollout, and `train.async.force_sync: false`.

    ## Why it matters
    Without `force_sync` the rollout slot is handed back *before* the training step, so the next batch is generated
    with weights one step stale, and nothing corrects it because IS is off. Molt only prints "Rollout samples may be
    off-policy". Either make the run strictly synchronous or turn the correction on.

    ## Example
    ```yaml
    train:
      async: {queue_size: 1, force_sync: false}
    algo:
      is_correction: {level: "off"}
    ```

    ## Use instead
    ```yaml
    train:
      async: {queue_size: 1, force_sync: true}
    algo:
      is_correction: {level: "off"}
    ```

    ## References
    molt_rules.md D2, D10, D12
    """
    q = recipe.train.async_
    if recipe.eval.only or recipe.algo.is_correction.level != "off" or recipe.algo.score_centering_top_k >= 2:
        return  # Molt 0.2.1 skips the warning under score centering (V10)
    if q.queue_size == 1 and not q.partial_rollout and not q.force_sync:
        yield diag(
            source,
            "train.async.force_sync",
            "train.async.force_sync is false: each batch is generated with weights one step stale, and "
            "algo.is_correction.level off leaves that uncorrected",
            "set train.async.force_sync: true, or algo.is_correction.level: token",
            ["train.async.queue_size", "algo.is_correction.level"],
        )


def is_threshold_band_excludes_on_policy(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    An IS threshold band `[low, high]` that is empty (`low >= high`) or does not contain 1.

    ## Why it matters
    An on-policy token has ratio 1. A band without 1 masks (or clips) every such token, so the IS filter ratio is
    about 1 and the gradient is zero; Molt only logs a warning once the run is going (`is_filter_ratio >= 0.999`).

    ## Example
    ```yaml
    algo:
      is_correction: {level: geo, mode: mask, threshold: [1.01, 1.05]}
    ```

    ## Use instead
    ```yaml
    algo:
      is_correction: {level: geo, mode: mask, threshold: [0.99, 1.01]}
    ```

    Only for `gating: ratio`; a divergence gate (binary_kl, tv) has its own band rule (IS004). One value HIGH
    is the band [-inf, HIGH] (X1).

    ## References
    molt_rules.md D9, §6.4; molt_0_2_1.md I9
    """
    isc = recipe.algo.is_correction
    band = dv(derived, "algo.is_correction.band")
    if isc.level == "off" or isc.gating != "ratio" or band is None:
        return
    low, high = band
    if (low is None or low < 1.0) and 1.0 < high:
        return
    low = float("-inf") if low is None else low
    why = "is empty" if low >= high else "does not contain 1 (an on-policy token's ratio)"
    yield diag(
        source,
        "algo.is_correction.threshold",
        f"algo.is_correction.threshold [{low}, {high}] {why}: every token is filtered and the gradient is zero",
        "use a band around 1, e.g. [0.99, 1.01] or [0.5, 2.0]",
        ["algo.is_correction.level"],
    )


def generate_batch_forces_partial_rollout(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.generate_batch_size > rollout.batch_size` with `train.async.partial_rollout: false`.

    ## Why it matters
    Surplus groups in flight keep generating across weight syncs. Molt 0.2.1 keeps them only with partial rollout
    and turns it on itself in its CLI (X4), before the off-policy guard (ASYNC001) runs, which then treats the run
    as partial; ASYNC001 names this as the root cause when it fires. (This runtime carries surplus groups across
    steps either way; the plan's `queue.partial_rollout`, which decides whether generation holds the engine lock,
    stays as the recipe says.)

    ## Example
    ```yaml
    rollout: {generate_batch_size: 32}
    algo: {is_correction: {level: token}}
    ```

    ## Use instead
    ```yaml
    rollout: {generate_batch_size: 32}
    train: {async: {partial_rollout: true}}
    algo: {is_correction: {level: token}}
    ```

    ## References
    molt_0_2_1.md X4, I15, §4 D12 (molt_rules.md B4)
    """
    ro = recipe.rollout
    if ro.generate_batch_size and ro.generate_batch_size > ro.batch_size and not recipe.train.async_.partial_rollout:
        yield diag(
            source,
            "rollout.generate_batch_size",
            f"rollout.generate_batch_size "
            f"{ro.generate_batch_size} > rollout.batch_size {ro.batch_size}: surplus groups run across "
            "weight syncs, which Molt 0.2.1 treats as partial rollout (X4)",
            "nothing to change; set generate_batch_size <= batch_size to keep each rollout within one policy version",
            ["train.async.partial_rollout"],
        )


def alternate_without_colocated_engines(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.async.colocated_gpus: alternate` with `rollout.placement: separate`.

    ## Why it matters
    `alternate` pauses the engines through every training step so that the trainer has the GPUs they share alone.
    Separate engines share no GPU with the trainer: pausing them would only idle their GPUs for the length of each
    training step, and the next batch would start later for nothing.

    ## Example
    ```yaml
    rollout: {placement: separate}
    train: {async: {colocated_gpus: alternate, force_sync: true}}
    ```

    ## Use instead
    ```yaml
    rollout: {placement: colocate}
    train: {async: {colocated_gpus: alternate, force_sync: true}}
    ```

    ## References
    DESIGN.md (rollout.placement); issue 29 (the trainer phase on a GPU shared with the engine)
    """
    if recipe.eval.only or recipe.train.async_.colocated_gpus != "alternate":
        return
    if recipe.rollout.placement != "colocate":
        yield diag(
            source,
            "train.async.colocated_gpus",
            "train.async.colocated_gpus alternate pauses the engines through each training step to give the trainer "
            "the GPUs they share, but rollout.placement is separate: the engines share no GPU with the trainer",
            "remove train.async.colocated_gpus (overlap), or set rollout.placement: colocate",
            ["rollout.placement"],
        )


def alternate_without_force_sync(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.async.colocated_gpus: alternate` with `train.async.force_sync: false`.

    ## Why it matters
    Without `force_sync` the rollout slot goes back to the generator *before* the training step, and the generator
    and the step would then race for the engine lock: the next batch would be generated either alone before the
    step (one step stale) or after its weight sync (fresh), run by run, while its recorded policy version says
    stale. With `force_sync` the slot goes back after the sync, so the step always has the GPUs first and the next
    batch is generated with the new weights. Alternating loses no overlap by this: on a shared GPU the two do not
    overlap under `alternate` anyway.

    ## Example
    ```yaml
    rollout: {placement: colocate}
    train: {async: {colocated_gpus: alternate, force_sync: false}}
    ```

    ## Use instead
    ```yaml
    rollout: {placement: colocate}
    train: {async: {colocated_gpus: alternate, force_sync: true}}
    ```

    ## References
    molt_rules.md D10, D12; issue 29
    """
    q = recipe.train.async_
    if recipe.eval.only or q.colocated_gpus != "alternate" or q.force_sync:
        return
    yield diag(
        source,
        "train.async.colocated_gpus",
        "train.async.colocated_gpus alternate needs train.async.force_sync: without it the next batch's generation "
        "and the training step race for the engine lock, and the batch's policy version is not known",
        "set train.async.force_sync: true, or remove train.async.colocated_gpus (overlap)",
        ["train.async.force_sync"],
    )
