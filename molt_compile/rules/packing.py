"""Packing, attention implementation and backend path; VLM context parallelism (molt_rules.md §2.H)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import CUSTOM_NATIVE_ATTN, Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.catalog import MODELS
from schemas.recipe import RlRecipe, SftRecipe

PACKING_ATTN = ("te", "flash_attention_2", "tilelang")
CPU_PACKING_ATTN = ("sdpa", "eager")


def _packing(recipe, derived) -> bool:
    return bool(dv(derived, "actor.packing", recipe.actor.packing))


def packing_with_unsupported_attention(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.packing: true` with an attention implementation that cannot run packed batches on the cluster's device:
    on a GPU cluster, `model.attn` other than te, flash_attention_2 or tilelang; on a `cluster.gpu: cpu` cluster,
    other than sdpa or eager.

    ## Why it matters
    Packed (varlen/THD) batches need attention that keeps the packed sequences apart. On GPUs that is a kernel that
    takes sequence offsets, and Molt rejects other kernels in its RL and SFT CLIs. There is no such kernel on CPU
    (flash-attention, te and tilelang are CUDA-only); there this project's runtime packs through transformers'
    packed-sequence mask instead: with position ids restarting at 0 per sequence and no attention mask, transformers
    builds a block-diagonal causal mask that sdpa and eager attention apply (`masking_utils`
    `find_packed_sequence_indices`). Only those two are tested equal to the padded path.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, attn: sdpa}
    actor: {packing: true}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, attn: flash_attention_2}  # on cluster.gpu: cpu, attn: sdpa
    actor: {packing: true}
    ```

    ## References
    molt_rules.md H2, §2.O item 10
    """
    attn = recipe.model.attn
    if not _packing(recipe, derived):
        return
    if recipe.cluster.gpu == "cpu":
        if attn not in CPU_PACKING_ATTN:
            yield diag(
                source,
                "model.attn",
                f"actor.packing on a cpu cluster needs attention sdpa or "
                f"eager (transformers' packed-sequence mask), got {attn}",
                "set model.attn: sdpa",
                ["actor.packing", "cluster.gpu"],
            )
    elif attn not in PACKING_ATTN:
        yield diag(
            source,
            "model.attn",
            f"actor.packing needs attention te, flash_attention_2 or tilelang, got {attn}",
            "use flash_attention_2 (HF models) or te (AutoModel custom models)",
            ["actor.packing"],
        )


