"""Batch and step arithmetic of the FSDP roles (molt_rules.md §2.G)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules._base import diag, dv, fsdp_roles, is_set
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe


def _role_dps(recipe, derived) -> list[tuple[str, int]]:
    """(role, dp) for every built FSDP role whose dp differs from the ones before it (one report per distinct dp)."""
    out, seen = [], set()
    for role in fsdp_roles(recipe, derived):
        dp = dv(derived, f"{role}.dp")
        if dp is not None and dp not in seen:
            seen.add(dp)
            out.append((role, dp))
    return out


def _ref_size_key(source) -> str:
    return "ref.gpus_per_node" if is_set(source, "ref.gpus_per_node") else "ref.nodes"


def train_batch_not_divisible_by_dp(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    For every FSDP role (actor, a separately sized reference model, the SFT model):
    `train.batch_size = micro_batch_size × dp × grad_accum` with an integer `grad_accum`, unless dynamic batching.

    ## Why it matters
    Each FSDP group checks this equation in `setup_distributed` — the reference model too, although it never trains
    — and raises `ValueError` minutes into the job, after the cluster is allocated and the weights are loading.

    ## Example
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4}
    train: {batch_size: 66, micro_batch_size: 1}
    ```

    ## Use instead
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4}
    train: {batch_size: 64, micro_batch_size: 1}
    ```

    ## References
    molt_rules.md G4, G2, B25
    """
    t = recipe.train
    if getattr(t, "dynamic_batch", None) is not None:
        return
    for role, dp in _role_dps(recipe, derived):
        unit = t.micro_batch_size * dp
        if t.batch_size % unit == 0:
            continue
        lower, upper = t.batch_size // unit * unit, (t.batch_size // unit + 1) * unit
        fix = f"{lower} or {upper}" if lower else f"{upper}"
        if role == "ref":  # a separately sized reference group: its size is what differs from the actor
            path, who, size = _ref_size_key(source), " (the ref model's group)", ["ref.nodes", "ref.gpus_per_node"]
            fix += f", or size the ref group so that its dp divides {t.batch_size}"
        else:
            path, who, size = "train.batch_size", "", ["actor.gpus_per_node", "actor.mesh"]
        yield diag(
            source,
            path,
            f"train.batch_size {t.batch_size} is not a multiple of micro_batch_size {t.micro_batch_size} × "
            f"{role} dp {dp} = {unit}{who}",
            f"set train.batch_size to {fix}",
            ["train.batch_size", "train.micro_batch_size", *size],
        )


