"""IS gating and the threshold band (Molt 0.2.1 `--algo.advantage.is_correction_gating`; molt_0_2_1.md §2, §3.3).

The gate tests a statistic per token or sequence against the band: the ratio (as 0.1.6), or a divergence between
the sampler's and the trainer's probability of the sampled token (`binary_kl`, `tv`), which takes an upper bound.
Molt checks the combinations in `PolicyLoss.__init__`, inside every actor; these rules move them to compile time.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived, is_band
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def _values(isc) -> list[float]:
    t = isc.threshold
    return [t] if isinstance(t, int | float) else list(t)


def is_threshold_arity(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.is_correction.threshold` has one value (HIGH) or two (LOW, HIGH).

    ## Why it matters
    Molt 0.2.1 accepts `nargs +` and then refuses anything but one or two values in its CLI ("takes HIGH or LOW
    HIGH"); an empty list or three values has no meaning as a band.

    ## Example
    ```yaml
    algo: {is_correction: {level: token, threshold: [0.5, 1.0, 5.0]}}
    ```

    ## Use instead
    ```yaml
    algo: {is_correction: {level: token, threshold: [0.5, 5.0]}}
    ```

    ## References
    molt_0_2_1.md V5 (molt_rules.md D9)
    """
    n = len(_values(recipe.algo.is_correction))
    if n not in (1, 2):
        yield diag(
            source,
            "algo.is_correction.threshold",
            f"algo.is_correction.threshold has {n} values; it takes HIGH or [LOW, HIGH]",
            "write one upper bound (e.g. 5.0e-3) or a band [0.5, 5.0]",
        )


def is_single_threshold_band(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A single `algo.is_correction.threshold` value HIGH, with IS correction on: the band is `[-inf, HIGH]`.

    ## Why it matters
    Molt 0.2.1 rewrites one value into `[-inf, HIGH]` in its CLI (X1). That is the form divergence gating wants (an
    upper bound only); with ratio gating it keeps every token with a small ratio. Reported so the band is visible.

    ## Example
    ```yaml
    algo: {is_correction: {level: seq, gating: binary_kl, threshold: 5.0e-3}}
    ```

    ## Use instead
    ```yaml
    algo: {is_correction: {level: seq, gating: binary_kl, threshold: [0.0, 5.0e-3]}}
    ```

    ## References
    molt_0_2_1.md X1 (molt_rules.md D9)
    """
    isc = recipe.algo.is_correction
    if isc.level != "off" and len(_values(isc)) == 1:
        yield diag(
            source,
            "algo.is_correction.threshold",
            f"one threshold value {_values(isc)[0]}: the band is [-inf, {_values(isc)[0]}] (X1)",
            "write [0.0, HIGH] to say it in the recipe",
        )


def divergence_gating_with_clip_or_geo(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.is_correction.gating` binary_kl or tv with `mode` other than mask, or with `level: geo`.

    ## Why it matters
    A divergence is a distance, not a weight: it can only decide which units survive (mask), per token or per
    sequence. Molt raises "only mode mask, level token/seq" in every actor's PolicyLoss (L4).

    ## Example
    ```yaml
    algo: {is_correction: {level: token, mode: clip, gating: tv, threshold: 0.1}}
    ```

    ## Use instead
    ```yaml
    algo: {is_correction: {level: token, mode: mask, gating: tv, threshold: 0.1}}
    ```

    ## References
    molt_0_2_1.md L4, §3.3 (molt_rules.md D5)
    """
    isc = recipe.algo.is_correction
    if isc.gating == "ratio" or isc.level == "off":
        return
    if isc.mode != "mask":
        yield diag(
            source,
            "algo.is_correction.mode",
            f"gating {isc.gating} works only with mode mask, not {isc.mode}",
            "set algo.is_correction.mode: mask",
            ["algo.is_correction.gating"],
        )
    if isc.level == "geo":
        yield diag(
            source,
            "algo.is_correction.level",
            f"gating {isc.gating} works only at level token or seq, not geo",
            "set algo.is_correction.level: seq",
            ["algo.is_correction.gating"],
        )


def divergence_gating_with_lower_bound(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `gating` binary_kl or tv with IS on and a band whose lower value is > 0 (the default [0.5, 5.0] included).

    ## Why it matters
    An on-policy unit has divergence 0, so a positive lower bound drops exactly the units that need no
    correction. Molt raises "upper bound only" in every actor (L5); the default two-value band trips it.

    ## Example
    ```yaml
    algo: {is_correction: {level: seq, gating: binary_kl}}
    ```

    ## Use instead
    ```yaml
    algo: {is_correction: {level: seq, gating: binary_kl, threshold: 5.0e-3}}
    ```

    ## References
    molt_0_2_1.md L5, I8 (molt_rules.md D9)
    """
    isc = recipe.algo.is_correction
    if isc.gating == "ratio" or isc.level == "off" or len(_values(isc)) not in (1, 2):
        return
    low, high = is_band(isc)
    if low is not None and low > 0:
        yield diag(
            source,
            "algo.is_correction.threshold",
            f"gating {isc.gating} takes an upper bound "
            f"only, but the band's lower value is {low}: on-policy units (divergence 0) are dropped",
            f"write one value, algo.is_correction.threshold: {high if high < 0.5 else 5.0e-3}",
            ["algo.is_correction.gating"],
        )


def gating_without_is(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.is_correction.gating` binary_kl or tv while `algo.is_correction.level` is off.

    ## Why it matters
    Without IS correction nothing is gated: the setting is silently a no-op (and under score centering it still
    fails Molt's PolicyLoss check, SC006).

    ## Example
    ```yaml
    algo: {is_correction: {level: "off", gating: binary_kl}}
    ```

    ## Use instead
    ```yaml
    algo: {is_correction: {level: seq, gating: binary_kl, threshold: 5.0e-3}}
    ```

    ## References
    molt_0_2_1.md I7 (molt_rules.md D9)
    """
    isc = recipe.algo.is_correction
    if isc.gating != "ratio" and isc.level == "off" and recipe.algo.score_centering_top_k < 2:
        yield diag(
            source,
            "algo.is_correction.gating",
            f"gating {isc.gating} has no effect: algo.is_correction.level is off",
            "remove algo.is_correction.gating, or turn IS on (level token or seq)",
            ["algo.is_correction.level"],
        )
