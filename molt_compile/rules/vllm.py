"""vLLM rollout engine rules (molt_rules.md §2.I, B15, H12)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag, dv, is_set
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe


def uni_executor_with_tensor_parallel(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.executor: uni` with `rollout.mesh.tp > 1`.

    ## Why it matters
    The uni executor runs the engine in one process on one GPU; vLLM raises "backend 'uni' only supports
    tensor_parallel_size=1" inside the engine actor.

    ## Example
    ```yaml
    rollout: {engines: 2, executor: uni, mesh: {tp: 2}}
    ```

    ## Use instead
    ```yaml
    rollout: {engines: 2, executor: auto, mesh: {tp: 2}}
    ```

    ## References
    molt_rules.md I2, B15
    """
    ro = recipe.rollout
    if ro.engine == "vllm" and ro.executor == "uni" and ro.mesh.tp > 1:
        yield diag(
            source,
            "rollout.executor",
            f"rollout.executor uni runs one GPU per engine, but rollout.mesh.tp is {ro.mesh.tp}",
            "set rollout.executor: auto (mp or ray is derived), or rollout.mesh.tp: 1",
            ["rollout.mesh.tp"],
        )


def pipeline_parallel_engine_without_ray(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.mesh.pp > 1` with an executor other than `ray` (set explicitly to uni or mp, with dp 1).

    ## Why it matters
    vLLM pipeline parallelism across stages needs the ray executor; the engine raises at init otherwise.

    ## Example
    ```yaml
    rollout: {engines: 2, executor: mp, mesh: {pp: 2}}
    ```

    ## Use instead
    ```yaml
    rollout: {engines: 2, executor: ray, mesh: {pp: 2}}
    ```

    ## References
    molt_rules.md I3
    """
    ro = recipe.rollout
    if ro.engine == "vllm" and ro.mesh.pp > 1 and ro.mesh.dp == 1 and ro.executor in ("uni", "mp"):
        yield diag(
            source,
            "rollout.executor",
            f"rollout.mesh.pp {ro.mesh.pp} needs the ray executor, got {ro.executor}",
            "set rollout.executor: ray (or auto)",
            ["rollout.mesh.pp"],
        )


def data_parallel_engine_without_mp(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.mesh.dp > 1` with an executor other than `mp` (set explicitly to uni or ray).

    ## Why it matters
    vLLM data parallelism inside one engine needs the mp executor (single node); the engine raises at init.
    (Molt's qwen3.6 launch script comment says DP needs ray — the code says mp.)

    ## Example
    ```yaml
    rollout: {engines: 2, executor: ray, mesh: {dp: 2}}
    ```

    ## Use instead
    ```yaml
    rollout: {engines: 2, executor: mp, mesh: {dp: 2}}
    ```

    ## References
    molt_rules.md I4
    """
    ro = recipe.rollout
    if ro.engine == "vllm" and ro.mesh.dp > 1 and ro.executor in ("uni", "ray"):
        yield diag(
            source,
            "rollout.executor",
            f"rollout.mesh.dp {ro.mesh.dp} needs the mp executor, got {ro.executor}",
            "set rollout.executor: mp (or auto)",
            ["rollout.mesh.dp"],
        )


def engine_data_parallel_with_pipeline_parallel(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.mesh.dp > 1` together with `rollout.mesh.pp > 1`.

    ## Why it matters
    DP needs the mp executor and PP needs ray; no executor does both, and Molt's engine raises at init.

    ## Example
    ```yaml
    rollout: {engines: 1, mesh: {dp: 2, pp: 2}}
    ```

    ## Use instead
    ```yaml
    rollout: {engines: 2, mesh: {dp: 2, pp: 1}}
    ```

    ## References
    molt_rules.md I5
    """
    m = recipe.rollout.mesh
    if recipe.rollout.engine == "vllm" and m.dp > 1 and m.pp > 1:
        yield diag(
            source,
            "rollout.mesh.pp",
            f"rollout.mesh.pp {m.pp} with dp {m.dp}: pp needs the ray executor, dp the mp executor",
            "use more engines instead of engine dp, or set rollout.mesh.dp: 1",
            ["rollout.mesh.dp"],
        )


def mp_engine_wider_than_node(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    An engine on the mp (or uni) executor needs `tp × dp` GPUs on one node: `tp × dp <= cluster.gpus_per_node`.

    ## Why it matters
    An mp engine is one Ray placement-group bundle of `tp × dp` GPUs, and a bundle cannot span nodes. Molt then
    waits on `shared_pg.ready()` with no timeout: the job hangs forever. Cross-node engines need `executor: ray`.

    ## Example
    ```yaml
    cluster: {nodes: 3, gpus_per_node: 8}
    rollout: {engines: 1, executor: mp, mesh: {tp: 16}}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 3, gpus_per_node: 8}
    rollout: {engines: 1, executor: ray, mesh: {tp: 16}}
    ```

    ## References
    molt_rules.md I6, I7, §3.3
    """
    ro = recipe.rollout
    executor = dv(derived, "rollout.executor", ro.executor)
    width = ro.mesh.tp * ro.mesh.dp
    gpn = recipe.cluster.gpus_per_node
    if ro.engine == "vllm" and executor in ("mp", "uni") and width > gpn:
        yield diag(
            source,
            "rollout.mesh.tp" if ro.mesh.tp > 1 else "rollout.mesh.dp",
            f"an {executor} engine needs tp {ro.mesh.tp} × dp {ro.mesh.dp} = {width} GPUs on one node, but "
            f"nodes have {gpn}: the placement group never becomes ready",
            f"set rollout.executor: ray for cross-node engines, or keep tp × dp <= {gpn}",
            ["cluster.gpus_per_node", "rollout.executor"],
        )


def hf_engine_with_parallel_mesh(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.engine: hf` with an engine mesh larger than one device (`tp × pp × dp > 1`).

    ## Why it matters
    The HF engine runs `transformers.generate` in one actor on one device; it has no tensor, pipeline or data
    parallelism, so the extra GPUs would be reserved and never used.

    ## Example
    ```yaml
    rollout: {engine: hf, engines: 2, mesh: {tp: 2}}
    ```

    ## Use instead
    ```yaml
    rollout: {engine: hf, engines: 4, mesh: {tp: 1}}
    ```

    ## References
    DESIGN.md §6 (rollout engines)
    """
    ro = recipe.rollout
    width = ro.mesh.tp * ro.mesh.pp * ro.mesh.dp
    if ro.engine == "hf" and width > 1:
        yield diag(
            source,
            "rollout.mesh",
            f"rollout.engine hf uses one device per engine, but the mesh asks for {width}",
            "set rollout.mesh to tp 1, pp 1, dp 1 and add engines instead",
            ["rollout.engine"],
        )


RECURRENT_STATE_ARCHITECTURES = ("Qwen3_5Moe", "Qwen3Next", "NemotronH")
"""Architecture-name prefixes of hybrid models whose layers keep a recurrent state besides the KV cache (gated
delta net, Mamba2)."""


def hf_engine_on_hybrid_model(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.engine: hf` for a hybrid model whose linear-attention or Mamba layers keep a recurrent state besides
    the KV cache (Qwen3.5/3.6-MoE's gated delta net, Nemotron-H's Mamba2).

    ## Why it matters
    The HF engine decodes its slots through one paged key/value cache (runtime/engines/hf_decode.py); a gated delta
    net or Mamba layer asks that cache for its recurrent state, which it does not hold, so every rollout fails
    (`'SlotKVCache' object has no attribute 'has_previous_state'`, seen on the tiny Qwen3.5-MoE VLM) and the run
    trains nothing. vLLM serves these models.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b}
    rollout: {engine: hf}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3.6-35B-A3B, arch: qwen3.6-35b-a3b}
    rollout: {engine: vllm}
    ```

    ## References
    runtime/engines/hf_decode.py; tests/bench_vlm_automodel.py (its hf-engine attempt); vLLM serves them with its
    own state caches (its hybrid-model support); schemas/catalog.py (the hybrid rows)
    """
    facts = model_facts(recipe, source)
    if recipe.rollout.engine != "hf" or facts is None:
        return
    if facts.architecture.startswith(RECURRENT_STATE_ARCHITECTURES):
        yield diag(
            source,
            "rollout.engine",
            f"rollout.engine hf cannot decode {facts.key} ({facts.architecture}): its linear-attention / Mamba "
            "layers keep a recurrent state the hf engine's key/value cache does not hold, so every rollout would fail",
            "set rollout.engine: vllm",
            ["model.path", "model.arch"],
        )


OMNI_ARCHITECTURES = ("NemotronH_Nano_Omni",)
"""Nemotron-Omni's config.json architectures (the catalog's and the checkpoint's own `..._Reasoning_V3`)."""


def omni_vision_tower_not_synced(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Nemotron-Omni with image prompts on vLLM engines and `actor.freeze.visual_encoder: false`.

    ## Why it matters
    The weight sync streams one tensor per parameter under the checkpoint's names (runtime/nemotron_omni.py
    `engine_names`), and vLLM's RADIO tower loads its attention only as the checkpoint's fused `attn.qkv`, which is
    three of the trainer's parameters (nemo-automodel's RADIO has q_proj, k_proj, v_proj). So the tower is not sent:
    trained, it would drift from the tower the engines generate with, and every rollout would be off-policy in a way
    the importance weights do not show. Molt's omni3 scripts freeze it.

    ## Example
    ```yaml
    model: {path: nvidia/NVIDIA-Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16, arch: nemotron-3-nano-omni-30b-a3b}
    actor: {freeze: {visual_encoder: false}}
    data: {max_images_per_prompt: 1}
    ```

    ## Use instead
    ```yaml
    model: {path: nvidia/NVIDIA-Nemotron-3-Nano-Omni-30B-A3B-Reasoning-BF16, arch: nemotron-3-nano-omni-30b-a3b}
    actor: {freeze: {visual_encoder: true}}
    data: {max_images_per_prompt: 1}
    ```

    ## References
    runtime/nemotron_omni.py `engine_names`; vLLM's radio.py `load_weights` (legacy `attn.qkv` names only);
    recipes/omni3_30b_geo3k.yaml (Molt's script freezes the tower)
    """
    facts = model_facts(recipe, source)
    if recipe.rollout.engine != "vllm" or recipe.data.max_images_per_prompt == 0 or facts is None:
        return
    if facts.architecture.startswith(OMNI_ARCHITECTURES) and not recipe.actor.freeze.visual_encoder:
        yield diag(
            source,
            "actor.freeze.visual_encoder",
            f"{facts.key}'s vision tower would train but never reach the vLLM engines: they load its attention only "
            "as the checkpoint's fused attn.qkv, which the weight sync (one tensor per parameter) cannot send",
            "set actor.freeze.visual_encoder: true (the projector and the language model train and sync)",
            ["rollout.engine", "data.max_images_per_prompt", "model.arch"],
        )


def max_new_tokens_exceeds_context(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.max_new_tokens` (and `eval.max_new_tokens`) smaller than `data.max_len`.

    ## Why it matters
    The prompt budget is `max_len − max_new_tokens`. At zero or less every text prompt is left-truncated to
    nothing and every VLM prompt raises "VLM prompt length … exceeds max_initial_length" in the runner.

    ## Example
    ```yaml
    rollout: {max_new_tokens: 4096}
    data: {max_len: 4096}
    ```

    ## Use instead
    ```yaml
    rollout: {max_new_tokens: 3072}
    data: {max_len: 4096}
    ```

    ## References
    molt_rules.md H12, B16, §6.1
    """
    max_len = recipe.data.max_len
    for key in ("rollout.max_new_tokens", "eval.max_new_tokens"):
        section, field = key.split(".")
        value = getattr(getattr(recipe, section), field)
        if value is not None and value >= max_len:
            yield diag(
                source,
                key,
                f"{key} {value} leaves no room for the prompt in data.max_len {max_len}",
                f"set {key} below {max_len} (or raise data.max_len)",
                ["data.max_len"],
            )


def decode_context_parallel_not_dividing_tp(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.decode_context_parallel_size` divides `rollout.mesh.tp`.

    ## Why it matters
    vLLM's decode context parallelism splits the KV cache across the ranks of the TP group; its parallel config
    rejects a size that does not divide the TP size when the engine starts.

    ## Example
    ```yaml
    rollout: {engines: 2, mesh: {tp: 2}, decode_context_parallel_size: 4}
    ```

    ## Use instead
    ```yaml
    rollout: {engines: 2, mesh: {tp: 2}, decode_context_parallel_size: 2}
    ```

    ## References
    vLLM ParallelConfig (decode_context_parallel_size); molt_rules.md B16
    """
    ro = recipe.rollout
    dcp = ro.decode_context_parallel_size
    if dcp > 1 and ro.mesh.tp % dcp:
        yield diag(
            source,
            "rollout.decode_context_parallel_size",
            f"rollout.decode_context_parallel_size {dcp} does not divide rollout.mesh.tp {ro.mesh.tp}",
            "use a divisor of rollout.mesh.tp",
            ["rollout.mesh.tp"],
        )


MOE_BACKENDS = ("triton", "flashinfer_trtllm", "flashinfer_cutlass")
"""vLLM fused-MoE backends named by Molt 0.2.1's help (train_rl_ray.py:756-762)."""


def logprobs_for_centering_or_kl(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The engine is asked for processed log-probs because of score centering or KL against the rollout policy, with
    IS correction off.

    ## Why it matters
    Molt 0.2.1 switches vLLM to `logprobs_mode: processed_logprobs` (and `logprobs=k` under centering) in its CLI
    whenever any of IS, centering or KL-to-rollout reads them (X6); before 0.2.1 only IS did. Reported so the
    engine setting is visible.

    ## Example
    ```yaml
    algo: {score_centering_top_k: 8}
    ```

    ## Use instead
    ```yaml
    algo: {score_centering_top_k: 0}
    ```

    ## References
    molt_0_2_1.md X6, §4 B14 (molt_rules.md B14)
    """
    if recipe.algo.is_correction.level != "off" or not dv(derived, "rollout.logprobs", False):
        return
    k = dv(derived, "rollout.top_logprobs", 0)
    why = f"score centering (top {k} log-probs per token)" if k else "the KL against the rollout policy"
    yield diag(
        source,
        "algo.score_centering_top_k" if k else "algo.kl.coef",
        f"{why} reads the engine's processed log-probs: logprobs_mode processed_logprobs (X6)",
        "nothing to change; this reports an engine setting the compiler derived",
    )


def unknown_moe_backend(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.moe_backend` is one of triton, flashinfer_trtllm, flashinfer_cutlass.

    ## Why it matters
    Molt passes the string to vLLM unvalidated, and unknown engine arguments are dropped with a notice, so a typo
    silently runs the default kernel.

    ## Example
    ```yaml
    rollout: {moe_backend: flashinfer}
    ```

    ## Use instead
    ```yaml
    rollout: {moe_backend: flashinfer_cutlass}
    ```

    ## References
    molt_0_2_1.md F13, I16 (molt_rules.md B16)
    """
    b = recipe.rollout.moe_backend
    if b is not None and b not in MOE_BACKENDS:
        yield diag(
            source,
            "rollout.moe_backend",
            f"rollout.moe_backend {b!r} is not a vLLM fused-MoE backend ({', '.join(MOE_BACKENDS)})",
            "use one of them, or remove rollout.moe_backend",
        )


def router_balance_without_cache_aware(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `rollout.router_balance_abs` or `rollout.router_balance_rel` written with a `router_policy` other than
    cache_aware.

    ## Why it matters
    Only the cache_aware policy has a rebalance trigger; under any other policy the thresholds do nothing.

    ## Example
    ```yaml
    rollout: {router_policy: consistent_hash, router_balance_abs: 32}
    ```

    ## Use instead
    ```yaml
    rollout: {router_policy: cache_aware, router_balance_abs: 32}
    ```

    ## References
    molt_0_2_1.md F11, F12, I16 (molt_rules.md §3.1)
    """
    ro = recipe.rollout
    for key in ("router_balance_abs", "router_balance_rel"):
        if is_set(source, f"rollout.{key}") and ro.router_policy != "cache_aware":
            yield diag(
                source,
                f"rollout.{key}",
                f"rollout.{key} is used only by router_policy cache_aware, not {ro.router_policy}",
                f"remove rollout.{key}",
                ["rollout.router_policy"],
            )