def rollout_samples_fewer_than_dp(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.batch_size × n_samples_per_prompt >= dp` of every FSDP role (actor, separate ref, critic).

    ## Why it matters
    Each step's samples are balanced over the data-parallel ranks; with fewer samples than ranks Molt raises
    "Cannot balance … samples across … DP ranks" inside the trainer (CLI assert for the actor; LATE for the others).

    ## Example
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {batch_size: 1, n_samples_per_prompt: 2}
    train: {batch_size: 4}
    ```

    ## Use instead
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {batch_size: 2, n_samples_per_prompt: 2}
    train: {batch_size: 4}
    ```

    ## References
    molt_rules.md G5, G6, G7
    """
    r = recipe.rollout
    samples = r.batch_size * r.n_samples_per_prompt
    for role, dp in _role_dps(recipe, derived):
        if samples < dp:
            yield diag(
                source,
                "rollout.batch_size",
                f"rollout.batch_size {r.batch_size} × n_samples_per_prompt {r.n_samples_per_prompt} = "
                f"{samples} samples per step < {role} dp {dp}: they cannot be balanced over the ranks",
                f"raise rollout.batch_size to at least {-(-dp // r.n_samples_per_prompt)}",
                ["rollout.n_samples_per_prompt", "actor.gpus_per_node"],
            )


def rollout_samples_below_train_batch(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Unless `train.force_on_policy`: `rollout.batch_size × n_samples_per_prompt >= train.batch_size`.

    ## Why it matters
    The trainer only steps on full accumulation windows of `train.batch_size` samples and drops the rest. With fewer
    samples per rollout batch, a rank has fewer micro-batches than `grad_accum`, and **no optimizer step is ever
    taken** — no error, the run just trains nothing.

    ## Example
    ```yaml
    rollout: {batch_size: 8, n_samples_per_prompt: 4}
    train: {batch_size: 64}
    ```

    ## Use instead
    ```yaml
    rollout: {batch_size: 16, n_samples_per_prompt: 4}
    train: {batch_size: 64}
    ```

    ## References
    molt_rules.md G8
    """
    r, t = recipe.rollout, recipe.train
    samples = r.batch_size * r.n_samples_per_prompt
    if not t.force_on_policy and not recipe.eval.only and samples < t.batch_size:
        yield diag(
            source,
            "rollout.batch_size",
            f"rollout.batch_size {r.batch_size} × n_samples_per_prompt {r.n_samples_per_prompt} = {samples} "
            f"samples per step < train.batch_size {t.batch_size}: no optimizer step is ever taken",
            f"raise rollout.batch_size to {-(-t.batch_size // r.n_samples_per_prompt)}, lower "
            "train.batch_size, or set train.force_on_policy: true",
            ["rollout.n_samples_per_prompt", "train.batch_size"],
        )


def rollout_samples_not_multiple_of_train_batch(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Unless `train.force_on_policy`: `rollout.batch_size × n_samples_per_prompt` is a multiple of `train.batch_size`.

    ## Why it matters
    The samples that do not fill a whole accumulation window are dropped every step (printed, not an error), so
    part of every rollout batch is generated for nothing.

    ## Example
    ```yaml
    rollout: {batch_size: 24, n_samples_per_prompt: 4}
    train: {batch_size: 64}
    ```

    ## Use instead
    ```yaml
    rollout: {batch_size: 32, n_samples_per_prompt: 4}
    train: {batch_size: 64}
    ```

    ## References
    molt_rules.md G8
    """
    r, t = recipe.rollout, recipe.train
    samples = r.batch_size * r.n_samples_per_prompt
    if not t.force_on_policy and not recipe.eval.only and samples > t.batch_size and samples % t.batch_size:
        yield diag(
            source,
            "rollout.batch_size",
            f"{samples} samples per step is not a multiple of train.batch_size {t.batch_size}: "
            f"{samples % t.batch_size} samples are dropped every step",
            f"make rollout.batch_size × n_samples_per_prompt a multiple of {t.batch_size}",
            ["rollout.n_samples_per_prompt", "train.batch_size"],
        )


def force_on_policy_with_several_epochs(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.force_on_policy: true` with `train.max_epochs != 1`.

    ## Why it matters
    force_on_policy makes the whole rollout batch one accumulation window, i.e. one optimizer step per batch; a
    second epoch would be off-policy. Molt rejects it in its CLI.

    ## Example
    ```yaml
    train: {force_on_policy: true, max_epochs: 2}
    ```

    ## Use instead
    ```yaml
    train: {force_on_policy: true, max_epochs: 1}
    ```

    ## References
    molt_rules.md G10
    """
    t = recipe.train
    if t.force_on_policy and t.max_epochs != 1:
        yield diag(
            source,
            "train.max_epochs",
            f"train.force_on_policy takes one optimizer step per rollout batch, but max_epochs is {t.max_epochs}",
            "set train.max_epochs: 1, or train.force_on_policy: false",
            ["train.force_on_policy"],
        )


def dynamic_batch_without_packing(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `train.dynamic_batch` while packing is off (`actor.packing: false`).

    ## Why it matters
    Dynamic batching packs sequences up to a token budget; Molt raises in its CLI without packed batches.

    ## Example
    ```yaml
    actor: {packing: false}
    train: {dynamic_batch: {max_tokens_per_gpu: 16384}}
    ```

    ## Use instead
    ```yaml
    actor: {packing: true}
    train: {dynamic_batch: {max_tokens_per_gpu: 16384}}
    ```

    ## References
    molt_rules.md G9, B5
    """
    if recipe.train.dynamic_batch is not None and not recipe.actor.packing:
        yield diag(
            source,
            "train.dynamic_batch",
            "train.dynamic_batch needs packed batches, but packing is off",
            "set actor.packing: true (text models), or remove train.dynamic_batch",
            ["actor.packing"],
        )


def dynamic_batch_smaller_than_dp(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    With `train.dynamic_batch`: `train.batch_size >= dp` of every trained role (the actor; gae's critic, whose dp is
    cp times the actor's under context parallelism: it runs whole sequences).

    ## Why it matters
    Under dynamic batching each rank takes `batch_size // dp` samples per step; with fewer samples than ranks that is
    0 and Molt divides by zero inside the trainer.

    ## Example
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4, packing: true}
    train: {batch_size: 2, dynamic_batch: {max_tokens_per_gpu: 16384}}
    ```

    ## Use instead
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4, packing: true}
    train: {batch_size: 64, dynamic_batch: {max_tokens_per_gpu: 16384}}
    ```

    ## References
    molt_rules.md G9
    """
    t = recipe.train
    # the trained roles (a reference only runs forwards over its shard): a critic's dp is derived only for gae
    dps = [(dp, role) for role in ("actor", "critic") if (dp := dv(derived, f"{role}.dp")) is not None]
    if t.dynamic_batch is None or not dps:
        return
    dp, role = max(dps)
    if t.batch_size < dp:
        who = "" if role == "actor" else f" ({role})"
        yield diag(
            source,
            "train.batch_size",
            f"train.batch_size {t.batch_size} < dp {dp}{who}: under dynamic batching each rank gets "
            f"{t.batch_size} // {dp} = 0 samples",
            f"set train.batch_size to at least {dp}",
            ["train.dynamic_batch", "actor.gpus_per_node"],
        )


def rank_samples_not_multiple_of_micro_batch(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Without dynamic batching: the samples each actor rank gets per step (`samples // dp`) are a multiple of
    `train.micro_batch_size`.

    ## Why it matters
    The replay loader uses `drop_last=True` with `batch_size=micro_batch_size`, so the trailing samples of every
    rank are silently dropped each step.

    ## Example
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {batch_size: 19, n_samples_per_prompt: 4}
    train: {force_on_policy: true, batch_size: 64, micro_batch_size: 2}
    ```

    ## Use instead
    ```yaml
    actor: {nodes: 1, gpus_per_node: 4}
    rollout: {batch_size: 16, n_samples_per_prompt: 4}
    train: {force_on_policy: true, batch_size: 64, micro_batch_size: 2}
    ```

    ## References
    molt_rules.md G8, G6
    """
    r, t = recipe.rollout, recipe.train
    dp = dv(derived, "actor.dp")
    if t.dynamic_batch is not None or not dp or t.micro_batch_size <= 1 or recipe.eval.only:
        return
    per_rank = r.batch_size * r.n_samples_per_prompt // dp
    if per_rank % t.micro_batch_size:
        yield diag(
            source,
            "train.micro_batch_size",
            f"each rank gets {per_rank} samples per step ({r.batch_size} × {r.n_samples_per_prompt} // dp "
            f"{dp}), not a multiple of micro_batch_size {t.micro_batch_size}: "
            f"{per_rank % t.micro_batch_size} sample(s) per rank are dropped",
            "make samples per rank a multiple of train.micro_batch_size",
            ["rollout.batch_size", "rollout.n_samples_per_prompt"],
        )


def dataset_smaller_than_batch(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    When the dataset is counted at compile time: RL prompts `>= rollout.batch_size`; SFT samples
    `>= train.batch_size`.

    ## Why it matters
    Steps per epoch are `len(data) // batch`. Zero steps: SFT raises `ValueError` after loading everything; RL
    builds a zero-length LR schedule and trains nothing.

    ## Example
    ```yaml
    rollout: {batch_size: 4096, n_samples_per_prompt: 4}
    train: {batch_size: 16384, micro_batch_size: 1}
    ```

    ## Use instead
    ```yaml
    rollout: {batch_size: 16, n_samples_per_prompt: 4}
    train: {batch_size: 64, micro_batch_size: 1}
    ```

    ## References
    molt_rules.md M6, B11
    """
    if recipe.kind == "sft":
        count, batch, path, data_key = (
            dv(derived, "data.sample_count"),
            recipe.train.batch_size,
            "train.batch_size",
            "data.dataset",
        )
    else:
        count, batch, path, data_key = (
            dv(derived, "data.prompt_count"),
            recipe.rollout.batch_size,
            "rollout.batch_size",
            "data.prompts",
        )
    if count is not None and not getattr(recipe.eval, "only", False) and count < batch:
        yield diag(
            source,
            path,
            f"{path} {batch} is larger than the dataset ({count} rows after max_samples): 0 steps per epoch",
            f"set {path} to at most {count}, or use a larger dataset",
            [data_key],
        )
