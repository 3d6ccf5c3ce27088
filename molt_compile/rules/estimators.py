"""Advantage estimators, KL, the reference model and dynamic filtering (molt_rules.md §2.B, §2.C).

Fifteen rules; most of the ~520 lines are their docstrings, which are their documentation (`molt-compile rules CODE`).
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import GROUP_ESTIMATORS, diag, dv, is_set
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def _no_section(source, section: str) -> str:
    """Why a section is missing: never written, or written empty (`ref:` alone is YAML null, which removes it)."""
    if is_set(source, section):
        return f"`{section}:` is empty (YAML null), which means no {section} section"
    return f"the recipe has no `{section}:` section"


def _add_section(source, section: str, example: str) -> str:
    if is_set(source, section):
        return f"write `{section}: {example}` (an empty `{section}:` removes the section; `{section}: {{}}` keeps the defaults)"
    return f"add `{section}: {example}`"


def group_estimator_with_single_sample(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A group estimator (`rloo`, `reinforce_baseline`, `grpo`, `dr_grpo`) with `rollout.n_samples_per_prompt <= 1`.

    ## Why it matters
    These estimators use the other rollouts of the same prompt as the baseline. With one rollout per prompt the
    advantage is always zero (or undefined). Molt asserts this in its CLI, except for eval-only runs.

    ## Example
    ```yaml
    algo: {estimator: grpo}
    rollout: {n_samples_per_prompt: 1, batch_size: 64}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: grpo}
    rollout: {n_samples_per_prompt: 4, batch_size: 16}
    ```

    ## References
    molt_rules.md C1
    """
    est, n = recipe.algo.estimator, recipe.rollout.n_samples_per_prompt
    if est in GROUP_ESTIMATORS and n <= 1 and not recipe.eval.only:
        yield diag(
            source,
            "rollout.n_samples_per_prompt",
            f"algo.estimator {est} needs n_samples_per_prompt > 1 for its group baseline, got {n}",
            "set rollout.n_samples_per_prompt to 2 or more (4-16 is usual), or use estimator reinforce",
            ["algo.estimator"],
        )


