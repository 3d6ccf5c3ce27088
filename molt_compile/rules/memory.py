"""Memory per GPU against the GPU catalog (the estimate and its formulas: `molt_compile/memory.py`)."""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile import memory
from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts
from molt_compile.rules._base import diag, dv
from molt_compile.source import SourceMap
from schemas.catalog import GPUS
from schemas.recipe import RlRecipe, SftRecipe


def _report(recipe, derived, source):
    return memory.memory_report(recipe, derived, source)


def _fsdp_path(recipe, source) -> tuple[str, list[str]]:
    return "actor.gpus_per_node", [
        "actor.offload",
        "actor.mesh",
        "train.micro_batch_size",
        "data.max_len",
        "model.gradient_checkpoint",
        "cluster.gpu",
    ]


def fsdp_memory_exceeds_gpu(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The estimated memory of each FSDP GPU (parameters, gradients, optimizer states, activations of one micro-batch,
    overhead; colocated roles summed) fits the GPU's memory from the GPU catalog.

    ## Why it matters
    An out-of-memory error comes only after the cluster is allocated, the weights loaded and the first rollout batch
    generated — tens of minutes into the job. Formulas: `molt_compile/memory.py`.

    ## Example
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8, gpu: l40s-48gb}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {nodes: 1, gpus_per_node: 4, mesh: {ep: 4}, offload: none}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8, gpu: h200-141gb}
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {nodes: 1, gpus_per_node: 8, mesh: {ep: 8}, offload: none}
    ```

    ## References
    molt_rules.md B22, B18, B26, §3.2
    """
    report = _report(recipe, derived, source)
    if report is None:
        return
    for group in report.fsdp_groups:
        if group.total > group.capacity:
            path, related = _fsdp_path(recipe, source)
            yield diag(
                source,
                path,
                f"FSDP GPUs of {group.label}: about {memory.gib(group.total)} per GPU > {recipe.cluster.gpu} "
                f"{memory.gib(group.capacity)} ({group.breakdown()})",
                "add GPUs to the actor (more sharding), set actor.offload: optimizer, lower "
                "train.micro_batch_size or data.max_len, or raise actor.mesh.cp",
                related,
            )


def fsdp_memory_tight(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    The estimated FSDP memory per GPU is above 90 % of the GPU's memory (but fits).

    ## Why it matters
    The estimate is approximate (fragmentation, long-tail sequence lengths, NCCL buffers): above 90 % a run is
    likely to hit out-of-memory on an unlucky batch.

    ## Example
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8, gpu: l40s-48gb}
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    data: {max_len: 6144}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 1, gpus_per_node: 8, gpu: l40s-48gb}
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {offload: optimizer}
    data: {max_len: 6144}
    ```

    ## References
    molt_rules.md B22, §3.2
    """
    report = _report(recipe, derived, source)
    if report is None:
        return
    for group in report.fsdp_groups:
        if memory.TIGHT_FRACTION * group.capacity < group.total <= group.capacity:
            path, related = _fsdp_path(recipe, source)
            yield diag(
                source,
                path,
                f"FSDP GPUs of {group.label}: about {memory.gib(group.total)} per GPU, "
                f"{group.total / group.capacity:.0%} of {memory.gib(group.capacity)} ({group.breakdown()})",
                "leave headroom: actor.offload: optimizer, more actor GPUs, or a smaller micro-batch",
                related,
            )


def engine_weights_exceed_gpu_share(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    vLLM weights per engine GPU (`params × dtype bytes / (tp × pp)`) fit in `gpu_memory_utilization × GPU memory`.

    ## Why it matters
    vLLM raises at engine start when the weights do not fit its share, after the placement group is up.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    cluster: {gpu: l40s-48gb}
    rollout: {engines: 4, gpu_memory_utilization: 0.8}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-30B-A3B, arch: qwen3-30b-a3b}
    actor: {mesh: {ep: 4}}
    cluster: {gpu: l40s-48gb}
    rollout: {engines: 2, mesh: {tp: 2}, gpu_memory_utilization: 0.8}
    ```

    ## References
    molt_rules.md B16, §3.2
    """
    report = _report(recipe, derived, source)
    eng = report.engine if report is not None else None
    if eng is not None and eng.weights > eng.share:
        yield diag(
            source,
            "rollout.gpu_memory_utilization",
            f"engine weights need {memory.gib(eng.weights)} per GPU > gpu_memory_utilization "
            f"{recipe.rollout.gpu_memory_utilization} × {memory.gib(eng.capacity)} = {memory.gib(eng.share)}",
            "raise rollout.mesh.tp (weights split over more GPUs) or gpu_memory_utilization",
            ["rollout.mesh.tp", "rollout.dtype", "cluster.gpu"],
        )


