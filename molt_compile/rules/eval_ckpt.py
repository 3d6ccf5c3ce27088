"""Eval and checkpoint cadences (molt_rules.md §2.M, A6)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag, dv, is_set
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe


def eval_cadence_zero(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `eval.every` is -1 (never; SFT: once per epoch) or a positive number of steps, never 0.

    ## Why it matters
    Molt computes `global_step // eval_steps`: 0 raises ZeroDivisionError at the first step, after the whole setup.

    ## Example
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: 0}
    ```

    ## Use instead
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: 5}
    ```

    ## References
    molt_rules.md M1, B12
    """
    if recipe.eval.every == 0:
        yield diag(
            source,
            "eval.every",
            "eval.every 0 divides by zero at the first step",
            "use a positive number of steps, or -1 for never",
        )


def ckpt_cadence_zero(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `ckpt.every` is -1 (never) or a positive number of steps, never 0.

    ## Why it matters
    Molt computes `global_step % save_steps`: 0 raises ZeroDivisionError at the first step.

    ## Example
    ```yaml
    ckpt: {every: 0}
    ```

    ## Use instead
    ```yaml
    ckpt: {every: 10}
    ```

    ## References
    molt_rules.md M1, B12
    """
    if recipe.ckpt.every == 0:
        yield diag(
            source,
            "ckpt.every",
            "ckpt.every 0 divides by zero at the first step",
            "use a positive number of steps, or -1 for never",
        )


def eval_only_without_dataset(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `eval.only: true` without `eval.dataset`.

    ## Why it matters
    An eval-only run scores the eval set and exits; without one there is nothing to do. Molt asserts it in its CLI
    and again in the trainer.

    ## Example
    ```yaml
    eval: {only: true, dataset: null}
    ```

    ## Use instead
    ```yaml
    eval: {only: true, dataset: data/prompts.jsonl}
    ```

    ## References
    molt_rules.md A6, J4
    """
    if recipe.eval.only and recipe.eval.dataset is None:
        yield diag(source, "eval.only", "eval.only needs eval.dataset", "set eval.dataset", ["eval.dataset"])


def eval_settings_without_dataset(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Eval cadence or sampling settings (`eval.every`, `eval.at_start`, ...) written without an `eval.dataset`.

    ## Why it matters
    Without a dataset no eval ever runs; the settings suggest otherwise.

    ## Example
    ```yaml
    eval: {every: 5, at_start: true}
    ```

    ## Use instead
    ```yaml
    eval: {every: 5, at_start: true, dataset: data/prompts.jsonl}
    ```

    ## References
    molt_rules.md B13, M3
    """
    if recipe.eval.dataset is not None:
        return
    written = [
        k
        for k in ("every", "at_start", "batch_size", "n_samples_per_prompt", "temperature", "top_p", "max_new_tokens")
        if is_set(source, f"eval.{k}")
    ]
    if written and not getattr(recipe.eval, "only", False):
        yield diag(
            source,
            f"eval.{written[0]}",
            f"eval.{', eval.'.join(written)} set, but there is no eval.dataset: no eval runs",
            "set eval.dataset, or remove the eval settings",
        )


def eval_dataset_never_used(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    RL: an `eval.dataset` with `eval.every: -1`, no `at_start` and not `only`.

    ## Why it matters
    The dataset is loaded but never evaluated (RL's -1 means never; SFT's means once per epoch).

    ## Example
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: -1}
    ```

    ## Use instead
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: 10}
    ```

    ## References
    molt_rules.md B12, M3
    """
    e = recipe.eval
    if e.dataset is not None and e.every == -1 and not e.at_start and not e.only:
        yield diag(
            source,
            "eval.every",
            "eval.dataset is set but eval.every is -1 (never) and at_start is false: it is never evaluated",
            "set eval.every to a number of steps",
            ["eval.dataset"],
        )


def run_saves_nothing(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `ckpt.every: -1` together with `ckpt.final_save: false` (and not eval-only).

    ## Why it matters
    The run trains and then keeps no weights at all: no resumable checkpoint and no HF export.

    ## Example
    ```yaml
    ckpt: {every: -1, final_save: false}
    ```

    ## Use instead
    ```yaml
    ckpt: {every: -1, final_save: true}
    ```

    ## References
    molt_rules.md M4, M5
    """
    c = recipe.ckpt
    if c.every == -1 and not c.final_save and not getattr(recipe.eval, "only", False):
        yield diag(
            source,
            "ckpt.final_save",
            "ckpt.final_save false and ckpt.every -1: the trained weights are never saved",
            "set ckpt.final_save: true or a ckpt.every cadence",
            ["ckpt.every"],
        )


LARGE_JOB_GPUS = 32
"""From this many GPUs a job without mid-run checkpoints earns a note (CKPT005)."""


def large_job_without_checkpoints(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A job of 32 GPUs or more with `ckpt.every: -1` (no checkpoint before the end; not eval-only).

    ## Why it matters
    Legal, and right for a short run; but on many GPUs a node failure or a time limit is likely, and without a
    checkpoint every GPU-hour up to it is lost (a Slurm requeue resumes from a checkpoint: none is there).

    ## Example
    ```yaml
    cluster: {nodes: 4, gpus_per_node: 8}
    actor: {nodes: 2, gpus_per_node: 8}
    rollout: {engines: 16}
    ckpt: {every: -1}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 4, gpus_per_node: 8}
    actor: {nodes: 2, gpus_per_node: 8}
    rollout: {engines: 16}
    ckpt: {every: 50, resume: true}
    ```

    ## References
    molt_rules.md M4, M5; DESIGN.md (Slurm requeue)
    """
    used = dv(derived, "cluster.used_gpus", 0) or 0
    if recipe.ckpt.every == -1 and used >= LARGE_JOB_GPUS and not getattr(recipe.eval, "only", False):
        yield diag(
            source,
            "ckpt.every",
            f"a {used}-GPU job with ckpt.every -1 saves no checkpoint before it ends: a failure or a time limit "
            "loses the whole run",
            "set ckpt.every to a cadence (and ckpt.resume: true to continue after a requeue)",
            ["cluster.nodes"],
        )


def _explicit_best_key(recipe: RlRecipe) -> str | None:
    key = recipe.ckpt.best_metric_key
    return None if key in ("", "none") else key


def best_metric_without_eval(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `ckpt.best_metric_key` names a metric but no eval runs during training: no `eval.dataset`, no eval cadence
    (`eval.every: -1` and no `eval.at_start`), or `eval.only`.

    ## Why it matters
    The best checkpoint is saved after eval rounds (Molt's `save_best_checkpoint` runs on the eval payload); without
    them it is never written, and the run keeps only the newest `ckpt.keep` saves although the recipe asked for
    the best one.

    ## Example
    ```yaml
    ckpt: {best_metric_key: eval/pass1}   # no eval section
    ```

    ## Use instead
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: 10}
    ckpt: {best_metric_key: eval/pass1}
    ```

    ## References
    molt_rules.md §1 `--ckpt.best_metric_key`, B30, §4.3 step 2
    """
    from molt_compile.lower.rl import evals_during_training

    if _explicit_best_key(recipe) and not evals_during_training(recipe, derived):
        yield diag(
            source,
            "ckpt.best_metric_key",
            f"ckpt.best_metric_key {recipe.ckpt.best_metric_key!r} is never measured: no eval runs during training",
            'set eval.dataset with eval.every (or eval.at_start), or drop the key ("none" turns it off)',
        )


def best_metric_unknown(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `ckpt.best_metric_key` is one of the eval metrics the runtime reports where higher is better: `eval/pass1`,
    `eval/reward_mean`, `eval/pass@k` for the k reported with `eval.n_samples_per_prompt` samples.

    ## Why it matters
    A key no eval round carries never improves, so no best checkpoint is ever written. Molt's keys are named per
    datasource (`eval_<source>_pass1`); this runtime reports one set over the whole eval set, under `eval/`.

    ## Example
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: 10}
    ckpt: {best_metric_key: eval_math_pass1}
    ```

    ## Use instead
    ```yaml
    eval: {dataset: data/prompts.jsonl, every: 10}
    ckpt: {best_metric_key: eval/pass1}   # or "" for the default (eval/pass1)
    ```

    ## References
    molt_rules.md §1 `--ckpt.best_metric_key`, B30; runtime/metrics.py (eval/*)
    """
    from molt_compile.lower.rl import eval_metric_keys, evals_during_training

    key = _explicit_best_key(recipe)
    if key and evals_during_training(recipe, derived):
        known = eval_metric_keys(derived.value("eval.n_samples_per_prompt"))
        if key not in known:
            yield diag(
                source,
                "ckpt.best_metric_key",
                f"ckpt.best_metric_key {key!r} is not an eval metric this run reports",
                f'use one of {", ".join(known)} ("" is eval/pass1)',
            )