def gae_without_critic_section(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.estimator: gae` without a `critic:` section.

    ## Why it matters
    gae needs a value model. It takes GPUs (its own actor-sized group, or a share of the actor's) and memory, so a
    recipe must say where it lives; Molt builds one silently from the actor's settings.

    ## Example
    ```yaml
    algo: {estimator: gae}
    critic: null
    ```

    ## Use instead
    ```yaml
    algo: {estimator: gae}
    critic: {placement: colocate}
    ```

    ## References
    molt_rules.md B8, B9, C4, J3
    """
    if recipe.algo.estimator == "gae" and recipe.critic is None:
        yield diag(
            source,
            "algo.estimator",
            f"algo.estimator gae needs a value model, but {_no_section(source, 'critic')}",
            _add_section(source, "critic", "{placement: colocate}")
            + " (it shares the actor's GPUs), or choose another estimator",
            ["critic"],
        )


def critic_without_gae(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A `critic:` section while `algo.estimator` is not `gae`.

    ## Why it matters
    Only gae uses a value model; Molt builds a critic exactly when the estimator is gae. The section would be
    silently ignored, and whoever reads the recipe believes a critic trains.

    ## Example
    ```yaml
    algo: {estimator: grpo}
    critic: {placement: colocate}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: grpo}
    critic: null
    ```

    ## References
    molt_rules.md B8
    """
    if recipe.critic is not None and recipe.algo.estimator != "gae":
        yield diag(
            source,
            "critic",
            f"a `critic:` section is set but algo.estimator {recipe.algo.estimator} uses no value model",
            "remove the `critic:` section, or set algo.estimator: gae",
            ["algo.estimator"],
        )


def distill_without_teacher(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.estimator: on_policy_distill` without a `ref:` section, or with `ref.path` unset.

    ## Why it matters
    On-policy distillation learns from the KL to a teacher, which is the reference model. Without a `ref:` there is
    no teacher; with `ref.path` unset the teacher defaults to the student itself, and the run distills nothing.
    Molt requires `--ref.model_name_or_path` in its CLI.

    ## Example
    ```yaml
    algo: {estimator: on_policy_distill}
    ref: null
    ```

    ## Use instead
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0}}
    ref: {path: Qwen/Qwen3-30B-A3B, placement: colocate}
    ```

    ## References
    molt_rules.md B2
    """
    if recipe.algo.estimator != "on_policy_distill":
        return
    if recipe.ref is None:
        yield diag(
            source,
            "algo.estimator",
            f"algo.estimator on_policy_distill needs a teacher, but {_no_section(source, 'ref')}",
            _add_section(source, "ref", "{path: <teacher checkpoint>}"),
            ["ref"],
        )
    elif recipe.ref.path is None:
        yield diag(
            source,
            "ref",
            f"on_policy_distill: ref.path is unset, so the teacher would be the student itself ({recipe.model.path})",
            "set ref.path to the teacher checkpoint",
            ["algo.estimator", "model.path"],
        )


def distill_with_nonpositive_kl_coef(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `on_policy_distill` with `algo.kl.coef <= 0`.

    ## Why it matters
    The distillation signal is `-coef × KL(student ‖ teacher)` per token. With a zero coefficient Molt builds no
    teacher, every advantage is 0 and the run trains nothing — without any error.

    ## Example
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 0.0}}
    ref: {path: Qwen/Qwen3-30B-A3B}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0}}
    ref: {path: Qwen/Qwen3-30B-A3B}
    ```

    ## References
    molt_rules.md C6, B2, B8
    """
    coef = dv(derived, "algo.kl.coef", recipe.algo.kl.coef)
    if recipe.algo.estimator == "on_policy_distill" and coef <= 0:
        yield diag(
            source,
            "algo.kl.coef",
            f"on_policy_distill with algo.kl.coef {coef}: the KL to the teacher is the only signal, so "
            "every advantage is 0",
            "set algo.kl.coef: 1.0 (Molt's default for distillation)",
            ["algo.estimator"],
        )


def distill_forces_reward_kl(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Reports (info) what `on_policy_distill` forces: `algo.kl.estimator: k1`, `algo.kl.use_loss: false`, and
    `algo.kl.coef: 1.0` when unset.

    ## Why it matters
    Molt overrides these silently, whatever the recipe says. The compiler never rewrites silently: the forced values
    are shown here and in `explain`, so a `k3` written in the recipe is visibly not what runs.

    ## Example
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0, estimator: k3, use_loss: true}}
    ref: {path: Qwen/Qwen3-30B-A3B}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: grpo}
    ```

    ## References
    molt_rules.md B2, B29
    """
    if recipe.algo.estimator != "on_policy_distill":
        return
    kl = recipe.algo.kl
    coef = dv(derived, "algo.kl.coef", kl.coef)
    overridden = [
        f"{k} {getattr(kl, k)}"
        for k in ("estimator", "use_loss")
        if is_set(source, f"algo.kl.{k}") and getattr(kl, k) != {"estimator": "k1", "use_loss": False}[k]
    ]
    path = "algo.kl.estimator" if is_set(source, "algo.kl.estimator") else "algo.estimator"
    note = f" (replacing the recipe's {', '.join(overridden)})" if overridden else ""
    yield diag(
        source,
        path,
        f"on_policy_distill uses the KL to the teacher as a per-token reward: kl.estimator k1, "
        f"use_loss false, coef {coef}{note}",
        "nothing to do; this is how distillation works in Molt",
        ["algo.estimator", "algo.kl"],
    )


