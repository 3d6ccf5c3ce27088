"""Optimizer, LR scheduler and CPU offload (molt_rules.md §2.K, G12)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe

SAFE_SCHEDULERS = ("constant", "constant_with_warmup", "cosine_with_min_lr")
"""Schedulers that accept (or ignore) Molt's `min_lr_rate` kwarg (K5)."""
TRANSFORMERS_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
"""`transformers.SchedulerType` values (transformers 5.x)."""


def _optimizers(recipe):
    """(recipe key prefix, Optimizer) for the policy and, when a critic section exists, the critic."""
    out = [("actor.optimizer", recipe.actor.optimizer)]
    critic = getattr(recipe, "critic", None)
    if critic is not None:
        out.append(("critic.optimizer", critic.optimizer))
    return out


def muon_with_optimizer_offload(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `optimizer.name: muon` (actor or critic) with `actor.offload: optimizer`.

    ## Why it matters
    Optimizer offload supports AdamW only; Molt's FSDP strategy raises `NotImplementedError` when it builds the
    optimizer inside each actor.

    ## Example
    ```yaml
    actor: {offload: optimizer, optimizer: {name: muon}}
    ```

    ## Use instead
    ```yaml
    actor: {offload: none, optimizer: {name: muon}}
    ```

    ## References
    molt_rules.md K1, §2.O item 13
    """
    if recipe.actor.offload != "optimizer":
        return
    for prefix, opt in _optimizers(recipe):
        if opt.name == "muon":
            yield diag(
                source,
                "actor.offload",
                f"actor.offload optimizer supports AdamW only, but {prefix}.name is muon",
                "set actor.offload: none (or full), or use optimizer name adam",
                [f"{prefix}.name"],
            )


def unknown_lr_scheduler(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `optimizer.scheduler` is one that works with Molt: constant, constant_with_warmup or cosine_with_min_lr.

    ## Why it matters
    Molt calls `transformers.get_scheduler(name, …, scheduler_specific_kwargs={"min_lr_rate": …})`. An unknown name
    raises `ValueError`; known schedulers that do not take `min_lr_rate` (linear, cosine, …) raise `TypeError` —
    both inside the actor when the optimizer is built.

    ## Example
    ```yaml
    actor: {optimizer: {scheduler: cosine}}
    ```

    ## Use instead
    ```yaml
    actor: {optimizer: {scheduler: cosine_with_min_lr}}
    ```

    ## References
    molt_rules.md K5, §2.O item 14
    """
    for prefix, opt in _optimizers(recipe):
        name = opt.scheduler
        if name in SAFE_SCHEDULERS:
            continue
        if name in TRANSFORMERS_SCHEDULERS:
            why = "does not accept Molt's min_lr_rate argument (TypeError when the optimizer is built)"
        else:
            import difflib  # a did-you-mean only: not imported by every compile

            close = difflib.get_close_matches(name, TRANSFORMERS_SCHEDULERS, n=1)
            why = "is not a transformers scheduler" + (f" (did you mean {close[0]!r}?)" if close else "")
        yield diag(
            source,
            f"{prefix}.scheduler",
            f"{prefix}.scheduler {name!r} {why}",
            f"use one of {', '.join(SAFE_SCHEDULERS)}",
        )


def muon_ns_steps_not_five(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `optimizer.muon.ns_steps` is 5 when the optimizer is Muon.

    ## Why it matters
    AutoModel/Dion's Muon has no configurable Newton-Schulz step count; Molt raises `ValueError` when it builds the
    optimizer.

    ## Example
    ```yaml
    actor: {optimizer: {name: muon, muon: {ns_steps: 6}}}
    ```

    ## Use instead
    ```yaml
    actor: {optimizer: {name: muon, muon: {ns_steps: 5}}}
    ```

    ## References
    molt_rules.md K2
    """
    for prefix, opt in _optimizers(recipe):
        if opt.name == "muon" and opt.muon.ns_steps != 5:
            yield diag(
                source,
                f"{prefix}.muon.ns_steps",
                f"{prefix}.muon.ns_steps {opt.muon.ns_steps}: AutoModel/Dion Muon always uses 5",
                f"set {prefix}.muon.ns_steps: 5 (or remove it)",
            )


def full_offload_on_one_rank(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.offload: full` with an FSDP world of one GPU.

    ## Why it matters
    AutoModel/FSDP2 does not support CPU offload on a single rank; Molt raises `NotImplementedError` in the
    strategy setup.

    ## Example
    ```yaml
    actor: {nodes: 1, gpus_per_node: 1, offload: full}
    rollout: {engines: 7}
    train: {batch_size: 28}
    ```

    ## Use instead
    ```yaml
    actor: {nodes: 1, gpus_per_node: 2, offload: full}
    rollout: {engines: 6}
    ```

    ## References
    molt_rules.md G12, B26
    """
    world = dv(derived, "actor.world")
    if recipe.actor.offload == "full" and world == 1:
        yield diag(
            source,
            "actor.offload",
            "actor.offload full is not supported on a single rank (actor world 1)",
            "use 2 or more actor GPUs, or actor.offload: optimizer / none",
            ["actor.gpus_per_node", "actor.nodes"],
        )
