"""Policy-loss settings (molt_rules.md §2.E; Molt raises these in `PolicyTrainer.__init__`, inside each actor)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def dual_clip_not_above_one(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.loss.dual_clip`, when set, is greater than 1.

    ## Why it matters
    Dual clip bounds the loss of negative-advantage tokens at `dual_clip × advantage`; a bound ≤ 1 would cut below
    the ordinary PPO clip. Molt asserts `dual_clip > 1.0` when each actor builds its policy loss.

    ## Example
    ```yaml
    actor: {loss: {mode: ppo, dual_clip: 0.5}}
    ```

    ## Use instead
    ```yaml
    actor: {loss: {mode: ppo, dual_clip: 10.0}}
    ```

    ## References
    molt_rules.md E1, §6.4
    """
    dc = recipe.actor.loss.dual_clip
    if dc is not None and dc <= 1.0:
        yield diag(
            source,
            "actor.loss.dual_clip",
            f"actor.loss.dual_clip {dc} must be > 1",
            "use 3.0-10.0 (Molt's recipes use 10.0), or remove dual_clip",
        )


def dual_clip_without_ppo(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.loss.dual_clip` set with `loss.mode` other than ppo.

    ## Why it matters
    Dual clip is a PPO-only extra bound; Molt raises "dual_clip is a PPO-only extra bound; it has no effect under
    loss_mode=…" in each actor. Molt's shipped scripts all pass `--actor.dual_clip 10.0`, so switching one to gspo
    or cispo needs dual_clip removed.

    ## Example
    ```yaml
    actor: {loss: {mode: gspo, dual_clip: 10.0}}
    ```

    ## Use instead
    ```yaml
    actor: {loss: {mode: gspo, dual_clip: null}}
    ```

    ## References
    molt_rules.md E3
    """
    loss = recipe.actor.loss
    if loss.dual_clip is not None and loss.mode != "ppo":
        yield diag(
            source,
            "actor.loss.dual_clip",
            f"actor.loss.dual_clip is PPO-only, but loss.mode is {loss.mode}",
            "remove actor.loss.dual_clip (or set it to null)",
            ["actor.loss.mode"],
        )


def cispo_clip_ceiling_below_one(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Under `loss.mode: cispo`, the second value of `actor.loss.clip` (an absolute ratio ceiling) is at least 1.

    ## Why it matters
    CISPO clips the importance weight at an absolute ceiling such as 1.2, not at an offset like PPO's 0.2; the
    default (0.2, 0.2) therefore fails Molt's assert `clip_eps_high >= 1.0` in every actor.

    ## Example
    ```yaml
    actor: {loss: {mode: cispo, clip: [0.2, 0.28]}}
    ```

    ## Use instead
    ```yaml
    actor: {loss: {mode: cispo, clip: [0.2, 1.28]}}
    ```

    ## References
    molt_rules.md E2, §6.4
    """
    loss = recipe.actor.loss
    if loss.mode == "cispo" and loss.clip[1] < 1.0:
        yield diag(
            source,
            "actor.loss.clip",
            f"cispo reads actor.loss.clip[1] as an absolute ratio ceiling; {loss.clip[1]} < 1 clips every token",
            f"use [{loss.clip[0]}, {1 + loss.clip[1]:g}]",
            ["actor.loss.mode"],
        )