def kl_loss_with_k1(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A KL loss term (`algo.kl.use_loss: true`, `coef > 0`) estimated with `k1`.

    ## Why it matters
    k1 = log r has the right expectation but its gradient as a loss is not the KL gradient (its expectation is
    zero under the sampling policy); Molt's CLI advises k2 or k3 for a loss. Use k1 for a KL *reward*.

    ## Example
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k1, use_loss: true, ref: model}}
    ref: {placement: colocate}
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}
    ref: {placement: colocate}
    ```

    Against the rollout policy (`kl.ref: rollout`) the k1 loss is an error instead (KL001).

    ## References
    molt_rules.md C2, §6.5
    """
    kl = recipe.algo.kl
    if (
        recipe.algo.estimator != "on_policy_distill"
        and kl.use_loss
        and kl.estimator == "k1"
        and kl.coef > 0
        and kl.ref == "model"
    ):
        yield diag(
            source,
            "algo.kl.estimator",
            "algo.kl.use_loss with estimator k1: the k1 loss has a zero expected gradient and does not "
            "pull the policy toward the reference",
            "set algo.kl.estimator: k2 (or k3)",
            ["algo.kl.use_loss"],
        )


def kl_reward_with_group_estimator(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A KL *reward* (`use_loss: false`, `coef > 0`, a `ref:`) with a group estimator (rloo, reinforce_baseline, grpo,
    dr_grpo).

    ## Why it matters
    Only reinforce, gae and on_policy_distill read the per-token KL reward; the group estimators ignore it. The
    reference model is built, loaded and run every step for nothing.

    ## Example
    ```yaml
    algo: {estimator: grpo, kl: {coef: 0.001, estimator: k1, use_loss: false, ref: model}}
    ref: {placement: colocate}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: grpo, kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}
    ref: {placement: colocate}
    ```

    ## References
    molt_rules.md C7, B29
    """
    kl = recipe.algo.kl
    est = recipe.algo.estimator
    if est in GROUP_ESTIMATORS and recipe.ref is not None and kl.coef > 0 and not kl.use_loss and kl.ref == "model":
        yield diag(
            source,
            "algo.kl.use_loss",
            f"algo.estimator {est} ignores the per-token KL reward: the reference model is computed for nothing",
            "set algo.kl.use_loss: true (with estimator k2), or remove the `ref:` section and set algo.kl.coef: 0",
            ["algo.estimator", "algo.kl.coef", "ref"],
        )


def kl_coef_without_ref(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.kl.coef > 0` with `algo.kl.ref: model` but no `ref:` section (not on_policy_distill, which has its own
    rule).

    ## Why it matters
    A KL penalty against a model needs that model. In Molt 0.2.1 `kl.ref model` with a coefficient builds one
    implicitly (X7); a recipe makes it explicit with a `ref:` section, which also says where it is placed. (KL
    against the rollout policy, the default `kl.ref`, needs no model.)

    ## Example
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}
    ref: null
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}
    ref: {placement: colocate}
    ```

    ## References
    molt_rules.md B3, B8; molt_0_2_1.md X7
    """
    coef = recipe.algo.kl.coef
    if (
        coef > 0
        and recipe.ref is None
        and recipe.algo.estimator != "on_policy_distill"
        and recipe.algo.kl.ref == "model"
    ):
        yield diag(
            source,
            "algo.kl.coef",
            f"algo.kl.coef {coef} against a reference model (algo.kl.ref: model) needs one, but "
            f"{_no_section(source, 'ref')}",
            _add_section(source, "ref", "{placement: colocate}") + ", or set algo.kl.ref: rollout",
            ["ref", "algo.kl.ref"],
        )


def ref_without_kl(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A `ref:` section while `algo.kl.coef` is 0, or while the KL is measured against the rollout policy
    (`algo.kl.ref` rollout, Molt 0.2.1's default) — and the estimator is not on_policy_distill.

    ## Why it matters
    Nothing reads the reference log-probs; the model still takes GPUs or memory and a forward pass every step.

    ## Example
    ```yaml
    algo: {kl: {coef: 0.0}}
    ref: {placement: colocate}
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.0}}
    ref: null
    ```

    ## References
    molt_rules.md B8
    """
    kl = recipe.algo.kl
    if recipe.ref is None or recipe.algo.estimator == "on_policy_distill":
        return
    if kl.coef == 0:
        yield diag(
            source,
            "ref",
            "a `ref:` section is set but algo.kl.coef is 0: nothing uses it",
            "remove the `ref:` section, or set algo.kl.coef > 0",
            ["algo.kl.coef"],
        )
    elif kl.ref != "model":
        yield diag(
            source,
            "ref",
            "a `ref:` section is set but the KL is measured against the rollout "
            "policy (algo.kl.ref "
            + ("unset: Molt 0.2.1's default rollout" if kl.ref is None else "rollout")
            + "): nothing uses the reference model",
            "set algo.kl.ref: model to use it (Molt 0.1.6's meaning), or remove the `ref:` section",
            ["algo.kl.ref", "algo.kl.coef"],
        )


def dynamic_filtering_empty_range(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.dynamic_filtering.range` with `lo >= hi`.

    ## Why it matters
    A group is kept when its mean score is strictly inside (lo, hi). An empty interval drops every group, and the
    generator backfills forever. Molt asserts `lo < hi` in its CLI.

    ## Example
    ```yaml
    algo: {dynamic_filtering: {range: [0.9, 0.1]}}
    ```

    ## Use instead
    ```yaml
    algo: {dynamic_filtering: {range: [0.01, 0.99]}}
    ```

    ## References
    molt_rules.md C3, §2.N
    """
    df = recipe.algo.dynamic_filtering
    if df is not None and df.range[0] >= df.range[1]:
        yield diag(
            source,
            "algo.dynamic_filtering.range",
            f"algo.dynamic_filtering.range ({df.range[0]}, {df.range[1]}) is empty: every group is dropped",
            "use lo < hi, e.g. [0.01, 0.99]",
        )


def dynamic_filtering_with_single_sample(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Dynamic filtering with `rollout.n_samples_per_prompt <= 1`.

    ## Why it matters
    The filter keeps groups whose mean score is strictly between lo and hi. A one-rollout group scores exactly 0 or
    1 on a pass/fail task, so nearly every group is dropped. Molt asserts n > 1 in its CLI.

    ## Example
    ```yaml
    algo: {estimator: reinforce, dynamic_filtering: {range: [0.01, 0.99]}}
    rollout: {n_samples_per_prompt: 1, batch_size: 64}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: reinforce, dynamic_filtering: {range: [0.01, 0.99]}}
    rollout: {n_samples_per_prompt: 4, batch_size: 16}
    ```

    ## References
    molt_rules.md C3
    """
    n = recipe.rollout.n_samples_per_prompt
    if recipe.algo.dynamic_filtering is not None and n <= 1:
        yield diag(
            source,
            "algo.dynamic_filtering",
            f"dynamic filtering needs groups of several rollouts, but n_samples_per_prompt is {n}",
            "set rollout.n_samples_per_prompt to 2 or more, or remove algo.dynamic_filtering",
            ["rollout.n_samples_per_prompt"],
        )


def dynamic_filtering_with_builtin_distill_agent(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Dynamic filtering with on_policy_distill and no `agent:` (the built-in distill agent).

    ## Why it matters
    The built-in distillation agent returns reward 0 for every rollout, so every group's mean score is 0 and no
    group is ever strictly inside (lo, hi): the generator drops and backfills forever.

    ## Example
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0}, dynamic_filtering: {range: [0.01, 0.99]}}
    ref: {path: Qwen/Qwen3-30B-A3B}
    agent: null
    ```

    ## Use instead
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0}}
    ref: {path: Qwen/Qwen3-30B-A3B}
    agent: null
    ```

    ## References
    molt_rules.md B2, C3, §2.N
    """
    if (
        recipe.algo.estimator == "on_policy_distill"
        and recipe.agent is None
        and recipe.algo.dynamic_filtering is not None
    ):
        yield diag(
            source,
            "algo.dynamic_filtering",
            "the built-in distill agent scores every rollout 0, so dynamic filtering drops every group",
            "remove algo.dynamic_filtering, or give an `agent:` that scores rollouts",
            ["algo.estimator"],
        )
