"""Rollout section: engines, executor, GPUs per engine and bundle, the engines' share of the cluster."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from molt_compile.derive.algo import derive_molt021_rollout
from molt_compile.derive.roles import COLOCATED_GPU_FRACTION
from molt_compile.derive.values import Builder

if TYPE_CHECKING:
    from schemas.recipe import RlRecipe


def derive_rollout(b: Builder, r: RlRecipe) -> None:
    ro = r.rollout
    m = ro.mesh
    per_engine = m.tp * m.pp * m.dp
    b.add(
        "rollout.gpus_per_engine",
        per_engine,
        f"tp {m.tp} × pp {m.pp} × dp {m.dp}",
        ("rollout.mesh.tp", "rollout.mesh.pp", "rollout.mesh.dp"),
    )
    executor = _executor(b, ro, per_engine)
    engine_gpus: float
    if executor == "mp":
        engine_gpus, bundle_gpus, bundles = m.tp * m.dp, m.tp * m.dp, ro.engines
        why = f"mp: one bundle of tp × dp = {m.tp * m.dp} GPUs per engine, on one node (§3.1)"
    elif executor == "uni" or per_engine == 1:
        engine_gpus, bundle_gpus, bundles = 1, 1, ro.engines * per_engine
        why = "one GPU per engine (§3.1)"
    else:
        engine_gpus, bundle_gpus, bundles = 0, 1, ro.engines * per_engine
        why = f"ray: the engine actor holds no GPU; its {per_engine} workers take one bundle of 1 GPU each (§3.1)"
    colocated = ro.placement == "colocate"
    b.add("rollout.colocated", colocated, "rollout.placement", ("rollout.placement",))
    if colocated:
        engine_gpus = COLOCATED_GPU_FRACTION
        why = "colocated: the engine takes 0.2 GPU of its actor rank's bundle, like a colocated FSDP model (B33)"
    b.add(
        "rollout.engine_num_gpus",
        engine_gpus,
        why,
        ("rollout.executor", "rollout.gpus_per_engine", "rollout.placement"),
    )
    b.add("rollout.bundle_gpus", bundle_gpus, why, ("rollout.executor", "rollout.gpus_per_engine"))
    b.add(
        "rollout.bundles",
        bundles,
        f"{bundles} bundles of {bundle_gpus} GPU in one PACK group (§3.1)",
        ("rollout.engines", "rollout.executor", "rollout.gpus_per_engine"),
    )
    b.add(
        "rollout.total_gpus",
        ro.engines * per_engine,
        f"engines {ro.engines} × {per_engine} GPUs per engine",
        ("rollout.engines", "rollout.gpus_per_engine"),
    )
    b.add(
        "rollout.own_gpus",
        0 if colocated else ro.engines * per_engine,
        "colocated: the engines use the actor's GPUs" if colocated else "rollout.total_gpus",
        ("rollout.total_gpus", "rollout.placement"),
    )
    ep = m.tp * m.dp if ro.expert_parallel else 1
    b.add(
        "rollout.expert_parallel_size",
        ep,
        f"expert_parallel: tp {m.tp} × dp {m.dp} (I8)" if ro.expert_parallel else "expert_parallel off",
        ("rollout.expert_parallel", "rollout.mesh.tp", "rollout.mesh.dp"),
    )
    b.add("rollout.max_model_len", r.data.max_len, "vLLM max_model_len is data.max_len (B16)", ("data.max_len",))
    if ro.generate_batch_size is None:
        b.add(
            "rollout.generate_batch_size",
            ro.batch_size,
            "generate_batch_size unset: rollout.batch_size (B4)",
            ("rollout.generate_batch_size", "rollout.batch_size"),
        )
    else:
        b.add(
            "rollout.generate_batch_size", ro.generate_batch_size, "set in the recipe", ("rollout.generate_batch_size",)
        )
    b.add("rollout.runners", max(1, ro.runners), f"max(1, rollout.runners {ro.runners}) (B27)", ("rollout.runners",))
    b.add(
        "rollout.samples_per_step",
        ro.batch_size * ro.n_samples_per_prompt,
        f"batch_size {ro.batch_size} prompt groups × n_samples_per_prompt {ro.n_samples_per_prompt}",
        ("rollout.batch_size", "rollout.n_samples_per_prompt"),
    )
    is_on = r.algo.is_correction.level != "off"
    b.add(
        "algo.is_correction.enabled",
        is_on,
        f"is_correction.level is {r.algo.is_correction.level}",
        ("algo.is_correction.level",),
    )
    derive_molt021_rollout(b, r, is_on)


def _executor(b: Builder, ro: Any, per_engine: int) -> str:
    m = ro.mesh
    if ro.engine == "hf":
        return b.add(
            "rollout.executor", "uni", "hf engine: transformers generate inside the engine actor", ("rollout.engine",)
        )
    if ro.executor != "auto":
        return b.add("rollout.executor", ro.executor, "set in the recipe", ("rollout.executor",))
    if per_engine == 1:
        return b.add("rollout.executor", "uni", "auto: tp × pp × dp = 1 (B15)", ("rollout.executor", "rollout.mesh"))
    if m.dp > 1:
        return b.add(
            "rollout.executor",
            "mp",
            f"auto: dp {m.dp} > 1 needs the mp executor (B15)",
            ("rollout.executor", "rollout.mesh.dp"),
        )
    return b.add(
        "rollout.executor",
        "ray",
        f"auto: {per_engine} GPUs per engine with dp 1 (B15)",
        ("rollout.executor", "rollout.mesh"),
    )


def derive_gpu_totals(b: Builder, r: RlRecipe) -> None:
    fsdp, own, vllm = b.v("fsdp.total_gpus"), b.v("rollout.own_gpus"), b.v("rollout.total_gpus")
    total = b.v("cluster.total_gpus")
    b.add("cluster.used_gpus", fsdp + own, f"FSDP {fsdp} + rollout {own} (J1)", ("fsdp.total_gpus", "rollout.own_gpus"))
    b.add(
        "cluster.idle_gpus",
        total - fsdp - own,
        f"cluster {total} - used {fsdp + own}",
        ("cluster.total_gpus", "cluster.used_gpus"),
    )
    b.add("weight_sync.world_size", vllm + 1, f"trainer rank 0 + {vllm} engine workers (§3.2)", ("rollout.total_gpus",))
    per_engine = b.v("rollout.gpus_per_engine")
    b.add(
        "weight_sync.engine_rank_offsets",
        [1 + i * per_engine for i in range(r.rollout.engines)],
        f"rank 0 is the trainer; engine i's {per_engine} workers follow at 1 + i × {per_engine}",
        ("rollout.engines", "rollout.gpus_per_engine"),
    )
    on_cpu = r.cluster.gpu == "cpu"
    if on_cpu:
        method, why = "gloo_broadcast", "CPU: gloo broadcast from trainer rank 0"
    elif b.v("rollout.colocated"):
        method, why = "cuda_ipc", "GPU, engines on the trainer's GPU: CUDA IPC buckets (NCCL refuses a shared device)"
    else:
        method, why = "nccl_broadcast", "GPU: NCCL broadcast from trainer rank 0"
    b.add("weight_sync.method", method, why, ("cluster.gpu", "rollout.placement"))
    # Buckets large enough that per-bucket latency is noise next to bandwidth, small enough that the two a sender or
    # receiver holds are far below a GPU's memory headroom (checked by the weight-sync rule).
    b.add(
        "weight_sync.bucket_bytes",
        (64 if on_cpu else 512) << 20,
        "CPU: 64 MiB buckets" if on_cpu else "GPU: 512 MiB buckets",
        ("cluster.gpu",),
    )