def engine_kv_cache_too_small(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    After weights and ~1.5 GiB of activations/CUDA graphs, the engine's share holds the KV cache of at least one
    `data.max_len` sequence.

    ## Why it matters
    vLLM refuses to start when `max_model_len` does not fit in the KV cache ("larger than the maximum number of
    tokens that can be stored in KV cache"), after the cluster is up.

    ## Example
    ```yaml
    rollout: {gpu_memory_utilization: 0.25}
    data: {max_len: 32768}
    ```

    ## Use instead
    ```yaml
    rollout: {gpu_memory_utilization: 0.9}
    data: {max_len: 32768}
    ```

    ## References
    molt_rules.md B16
    """
    report = _report(recipe, derived, source)
    eng = report.engine if report is not None else None
    if eng is not None and eng.weights <= eng.share and eng.kv_room < eng.kv_per_sequence:
        yield diag(
            source,
            "rollout.gpu_memory_utilization",
            f"KV cache room {memory.gib(max(eng.kv_room, 0))} per engine GPU < one data.max_len "
            f"{recipe.data.max_len} sequence ({memory.gib(eng.kv_per_sequence)})",
            "raise rollout.gpu_memory_utilization or rollout.mesh.tp, or lower data.max_len",
            ["data.max_len", "rollout.mesh.tp"],
        )


def engine_memory_tight(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Engine weights plus runtime overhead take more than 90 % of the engine's share of GPU memory (but fit).

    ## Why it matters
    Little room remains for the KV cache, so vLLM runs few sequences at once: rollouts crawl and preempt.

    ## Example
    ```yaml
    rollout: {gpu_memory_utilization: 0.23}
    data: {max_len: 6144}
    ```

    ## Use instead
    ```yaml
    rollout: {gpu_memory_utilization: 0.8}
    data: {max_len: 6144}
    ```

    ## References
    molt_rules.md B16
    """
    report = _report(recipe, derived, source)
    eng = report.engine if report is not None else None
    if eng is None or eng.weights > eng.share or eng.kv_room < eng.kv_per_sequence:
        return
    used = eng.weights + memory.ENGINE_OVERHEAD_BYTES
    if used > memory.TIGHT_FRACTION * eng.share:
        yield diag(
            source,
            "rollout.gpu_memory_utilization",
            f"engine weights + overhead {memory.gib(used)} take {used / eng.share:.0%} of the "
            f"{memory.gib(eng.share)} share: KV cache room {memory.gib(eng.kv_room)}",
            "raise rollout.gpu_memory_utilization or rollout.mesh.tp",
            ["rollout.mesh.tp", "cluster.gpu"],
        )


def memory_not_estimated(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    Reports (info), on a GPU cluster, when memory cannot be estimated: `model.arch` is not set and `model.path` has
    no readable config.json here (a hub name, or a cluster path like /lustre).

    ## Why it matters
    The other MEM rules are silent then; say so instead of implying the recipe fits. Set `model.arch` to a catalog
    key to get the estimate.

    ## Example
    ```yaml
    model: {path: /lustre/models/custom-model, arch: null}
    ```

    ## Use instead
    ```yaml
    model: {path: /lustre/models/Qwen3-8B, arch: qwen3-8b}
    ```

    ## References
    schemas/catalog.py, molt_compile/memory.py
    """
    gpu = GPUS.get(recipe.cluster.gpu)
    if gpu is None or gpu.memory_gib <= 0:
        return
    if model_facts(recipe, source) is None:
        arch = recipe.model.arch
        why = "model.arch is not set" if not arch else f"model.arch `{arch}` is not a catalog key (MODEL004)"
        yield diag(
            source,
            "model.arch" if arch else "model.path",
            f"memory not estimated: {recipe.model.path} is not readable here and {why}",
            "set model.arch to a catalog key (`molt-compile explain` lists them)",
            ["model.arch", "model.path"],
        )


def weight_sync_buckets_exceed_engine_headroom(
    recipe: RlRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    Two weight-sync buckets (`weight_sync.bucket_bytes` each: one being received, one being loaded) fit in the part
    of an engine GPU that vLLM does not take, `(1 - gpu_memory_utilization) × GPU memory`.

    ## Why it matters
    vLLM pre-allocates its share (weights + KV cache) at start; the buckets of every weight sync are allocated
    outside it. When they do not fit, the first sync fails with an out-of-memory error after a whole rollout and
    training step, and every engine is left half-updated.

    ## Example
    ```yaml
    cluster: {gpu: h100-80gb}
    rollout: {engines: 2, gpu_memory_utilization: 0.99}
    ```

    ## Use instead
    ```yaml
    cluster: {gpu: h100-80gb}
    rollout: {engines: 2, gpu_memory_utilization: 0.9}
    ```

    ## References
    DESIGN §6 (weight sync), molt_rules.md B16
    """
    bucket = dv(derived, "weight_sync.bucket_bytes")
    gpu = GPUS.get(recipe.cluster.gpu)
    if recipe.rollout.engine != "vllm" or bucket is None or gpu is None or gpu.memory_gib <= 0:
        return
    headroom = (1 - recipe.rollout.gpu_memory_utilization) * gpu.memory_gib * 2**30
    if 2 * bucket > headroom:
        yield diag(
            source,
            "rollout.gpu_memory_utilization",
            f"weight sync holds 2 × {memory.gib(bucket)} buckets per engine GPU, but gpu_memory_utilization "
            f"{recipe.rollout.gpu_memory_utilization} leaves {memory.gib(headroom)} of {gpu.memory_gib} GiB",
            "lower rollout.gpu_memory_utilization",
            ["cluster.gpu"],
        )


def fsdp_host_memory_exceeds_node(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    With `actor.offload: optimizer | full`, the host memory the offload keeps on one node (optimizer states and
    parameter and gradient shards, 16 B/param over the world for AdamW, times the ranks on the node, for each
    trained role) fits the node's RAM from the GPU catalog.

    ## Why it matters
    Offload trades GPU memory for host memory: on a node short of RAM the kernel's out-of-memory killer ends a
    rank at its first optimizer step, after the cluster is allocated and the first rollout generated. Formulas:
    `molt_compile/memory.py`.

    ## Example
    ```yaml
    cluster: {nodes: 2, gpus_per_node: 8, gpu: h200-141gb}
    model: {path: zai-org/GLM-5.2, arch: glm-5.2, backend: automodel, attn: sdpa}
    actor: {nodes: 1, gpus_per_node: 8, mesh: {ep: 8}, offload: full}
    ```

    ## Use instead
    ```yaml
    cluster: {nodes: 9, gpus_per_node: 8, gpu: h200-141gb}
    model: {path: zai-org/GLM-5.2, arch: glm-5.2, backend: automodel, attn: sdpa}
    actor: {nodes: 8, gpus_per_node: 8, mesh: {ep: 64}, offload: full}
    ```

    ## References
    molt_rules.md §2.K (`--fsdp.offload`), molt_compile/memory.py
    """
    report = _report(recipe, derived, source)
    if report is None or report.host_capacity is None or report.host_per_node <= report.host_capacity:
        return
    yield diag(
        source,
        "actor.offload",
        f"CPU offload keeps about {memory.gib(report.host_per_node)} of host memory per node > the "
        f"{recipe.cluster.gpu} node's {memory.gib(report.host_capacity)} of RAM ({report.host_breakdown()})",
        "spread the actor over more nodes (fewer ranks per node, smaller shards), or actor.offload: none",
        ["actor.gpus_per_node", "actor.nodes", "cluster.gpu"],
    )
