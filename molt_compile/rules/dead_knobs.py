"""Settings that have no effect in the recipe they are written in (warnings)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag, dv, is_set
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftActor, SftRecipe


def dead_rollout_knob(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.micro_batch_size` or `rollout.max_tokens_per_gpu` set.

    ## Why it matters
    In Molt the first is read only by one CLI assertion and the second is never read; a reader would expect them
    to shape rollout batches.

    ## Example
    ```yaml
    rollout: {max_tokens_per_gpu: 16384}
    ```

    ## Use instead
    ```yaml
    rollout: {max_new_tokens: 1024}
    ```

    ## References
    molt_rules.md B6, G5, §2.O item 16
    """
    for key in ("micro_batch_size", "max_tokens_per_gpu"):
        value = getattr(recipe.rollout, key)
        if value is not None:
            yield diag(
                source, f"rollout.{key}", f"rollout.{key} {value} has no effect in Molt", f"remove rollout.{key}"
            )


def freezing_steps_without_critic(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.freezing_steps > 0` without a critic (estimator other than gae).

    ## Why it matters
    Freezing the policy while the critic warms up only exists with gae; otherwise the value is ignored.

    ## Example
    ```yaml
    actor: {freezing_steps: 10}
    ```

    ## Use instead
    ```yaml
    actor: {freezing_steps: 0}
    ```

    ## References
    molt_rules.md B10
    """
    if recipe.actor.freezing_steps > 0 and recipe.algo.estimator != "gae":
        yield diag(
            source,
            "actor.freezing_steps",
            f"actor.freezing_steps {recipe.actor.freezing_steps} "
            f"is ignored without a critic (estimator {recipe.algo.estimator})",
            "remove actor.freezing_steps",
            ["algo.estimator"],
        )


def discount_unused_by_estimator(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.lam` set (≠ 1) with an estimator other than gae, or `algo.gamma` set (≠ 1) with one other than reinforce
    and gae.

    ## Why it matters
    Only gae reads lambda; only reinforce and gae discount. Elsewhere the values are ignored.

    ## Example
    ```yaml
    algo: {estimator: grpo, lam: 0.95}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: gae, lam: 0.95}
    critic: {placement: colocate}
    ```

    ## References
    molt_rules.md §6.3
    """
    a = recipe.algo
    if a.lam != 1.0 and a.estimator != "gae":
        yield diag(
            source,
            "algo.lam",
            f"algo.lam {a.lam} is used only by gae, not {a.estimator}",
            "remove algo.lam",
            ["algo.estimator"],
        )
    if a.gamma != 1.0 and a.estimator not in ("reinforce", "gae"):
        yield diag(
            source,
            "algo.gamma",
            f"algo.gamma {a.gamma} is used only by reinforce and gae, not {a.estimator}",
            "remove algo.gamma",
            ["algo.estimator"],
        )


def adaptive_kl_with_zero_coef(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.kl.target` (adaptive KL) with a KL coefficient of 0.

    ## Why it matters
    The adaptive controller multiplies the coefficient each step; starting from 0 it stays 0 forever.

    ## Example
    ```yaml
    algo: {kl: {coef: 0.0, target: 0.1}}
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.001, target: 0.1, estimator: k2, use_loss: true}}
    ref: {placement: colocate}
    ```

    ## References
    molt_rules.md C9
    """
    kl = recipe.algo.kl
    if kl.target and dv(derived, "algo.kl.coef", kl.coef) == 0:
        yield diag(
            source,
            "algo.kl.target",
            "algo.kl.target adapts a coefficient of 0, which stays 0",
            "set algo.kl.coef > 0, or remove algo.kl.target",
            ["algo.kl.coef"],
        )


def moe_knob_on_dense_model(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    MoE-only settings (`aux_loss_coef > 0`, `freeze.moe_router`) on a dense model.

    ## Why it matters
    A dense model has no router: no load-balancing loss is computed and there is nothing to freeze.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {loss: {aux_loss_coef: 0.001}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {loss: {aux_loss_coef: 0.0}}
    ```

    ## References
    molt_rules.md B32, F11
    """
    facts = model_facts(recipe, source)
    if facts is None or facts.is_moe:
        return
    a = recipe.actor
    aux_key, aux = (
        ("actor.aux_loss_coef", a.aux_loss_coef)
        if isinstance(a, SftActor)
        else ("actor.loss.aux_loss_coef", a.loss.aux_loss_coef)
    )
    if aux > 0:
        yield diag(
            source,
            aux_key,
            f"{aux_key} {aux} on dense model {facts.key}: there is no router",
            f"remove {aux_key}",
            ["model.arch"],
        )
    if a.freeze.moe_router:
        yield diag(
            source,
            "actor.freeze.moe_router",
            f"actor.freeze.moe_router on dense model {facts.key}: there is no router",
            "remove actor.freeze.moe_router",
            ["model.arch"],
        )


def sequence_parallel_without_tp(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.sequence_parallel: true` with `actor.mesh.tp: 1`.

    ## Why it matters
    Sequence parallelism shards activations inside the TP region; without TP there is no such region.

    ## Example
    ```yaml
    actor: {sequence_parallel: true, mesh: {tp: 1}}
    ```

    ## Use instead
    ```yaml
    actor: {sequence_parallel: false, mesh: {tp: 1}}
    ```

    ## References
    molt_rules.md §1.1 (fsdp.sequence_parallel)
    """
    if recipe.actor.sequence_parallel and recipe.actor.mesh.tp == 1:
        yield diag(
            source,
            "actor.sequence_parallel",
            "actor.sequence_parallel has no effect with tp 1",
            "remove actor.sequence_parallel, or use tp > 1",
            ["actor.mesh.tp"],
        )


def optimizer_knob_unused_by_scheduler(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `warmup_ratio` written with the `constant` scheduler, `min_lr_ratio` written with a scheduler other than
    `cosine_with_min_lr`, or a `muon:` block with the adam optimizer.

    ## Why it matters
    `constant` has no warmup, only `cosine_with_min_lr` reads the LR floor, and the Muon block is read only with
    `name: muon`: the values are ignored.

    ## Example
    ```yaml
    actor: {optimizer: {scheduler: constant, warmup_ratio: 0.1}}
    ```

    ## Use instead
    ```yaml
    actor: {optimizer: {scheduler: constant_with_warmup, warmup_ratio: 0.1}}
    ```

    ## References
    molt_rules.md K5, K6, §1.1
    """
    optimizers = [("actor.optimizer", recipe.actor.optimizer)]
    if isinstance(recipe, RlRecipe) and recipe.critic is not None:
        optimizers.append(("critic.optimizer", recipe.critic.optimizer))
    for prefix, opt in optimizers:
        if opt.scheduler == "constant" and is_set(source, f"{prefix}.warmup_ratio") and opt.warmup_ratio > 0:
            yield diag(
                source,
                f"{prefix}.warmup_ratio",
                f"{prefix}.warmup_ratio is ignored by the constant scheduler",
                "use scheduler constant_with_warmup, or remove warmup_ratio",
                [f"{prefix}.scheduler"],
            )
        if opt.scheduler != "cosine_with_min_lr" and is_set(source, f"{prefix}.min_lr_ratio"):
            yield diag(
                source,
                f"{prefix}.min_lr_ratio",
                f"{prefix}.min_lr_ratio is read only by cosine_with_min_lr, not {opt.scheduler}",
                "remove min_lr_ratio",
                [f"{prefix}.scheduler"],
            )
        if opt.name != "muon" and is_set(source, f"{prefix}.muon"):
            yield diag(
                source,
                f"{prefix}.muon",
                f"{prefix}.muon is ignored with optimizer {opt.name}",
                f"remove {prefix}.muon, or set {prefix}.name: muon",
                [f"{prefix}.name"],
            )


def whiten_unused_by_estimator(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.whiten` written with an estimator that does not whiten (rloo, grpo, dr_grpo, on_policy_distill).

    ## Why it matters
    Only reinforce, reinforce_baseline and gae whiten advantages over the batch; the setting is ignored elsewhere.

    ## Example
    ```yaml
    algo: {estimator: grpo, whiten: false}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: reinforce_baseline, whiten: false}
    ```

    ## References
    molt_rules.md §6.3
    """
    est = recipe.algo.estimator
    if is_set(source, "algo.whiten") and est not in ("reinforce", "reinforce_baseline", "gae"):
        yield diag(
            source,
            "algo.whiten",
            f"algo.whiten is ignored by estimator {est}",
            "remove algo.whiten",
            ["algo.estimator"],
        )


def visual_encoder_freeze_on_text_model(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.freeze.visual_encoder: true` on a text-only model.

    ## Why it matters
    There is no visual encoder to freeze; the recipe was probably copied from a VLM one.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {freeze: {visual_encoder: true}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {freeze: {visual_encoder: false}}
    ```

    ## References
    molt_rules.md B23, §1.1
    """
    facts = model_facts(recipe, source)
    if facts is not None and not facts.is_vlm and recipe.actor.freeze.visual_encoder:
        yield diag(
            source,
            "actor.freeze.visual_encoder",
            f"{facts.key} has no visual encoder to freeze",
            "remove actor.freeze.visual_encoder",
            ["model.arch"],
        )
