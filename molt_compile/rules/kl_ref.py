"""KL against the rollout policy (Molt 0.2.1 `--algo.kl.ref`; molt_0_2_1.md §2, §3.5).

0.2.1 changed what a KL coefficient means: `kl.ref` defaults to `rollout`, so the reference log-probs are the
engine's own log-probs of the sampled tokens and no reference model is built (X3, X7). These rules report that
change where it alters an old recipe, and the combinations that are wrong under the new reference.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived, kl_ref_of
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import GROUP_ESTIMATORS, diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe

KL_REWARD_IGNORED = GROUP_ESTIMATORS | {"flash_reinforce"}
"""Estimators that do not read the per-token KL reward (C7, I10)."""


def _kl_to_rollout(recipe) -> bool:
    return recipe.algo.kl.coef > 0 and kl_ref_of(recipe) == "rollout"


def _runner_kind(recipe, source) -> str | None:
    from molt_compile.agent_check import inspect_agent
    from molt_compile.rules._base import agent_file_path

    f = agent_file_path(recipe, source)
    return inspect_agent(str(f)).runner if f is not None else None


def kl_k1_loss_against_rollout(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.kl.use_loss: true` with `algo.kl.estimator: k1` while the KL reference is the rollout policy
    (`algo.kl.ref: rollout`, the default) — whatever the coefficient.

    ## Why it matters
    The tokens are drawn from the rollout policy μ, so the k1 loss gradient is `E_μ[∇log π] = −∇KL(μ‖π)`:
    descending it *raises* the KL it should lower. Molt 0.2.1 refuses it in its CLI without looking at the
    coefficient, so `use_loss` with the default k1 fails even with KL off.

    ## Example
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k1, use_loss: true}}
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k3, use_loss: true}}
    ```

    ## References
    molt_0_2_1.md V6, §3.5 (molt_rules.md C2)
    """
    kl = recipe.algo.kl
    if kl_ref_of(recipe) == "rollout" and kl.use_loss and kl.estimator == "k1":
        yield diag(
            source,
            "algo.kl.estimator",
            "algo.kl.use_loss with estimator k1 against the rollout "
            "policy (algo.kl.ref rollout): its gradient raises KL(rollout || policy) instead of lowering it",
            "set algo.kl.estimator: k3 (or k2); or algo.kl.use_loss: false",
            ["algo.kl.use_loss", "algo.kl.ref"],
        )