def packing_custom_model_with_flash_attention(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Packing on an AutoModel custom (native) model with `model.attn: flash_attention_2`.

    ## Why it matters
    Custom models pack only through te or tilelang; Molt raises "packing_samples with AutoModel custom models
    requires te" when each actor builds its model. flash_attention_2 packing works only on the HF fallback.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, attn: flash_attention_2}
    actor: {packing: true, mesh: {ep: 4}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, attn: te}
    actor: {packing: true, mesh: {ep: 4}}
    ```

    ## References
    molt_rules.md H3
    """
    facts = model_facts(recipe, source)
    if (
        _packing(recipe, derived)
        and recipe.model.attn == "flash_attention_2"
        and facts is not None
        and dv(derived, "model.backend") != "hf"
    ):
        yield diag(
            source,
            "model.attn",
            f"{facts.key} is an AutoModel custom model: it packs only with "
            "attention te or tilelang, not flash_attention_2",
            "set model.attn: te",
            ["actor.packing"],
        )


def hf_model_with_automodel_attention(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A model on the HF transformers path with `model.attn` te or tilelang.

    ## Why it matters
    te and tilelang are AutoModel custom-model kernels; the HF fallback turns the TE path off, and HF packing needs
    flash_attention_2 ("HF model packing requires flash_attention_2").

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, attn: te}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b, attn: flash_attention_2}
    ```

    ## References
    molt_rules.md H5, H9
    """
    facts = model_facts(recipe, source)
    attn = recipe.model.attn
    if attn in ("te", "tilelang") and dv(derived, "model.backend") == "hf":
        who = "model.backend hf" if recipe.model.backend == "hf" else f"{facts.key} (HF fallback)"
        yield diag(
            source,
            "model.attn",
            f"attention {attn} exists only for AutoModel custom models, but {who} runs on HF transformers",
            "set model.attn: flash_attention_2 (or sdpa without packing)",
            ["model.backend"],
        )


def packing_architecture_without_thd(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Packing with te/tilelang on an AutoModel custom architecture whose implementation does not consume THD packing
    arguments (per the model catalog).

    ## Why it matters
    Molt raises "AutoModel custom implementation for this architecture does not consume THD packing kwargs" when
    each actor builds the model.

    ## Example
    ```yaml
    model: {path: nvidia/Nemotron-3-Nano-Omni, arch: nemotron-3-nano-omni-30b-a3b, attn: te}
    actor: {packing: true, mesh: {ep: 4}}
    ```

    ## Use instead
    ```yaml
    model: {path: nvidia/Nemotron-3-Nano-Omni, arch: nemotron-3-nano-omni-30b-a3b, attn: te}
    actor: {packing: false, mesh: {ep: 4}}
    ```

    ## References
    molt_rules.md H4
    """
    facts = model_facts(recipe, source)
    if (
        _packing(recipe, derived)
        and recipe.model.attn in ("te", "tilelang")
        and facts is not None
        and dv(derived, "model.backend") != "hf"
        and not facts.thd_packing
    ):
        yield diag(
            source,
            "actor.packing",
            f"{facts.key}'s AutoModel implementation does not consume THD packing arguments",
            "set actor.packing: false (use actor.mesh.cp for long sequences)",
            ["model.arch"],
        )


TILELANG_ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
"""Architectures whose nemo-automodel 0.7.0 implementation has TileLang kernels that Molt's automodel backend runs
(`components/models/glm_moe_dsa`: the DSA lighting indexer and sparse MLA)."""


def tilelang_without_dsa_kernels(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `model.attn: tilelang` on the automodel backend for an architecture whose nemo-automodel implementation has no
    TileLang kernels (all but GLM-5.2, `GlmMoeDsaForCausalLM`).

    ## Why it matters
    tilelang is not an attention of its own: it selects the DeepSeek-style sparse attention (DSA) kernels of
    nemo-automodel's GLM-5.2 layers. Its other models build their attention from `BackendConfig.attn` through a
    dense-attention factory that has no tilelang, so the job would fail when each actor builds its model.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, attn: tilelang}
    actor: {packing: true, mesh: {ep: 4}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, attn: te}
    actor: {packing: true, mesh: {ep: 4}}
    ```

    ## References
    molt_rules.md H5; nemo-automodel 0.7.0 `BackendConfig.attn` ("For GLM DSA, tilelang and cudnn select their
    respective packed sparse-attention kernels")
    """
    facts = model_facts(recipe, source)
    if (
        recipe.model.attn == "tilelang"
        and facts is not None
        and dv(derived, "model.backend") != "hf"
        and facts.architecture not in TILELANG_ARCHITECTURES
    ):
        yield diag(
            source,
            "model.attn",
            f"attention tilelang selects nemo-automodel's GLM-5.2 sparse-attention kernels; {facts.key} "
            f"({facts.architecture}) has none",
            "set model.attn: te (packed) or sdpa",
            ["model.arch"],
        )


def tilelang_not_bf16(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `model.attn: tilelang` with `model.param_dtype` other than bf16.

    ## Why it matters
    nemo-automodel's TileLang DSA kernels run in bf16 only: its GLM-5.2 layers cast the latent query and key to
    bf16 for them and hand their bf16 output to the output projection, which fails in any other compute dtype
    (and its indexer refuses non-bf16 inputs).

    ## Example
    ```yaml
    model: {path: zai-org/GLM-5.2, arch: glm-5.2, attn: tilelang, param_dtype: fp32}
    actor: {packing: true}
    ```

    ## Use instead
    ```yaml
    model: {path: zai-org/GLM-5.2, arch: glm-5.2, attn: tilelang, param_dtype: bf16}
    actor: {packing: true}
    ```

    ## References
    molt_rules.md H5 (tilelang is an AutoModel custom-model kernel); nemo-automodel 0.7.0
    `glm_moe_dsa/optimized_kernels.py` (`should_use_tilelang`, require_bf16)
    """
    if recipe.model.attn == "tilelang" and recipe.model.param_dtype != "bf16":
        yield diag(
            source,
            "model.param_dtype",
            f"attention tilelang runs in bf16 only (nemo-automodel's DSA kernels), not {recipe.model.param_dtype}",
            "set model.param_dtype: bf16",
            ["model.attn"],
        )


def attention_replaced_by_sdpa(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Reports (info) that an AutoModel custom model without packing runs sdpa when `model.attn` is not te, sdpa,
    flex or tilelang (e.g. flash_attention_2).

    ## Why it matters
    Molt prints a notice and switches silently; the compiler shows the value that really runs.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, attn: flash_attention_2}
    actor: {mesh: {ep: 4}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b, attn: sdpa}
    actor: {mesh: {ep: 4}}
    ```

    ## References
    molt_rules.md B20, B19
    """
    facts = model_facts(recipe, source)
    attn = recipe.model.attn
    if (
        not _packing(recipe, derived)
        and attn not in CUSTOM_NATIVE_ATTN
        and facts is not None
        and dv(derived, "model.backend") != "hf"
    ):
        yield diag(
            source,
            "model.attn",
            f"{facts.key} is an AutoModel custom model without packing: attention {attn} runs as sdpa",
            "set model.attn: sdpa (or te) to say what runs",
        )


def vlm_context_parallel_without_cp_hook(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    A VLM with `actor.mesh.cp > 1` whose model has no AutoModel CP hook (`prepare_model_inputs_for_cp`).

    ## Why it matters
    Molt raises "VLM + CP requires the model's AutoModel CP hook" at the first training forward, after the whole
    setup and the first rollout batch.

    ## Example
    ```yaml
    model: {path: ./models/vlm-no-cp-hook, arch: null}
    actor: {mesh: {cp: 2}}
    ```

    ## Use instead
    ```yaml
    model: {path: ./models/vlm-no-cp-hook, arch: null}
    actor: {mesh: {cp: 1}}
    ```

    ## References
    molt_rules.md H8, §2.O item 11
    """
    facts = model_facts(recipe, source)
    if facts is not None and facts.is_vlm and recipe.actor.mesh.cp > 1 and not facts.cp_hook:
        yield diag(
            source,
            "actor.mesh.cp",
            f"actor.mesh.cp {recipe.actor.mesh.cp} on VLM {facts.key}, which has no AutoModel CP hook",
            "set actor.mesh.cp: 1",
            ["model.arch"],
        )


def vlm_context_parallel_freezes_visual_encoder(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Reports (info) that a VLM with `actor.mesh.cp > 1` trains with its visual encoder frozen.

    ## Why it matters
    Molt forces `freeze_visual_encoder` on under CP (RL and SFT) whatever the recipe says; the compiler shows it.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b, attn: te}
    actor: {mesh: {cp: 2, ep: 4}, freeze: {visual_encoder: false}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b, attn: te}
    actor: {mesh: {cp: 2, ep: 4}, freeze: {visual_encoder: true}}
    ```

    ## References
    molt_rules.md B23
    """
    facts = model_facts(recipe, source)
    if facts is not None and facts.is_vlm and recipe.actor.mesh.cp > 1 and not recipe.actor.freeze.visual_encoder:
        yield diag(
            source,
            "actor.freeze.visual_encoder",
            f"with actor.mesh.cp {recipe.actor.mesh.cp}, "
            f"the visual encoder of {facts.key} is frozen (only the language model trains)",
            "set actor.freeze.visual_encoder: true to say so",
            ["actor.mesh.cp"],
        )


def unknown_model_arch(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `model.arch`, when set, is a key of the model catalog (`schemas/catalog.py`).

    ## Why it matters
    The architecture decides MoE, VLM, MTP and backend rules and the memory estimate; a typo would silently turn
    all of them off (or fall back to a config.json that may describe another model).

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8B-instruct}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    ```

    ## References
    schemas/catalog.py; molt_rules.md F6 (MoE detection), H9 (backend path)
    """
    arch = recipe.model.arch
    if arch is not None and arch not in MODELS:
        import difflib  # a did-you-mean only: not imported by every compile

        close = difflib.get_close_matches(arch.lower(), MODELS, n=1, cutoff=0.5)
        yield diag(
            source,
            "model.arch",
            f"model.arch {arch!r} is not in the model catalog",
            (f"did you mean {close[0]!r}? " if close else "") + "or remove model.arch to read "
            "<model.path>/config.json; `molt-compile explain` lists the catalog",
        )


SHAPE_CHECKS = (
    "tensor-parallel head splits (PAR006, VLLM009), MoE and expert checks (MOE006, MOE007, MOE011, MOE012, MOE014, "
    "DEAD005, LORA003), the memory estimate (MEM001-MEM005), and the backend, packing and VLM checks (PAR004, "
    "PACK002-PACK004, MODEL001-MODEL003, DATA004, DEAD009, LORA004)"
)
"""The rules that read the model's shape (`model_facts`): silent when it is unknown."""


def model_shape_unknown(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `model.arch` is not set and the model's shape cannot be read at all: `model.path` has no readable config.json
    here (a cluster path) and is not the hub id of a catalog row (`molt-compile catalog models`; `Qwen/Qwen3-8B` is
    the `qwen3-8b` row).

    ## Why it matters
    Every check that needs the model's heads, experts, parameters or architecture is off then, and a recipe that
    would fail on the cluster (a TP size that does not split the heads, expert parallelism on a dense model, a
    model that does not fit) compiles clean. The warning names those checks instead of implying they passed.

    ## Example
    ```yaml
    model: {path: /lustre/models/my-qwen3-8b-sft, arch: null}
    ```

    ## Use instead
    ```yaml
    model: {path: /lustre/models/my-qwen3-8b-sft, arch: qwen3-8b}
    ```

    ## References
    schemas/catalog.py, molt_compile/model_facts.py; issue 30
    """
    if recipe.model.arch is None and model_facts(recipe, source) is None:
        yield diag(
            source,
            "model.path",
            f"model.path {recipe.model.path}: no config.json is readable here and it is not a catalog hub id, and "
            f"model.arch is not set: these checks are off: {SHAPE_CHECKS}",
            "set model.arch to the catalog key of its architecture (`molt-compile catalog models`), or compile where "
            "the checkpoint is",
            ["model.arch"],
        )
