"""Data sources and model paths (molt_rules.md §2.L, B5, H7; the agent file is `agent_file.py`).

Data and model paths are checked only as warnings, and only when they are relative (they ship with the recipe):
an absolute path such as /lustre/... is usually visible only on the cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.paths import path_base
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftData, SftRecipe

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow", ".txt")


def _sources(spec: str) -> list[str]:
    return [s.strip().split("@", 1)[0] for s in spec.split(",") if s.strip()]


def prompt_probs_count_mismatch(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The number of interleave probabilities (`data.prompt_probs`, SFT `data.dataset_probs`) equals the number of
    comma-separated sources.

    ## Why it matters
    Molt asserts it when the generator (or SFT trainer) loads the datasets, after the cluster is up.

    ## Example
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.5, 0.3, 0.2]}
    ```

    ## Use instead
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.5, 0.5]}
    ```

    ## References
    molt_rules.md L3
    """
    probs, key, n = _mix(recipe)
    if probs is not None and len(probs) != n:
        yield diag(
            source,
            key,
            f"{key} has {len(probs)} probabilities for {n} source(s)",
            f"give exactly {n} probabilities",
            [key.replace("_probs", "s" if recipe.kind == "rl" else "")],
        )


def interleave_probs_not_a_distribution(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    The interleave probabilities (`data.prompt_probs`, SFT `data.dataset_probs`) are each > 0 and sum to 1 (to
    1e-8), when there is one per source (DATA001 checks that).

    ## Why it matters
    Molt interleaves with `datasets.interleave_datasets(..., stopping_strategy="all_exhausted")`: numpy refuses
    probabilities that do not sum to 1, and datasets refuses a source that is never drawn (it could never be
    exhausted), when the job loads the data, after the cluster is up. The compiler counts the mix with the same draws
    (`schemas.schedule.interleaved_rows`) and needs a distribution too.

    ## Example
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.6, 0.6]}
    ```

    ## Use instead
    ```yaml
    data: {prompts: "data/prompts.jsonl,data/prompts.jsonl", prompt_probs: [0.5, 0.5]}
    ```

    ## References
    molt_rules.md §1.1 (`--data.prompt_probs`), L3
    """
    from schemas.schedule import probs_problem

    probs, key, n = _mix(recipe)
    if probs is not None and len(probs) == n and (problem := probs_problem(n, probs)):
        yield diag(source, key, f"{key}: {problem}", "give one probability > 0 per source, summing to 1")


def packing_with_vlm(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.packing: true` on a VLM run (RL: `data.max_images_per_prompt > 0`; SFT: `data.image_key` set).

    ## Why it matters
    Packing is text-only. Molt's SFT CLI raises; its RL CLI prints a warning and silently turns packing off. The
    compiler never rewrites a value silently, so both are errors with the same fix.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b}
    actor: {packing: true, mesh: {ep: 4}}
    data: {max_images_per_prompt: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b}
    actor: {packing: false, mesh: {ep: 4}}
    data: {max_images_per_prompt: 1}
    ```

    ## References
    molt_rules.md B5, H7
    """
    if not recipe.actor.packing:
        return
    if recipe.kind == "sft" and recipe.data.image_key:
        yield diag(
            source,
            "actor.packing",
            f"packing is text-only, but data.image_key {recipe.data.image_key!r} makes this a VLM SFT run",
            "set actor.packing: false (use actor.mesh.cp for long sequences)",
            ["data.image_key"],
        )
    elif recipe.kind == "rl" and recipe.data.max_images_per_prompt > 0:
        yield diag(
            source,
            "actor.packing",
            f"packing is text-only, but data.max_images_per_prompt "
            f"{recipe.data.max_images_per_prompt} makes this a VLM run (Molt would turn packing off)",
            "set actor.packing: false",
            ["data.max_images_per_prompt"],
        )


def local_data_file_missing(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Relative data files (prompts, SFT dataset, eval dataset) with a data-file suffix exist next to the recipe.

    ## Why it matters
    A relative path ships with the recipe, so a missing file is most likely a typo; the run would fail when the
    generator loads it. Absolute paths and hub names are not checked (they may exist only on the cluster).

    ## Example
    ```yaml
    data: {prompts: data/promts.jsonl}
    ```

    ## Use instead
    ```yaml
    data: {prompts: data/prompts.jsonl}
    ```

    ## References
    molt_rules.md A4, L3
    """
    keys = ["data.dataset" if recipe.kind == "sft" else "data.prompts", "eval.dataset"]
    for key in keys:
        base = path_base(source, key)
        if base is None:
            return
        section, field = key.split(".")
        spec = getattr(getattr(recipe, section), field)
        for src in _sources(spec or ""):
            p = Path(src)
            if not p.is_absolute() and p.suffix.lower() in DATA_SUFFIXES and not (base / p).exists():
                yield diag(
                    source,
                    key,
                    f"{key}: {src} does not exist (relative to {base})",
                    "fix the path; a relative path is resolved against the file that sets it (the project root for --set)",
                )


def images_on_text_model(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Images enabled (`data.max_images_per_prompt > 0`, SFT `data.image_key`) for a model that has no vision encoder.

    ## Why it matters
    vLLM rejects `limit_mm_per_prompt` for a text-only model at engine start, and the trainer has no vision tower;
    SFT loads the model's image processor for `image_key`, which a text-only model does not have (Molt raises
    `ValueError` at job start, H15). An error here, not a job that dies at step 0.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    data: {max_images_per_prompt: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    data: {max_images_per_prompt: 0}
    ```

    ## References
    molt_rules.md B16, H15
    """
    facts = model_facts(recipe, source)
    if facts is None or facts.is_vlm:
        return
    if recipe.kind == "rl" and recipe.data.max_images_per_prompt > 0:
        yield diag(
            source,
            "data.max_images_per_prompt",
            f"data.max_images_per_prompt {recipe.data.max_images_per_prompt} but {facts.key} is a text-only model",
            "set data.max_images_per_prompt: 0, or use a VLM",
            ["model.arch"],
        )
    elif recipe.kind == "sft" and recipe.data.image_key:
        yield diag(
            source,
            "data.image_key",
            f"data.image_key set but {facts.key} is a text-only model",
            "remove data.image_key, or use a VLM",
            ["model.arch"],
        )


def local_model_path_missing(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    A local `model.path` (or `ref.path` / `critic.path`) exists and holds weights (`*.safetensors`, `*.bin`,
    `*.pt`/`*.pth`, or their index files). Local: relative and starting with `./` or `../` or with more than two
    path parts, or absolute on a file system visible here (its first directory exists on this machine).

    ## Why it matters
    Such a path cannot be a hub name (`org/name`), so a missing directory, or one without weights (a tokenizer or
    config copied alone), fails when every actor loads the checkpoint, after the cluster is up. Absolute paths on
    file systems this machine does not mount are not checked.

    ## Example
    ```yaml
    model: {path: ./models/tiny-qwen3-typo, arch: tiny-qwen3}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    ```

    ## References
    molt_rules.md A1, B9
    """
    keys = ["model.path"] + [f"{r}.path" for r in ("ref", "critic") if getattr(recipe, r, None) is not None]
    for key in keys:
        base = path_base(source, key)
        if base is None:
            return
        section, field = key.split(".")
        value = getattr(getattr(recipe, section), field)
        if not value:
            continue
        p = Path(value)
        if p.is_absolute():
            visible = len(p.parts) > 2 and _is_dir(Path(*p.parts[:2]))  # /lustre on a laptop: not checkable
            if visible and not _exists(p):
                yield diag(source, key, f"{key}: {value} does not exist", "fix the path (or use a hub name)")
                continue
            local, where = visible, p
        else:
            local, where = value.startswith(("./", "../")) or len(p.parts) > 2, base / p
            if local and not _exists(where):
                yield diag(
                    source,
                    key,
                    f"{key}: {value} does not exist (relative to {base})",
                    "fix the path, or use an absolute cluster path / a hub name",
                )
                continue
        if local and _is_dir(where) and not _has_weights(where):
            yield diag(
                source,
                key,
                f"{key}: {value} holds no weights (no *.safetensors, *.bin or *.pt files)",
                "point it at the checkpoint directory itself (config.json next to the weight files)",
            )


WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json")


def _has_weights(directory: Path) -> bool:
    try:
        return any(next(directory.glob(pattern), None) is not None for pattern in WEIGHT_PATTERNS)
    except OSError:
        return True  # unreadable here: nothing to say


def _exists(path: Path) -> bool:
    return os.path.exists(path)  # False, not OSError, for a name over NAME_MAX


def _is_dir(path: Path) -> bool:
    return os.path.isdir(path)


# ---------------------------------------------------------------------------------------------- agent


def _mix(recipe) -> tuple[list[float] | None, str, int]:
    """The data mix of a recipe: its probabilities, their key, and how many sources they weigh."""
    d = recipe.data
    spec, probs, key = (
        (d.dataset, d.dataset_probs, "data.dataset_probs")
        if isinstance(d, SftData)
        else (d.prompts, d.prompt_probs, "data.prompt_probs")
    )
    return probs, key, len(_sources(spec))