def kl_ref_defaults_to_rollout(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.kl.coef > 0` with `algo.kl.ref` unset (not on_policy_distill): the KL is measured against the rollout
    policy, and no reference model is built for it.

    ## Why it matters
    This is where an old recipe changes meaning. Molt 0.1.6 built a reference model for any positive coefficient;
    0.2.1 defaults `kl.ref` to `rollout` (the engine's sampled-token log-probs) and builds reference workers only
    with `kl.ref: model` (X3, X7). The compiler says so instead of switching silently.

    ## Example
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k3, use_loss: true}}
    ```

    ## Use instead
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k3, use_loss: true, ref: rollout}}
    ```

    ## References
    molt_0_2_1.md X3, X7, §4 B3/B8 (molt_rules.md B3, B8)
    """
    kl = recipe.algo.kl
    if kl.coef > 0 and kl.ref is None and recipe.algo.estimator != "on_policy_distill":
        keep = (
            "; the `ref:` section is then unused (EST010): set algo.kl.ref: model to keep Molt 0.1.6's meaning"
            if recipe.ref is not None
            else "; Molt 0.1.6 built a reference model for this coefficient"
        )
        yield diag(
            source,
            "algo.kl.coef",
            f"algo.kl.coef {kl.coef} is KL against the rollout policy "
            "(Molt 0.2.1's default algo.kl.ref: rollout): no reference model is built" + keep,
            "write algo.kl.ref: rollout to keep this, or algo.kl.ref: model with a `ref:` section for a "
            "frozen reference",
            ["algo.kl.ref"],
        )


def distill_forces_kl_ref_model(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.kl.ref: rollout` under `algo.estimator: on_policy_distill`.

    ## Why it matters
    On-policy distillation measures the KL against the teacher: Molt 0.2.1 forces `kl.ref = model` on top of k1
    and the reward KL (X2). The recipe's `rollout` is overridden; the compiler reports it rather than rewriting
    silently.

    ## Example
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0, ref: rollout}}
    ref: {path: Qwen/Qwen3-32B}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: on_policy_distill, kl: {coef: 1.0}}
    ref: {path: Qwen/Qwen3-32B}
    ```

    ## References
    molt_0_2_1.md X2 (molt_rules.md B2)
    """
    if recipe.algo.estimator == "on_policy_distill" and recipe.algo.kl.ref == "rollout":
        yield diag(
            source,
            "algo.kl.ref",
            "on_policy_distill measures the KL against the teacher: algo.kl.ref is forced to model",
            "remove algo.kl.ref",
            ["algo.estimator"],
        )


def kl_to_rollout_without_logprobs(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    KL against the rollout policy (`algo.kl.coef > 0`, `kl.ref: rollout`) with a step agent (StepEnvRunner),
    importance-sampling correction off and no score centering.

    ## Why it matters
    The reference calls this the most consequential 0.2.1 trap: Molt's step agents ask the engine for log-probs
    only when IS is on or score centering is on, so the KL reference (`rollout_log_probs`) is missing and the first
    `make_experience` raises (L14) — after the cluster is up. It is exactly the README's "Enable KL
    regularization" row on a step agent. Chat agents are unaffected (their server always records log-probs).

    ## Example
    ```yaml
    algo: {kl: {coef: 0.001, estimator: k3, use_loss: true, ref: rollout}}
    ```

    ## Use instead
    ```yaml
    algo:
      kl: {coef: 0.001, estimator: k3, use_loss: true, ref: rollout}
      is_correction: {level: token, mode: mask, threshold: [0.5, 5.0]}
    ```

    ## References
    molt_0_2_1.md I1, L14 (molt_rules.md B14)
    """
    a = recipe.algo
    if not _kl_to_rollout(recipe) or a.is_correction.level != "off" or a.score_centering_top_k >= 2:
        return
    if _runner_kind(recipe, source) == "step":
        yield diag(
            source,
            "algo.kl.coef",
            "KL against the rollout policy needs the engine's log-probs, "
            "but a step agent records them only with IS correction or score centering: Molt fails at the "
            "first make_experience (L14)",
            "turn on algo.is_correction (level token), or set algo.kl.ref: model with a `ref:` section",
            ["algo.kl.ref", "algo.is_correction.level", "agent.path"],
        )


def kl_reward_against_rollout(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    KL against the rollout policy folded into the reward (`use_loss: false`) with an estimator that reads it
    (reinforce, gae).

    ## Why it matters
    The per-token reward becomes `−β·(log π_old − log μ)`: a pure train/sampler mismatch term, about zero on-policy
    and exactly zero when the log-probs match bit for bit. It regularises nothing toward a reference. Molt's README
    pairs `kl.ref rollout` with `use_loss` and k3.

    ## Example
    ```yaml
    algo: {estimator: reinforce, kl: {coef: 0.001, estimator: k3, ref: rollout},
           is_correction: {level: token}}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: reinforce, kl: {coef: 0.001, estimator: k3, use_loss: true, ref: rollout},
           is_correction: {level: token}}
    ```

    ## References
    molt_0_2_1.md I2, §3.5 (molt_rules.md C7)
    """
    a = recipe.algo
    if _kl_to_rollout(recipe) and not a.kl.use_loss and a.estimator not in KL_REWARD_IGNORED | {"on_policy_distill"}:
        yield diag(
            source,
            "algo.kl.use_loss",
            "a KL reward against the rollout policy is only the "
            "train/sampler mismatch (about 0 on-policy): it pulls the policy toward nothing",
            "set algo.kl.use_loss: true with estimator k3, or algo.kl.ref: model with a `ref:` section",
            ["algo.kl.ref", "algo.kl.coef"],
        )


def kl_reward_with_flash_reinforce(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `algo.estimator: flash_reinforce` with a KL coefficient folded into the reward (`use_loss: false`).

    ## Why it matters
    flash_reinforce's advantage is each sample's reward minus the batch mean; it ignores the per-token KL reward
    (and gamma, lambda and whitening), so the coefficient does nothing.

    ## Example
    ```yaml
    algo: {estimator: flash_reinforce, kl: {coef: 0.001, estimator: k2, ref: model}}
    ref: {placement: colocate}
    ```

    ## Use instead
    ```yaml
    algo: {estimator: flash_reinforce, kl: {coef: 0.001, estimator: k2, use_loss: true, ref: model}}
    ref: {placement: colocate}
    ```

    ## References
    molt_0_2_1.md I10, §3.1 (molt_rules.md C7)
    """
    kl = recipe.algo.kl
    if recipe.algo.estimator == "flash_reinforce" and kl.coef > 0 and not kl.use_loss:
        yield diag(
            source,
            "algo.kl.use_loss",
            f"flash_reinforce ignores the per-token KL reward: algo.kl.coef {kl.coef} has no effect",
            "set algo.kl.use_loss: true (estimator k2 or k3), or algo.kl.coef: 0",
            ["algo.estimator", "algo.kl.coef"],
        )
