"""LoRA adapters on the trained model (Molt 0.2.1 `--actor.lora_*`, `--model.lora_*`; molt_0_2_1.md §3.7).

Molt finds a bad adapter target only when each actor patches its model (L10–L12); the recipe and the model's
config decide all of it, so these rules check it at compile time.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe

TOP_LEVEL_MODULES = frozenset({"lm_head", "model"})
"""Module names of a causal LM that hold no dot (every other full name does)."""
LORA_MIN_LR = 1e-5
"""Below this AdamW lr Molt warns under LoRA (strategy.py:337-343): adapters usually need ~1e-4."""


def lora_negative_rank(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.lora.dim` is not negative.

    ## Why it matters
    Molt's test is `lora_dim > 0`: any value ≤ 0 silently means full fine-tuning, so a sign typo trains (and
    exports) the whole model. 0 is the way to say "off".

    ## Example
    ```yaml
    actor: {lora: {dim: -16}}
    ```

    ## Use instead
    ```yaml
    actor: {lora: {dim: 16}}
    ```

    ## References
    molt_0_2_1.md I13(a), F1 (molt_rules.md §1)
    """
    if recipe.actor.lora.dim < 0:
        yield diag(
            source,
            "actor.lora.dim",
            f"actor.lora.dim {recipe.actor.lora.dim} < 0 would silently mean full fine-tuning",
            "use a positive rank such as 16, or 0 for full fine-tuning",
        )


def lora_target_matches_nothing(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Each `actor.lora.target_modules` pattern can match a full module name: it holds a `*` or a `.` (or is a
    top-level module such as `lm_head`).

    ## Why it matters
    Patterns are matched against **full** names (`model.layers.0.self_attn.q_proj`); a bare leaf name such as
    `q_proj` matches nothing, and with no adapter patched Molt raises "matched no modules" in every actor (L10).

    ## Example
    ```yaml
    actor: {lora: {dim: 16, target_modules: [q_proj, v_proj]}}
    ```

    ## Use instead
    ```yaml
    actor: {lora: {dim: 16, target_modules: ["*.q_proj", "*.v_proj"]}}
    ```

    ## References
    molt_0_2_1.md L10, F3 (molt_rules.md §1)
    """
    lora = recipe.actor.lora
    if lora.dim <= 0:
        return
    for i, pattern in enumerate(lora.target_modules or ()):
        if "*" not in pattern and "." not in pattern and pattern not in TOP_LEVEL_MODULES:
            yield diag(
                source,
                f"actor.lora.target_modules.{i}",
                f"LoRA target {pattern!r} is matched against full module names and matches nothing",
                f"write '*.{pattern}'",
            )


def lora_on_moe_without_targets(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    LoRA on a mixture-of-experts model without explicit `actor.lora.target_modules`.

    ## Why it matters
    The default (every linear layer) patches the router gate and the grouped experts; Molt's weight sync cannot
    merge grouped-expert adapters and raises in every RL actor (L12), and a patched router changes routing.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}, lora: {dim: 16}}
    rollout: {expert_parallel: true}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}, lora: {dim: 16, target_modules: ["*.self_attn.*_proj"]}}
    rollout: {expert_parallel: true}
    ```

    ## References
    molt_0_2_1.md I13(b), L12 (molt_rules.md I1)
    """
    lora = recipe.actor.lora
    facts = model_facts(recipe, source) if lora.dim > 0 and not lora.target_modules else None
    if facts is not None and facts.experts > 1:
        yield diag(
            source,
            "actor.lora",
            f"LoRA on MoE model {facts.key} ({facts.experts} experts) with "
            "every linear layer as target: the router and the grouped experts are patched",
            "name the targets, e.g. target_modules: ['*.self_attn.*_proj']",
            ["model.arch"],
        )


def lora_on_tied_head(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    LoRA on a model with tied input/output embeddings whose targets may patch `lm_head`: no explicit targets, or
    a target naming `lm_head`.

    ## Why it matters
    A tied head shares its weight with the embedding; Molt's weight sync skips it, so the engines never see the
    head adapter, and Molt refuses it in every RL actor (L11).

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-4B-Instruct-2507, arch: qwen3-4b}
    actor: {lora: {dim: 16, target_modules: ["*.q_proj", "lm_head"]}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-4B-Instruct-2507, arch: qwen3-4b}
    actor: {lora: {dim: 16, target_modules: ["*.q_proj"]}}
    ```

    ## References
    molt_0_2_1.md I13(c), L11 (molt_rules.md H5)
    """
    lora = recipe.actor.lora
    if lora.dim <= 0:
        return
    targets = lora.target_modules or []
    head = [t for t in targets if "lm_head" in t]
    facts = model_facts(recipe, source) if head or not targets else None
    if facts is not None and facts.tie_embeddings:
        what = f"target {head[0]!r}" if head else "every linear layer (the default)"
        yield diag(
            source,
            "actor.lora.target_modules" if head else "actor.lora",
            f"{facts.key} ties lm_head to the embeddings, and LoRA on {what} patches lm_head",
            "name targets that exclude lm_head, e.g. ['*.self_attn.*_proj', '*.mlp.*_proj']",
            ["model.arch"],
        )


def lora_low_learning_rate(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    LoRA with an AdamW learning rate below 1e-5.

    ## Why it matters
    Adapters start at zero (`lora_B = 0`) and need a much larger step than full fine-tuning (typically 1e-4);
    at a full-fine-tuning lr they barely move. Molt prints the same warning at optimizer build.

    ## Example
    ```yaml
    actor: {lora: {dim: 16}, optimizer: {lr: 1.0e-6}}
    ```

    ## Use instead
    ```yaml
    actor: {lora: {dim: 16}, optimizer: {lr: 1.0e-4}}
    ```

    ## References
    molt_0_2_1.md I13(d), §2.4 new warnings (molt_rules.md §1)
    """
    a = recipe.actor
    if a.lora.dim > 0 and a.optimizer.name == "adam" and a.optimizer.lr < LORA_MIN_LR:
        yield diag(
            source,
            "actor.optimizer.lr",
            f"actor.optimizer.lr {a.optimizer.lr:g} is low for LoRA adapters (they start at zero)",
            "use about 1e-4",
            ["actor.lora.dim"],
        )
