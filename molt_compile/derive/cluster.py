"""Cluster section: device kind, GPU totals, CPUs per node, and the training backend that runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from molt_compile.derive.values import Builder, Derived
from molt_compile.model_facts import hf_fallback, model_facts
from schemas.catalog import GPUS

if TYPE_CHECKING:
    from molt_compile.source import SourceMap
    from schemas.recipe import RlRecipe, SftRecipe


def derive_backend(b: Builder, r: RlRecipe | SftRecipe, source: SourceMap | None) -> None:
    facts = model_facts(r, source)
    if r.model.backend == "hf":
        b.add("model.backend", "hf", "model.backend: hf", ("model.backend",))
    elif hf_fallback(r, facts):
        b.add(
            "model.backend",
            "hf",
            f"{facts.key} has no AutoModel custom implementation: HF transformers (H9)",
            ("model.backend", "model.arch", "model.path"),
        )
    elif facts is not None and not facts.native_automodel:
        b.add(
            "model.backend",
            "automodel",
            f"actor.mesh.tp {r.actor.mesh.tp}: {facts.key}'s nemo-automodel implementation and tensor-parallel plan",
            ("model.backend", "model.arch", "actor.mesh.tp"),
        )
    else:
        b.add("model.backend", "automodel", "model.backend: automodel", ("model.backend", "model.arch"))


CUSTOM_NATIVE_ATTN = ("te", "sdpa", "flex", "tilelang")
"""Attentions an AutoModel custom model runs as asked without packing (Molt B20); any other runs as sdpa."""


def model_attn(r: RlRecipe | SftRecipe, d: Derived) -> str:
    """The attention that runs (the plan's `model.attn`): the derived one (B20) where it differs, else the recipe's."""
    return d.value("model.attn") if "model.attn" in d else r.model.attn


def derive_attention(b: Builder, r: RlRecipe | SftRecipe, source: SourceMap | None) -> None:
    """`model.attn` when the attention that runs is not the recipe's: on an AutoModel custom model without packing,
    one outside CUSTOM_NATIVE_ATTN (the schema default flash_attention_2 among them) runs as sdpa (B20: Molt prints a
    notice and switches). Absent otherwise: the recipe's value runs (the plan takes `model_attn`)."""
    attn = r.model.attn
    packing = b.items["actor.packing"].value if "actor.packing" in b.items else r.actor.packing
    facts = model_facts(r, source)
    if b.v("model.backend") == "automodel" and facts is not None and not packing and attn not in CUSTOM_NATIVE_ATTN:
        b.add(
            "model.attn",
            "sdpa",
            f"{facts.key} is an AutoModel custom model without packing: {attn} runs as sdpa (B20)",
            ("model.attn", "model.backend", "actor.packing"),
        )


def derive_compile_layers(b: Builder, r: RlRecipe | SftRecipe, source: SourceMap | None) -> None:
    """`model.compile_layers`: the recipe's when set; else on where compiled layers were measured and run (a dense
    text model on the hf backend on GPUs, without LoRA adapters: tests/gpu/bench_trainer.py, 1.4x to 1.6x the
    eager step on an H200 with checkpointing), off elsewhere: on CPUs the compile costs more than it saves in the
    short runs CPUs do, and the automodel backend's and MoE / VLM / LoRA models' compiled layers are not measured
    on GPUs."""
    inputs = ("model.compile_layers", "cluster.gpu", "model.backend", "model.arch", "actor.lora.dim")
    if r.model.compile_layers is not None:
        b.add("model.compile_layers", r.model.compile_layers, "set in the recipe", ("model.compile_layers",))
        return
    facts = model_facts(r, source)
    off = (
        "CPU cluster: the compile costs more than it saves"
        if b.v("cluster.device") == "cpu"
        else "the automodel backend's compiled layers are not measured on GPUs"
        if b.v("model.backend") != "hf"
        else "the architecture is not known to the compiler"
        if facts is None
        else "compiled MoE / VLM layers are not measured on GPUs"
        if facts.is_moe or facts.is_vlm
        else "compiled LoRA layers are not measured on GPUs"
        if r.actor.lora.dim > 0
        else None
    )
    if off is not None:
        b.add("model.compile_layers", False, f"not set: off ({off})", inputs)
    else:
        b.add("model.compile_layers", True, "not set: on (a dense text model on the hf backend on GPUs)", inputs)


def derive_cluster(b: Builder, r: RlRecipe | SftRecipe) -> None:
    c = r.cluster
    on_cpu = c.gpu == "cpu"
    b.add(
        "cluster.device",
        "cpu" if on_cpu else "cuda",
        "cluster.gpu is cpu: every role runs on CPU device slots" if on_cpu else f"cluster.gpu is {c.gpu}",
        ("cluster.gpu",),
    )
    b.add(
        "cluster.device_resource",
        "device_slot" if on_cpu else "GPU",
        "CPU cluster: a device is the custom Ray resource device_slot" if on_cpu else "roles request Ray GPUs",
        ("cluster.gpu",),
    )
    b.add(
        "cluster.total_gpus",
        c.nodes * c.gpus_per_node,
        f"nodes {c.nodes} × gpus_per_node {c.gpus_per_node}",
        ("cluster.nodes", "cluster.gpus_per_node"),
    )
    _cpus_per_node(b, c)
    _width_multiple(b, on_cpu)
    offload = r.actor.offload
    if on_cpu:
        b.add("dist.backend", "gloo", "CPU cluster: torch.distributed over gloo", ("cluster.gpu",))
    elif offload == "full":
        b.add(
            "dist.backend", "cuda:nccl,cpu:gloo", "actor.offload full keeps parameters on CPU (B26)", ("actor.offload",)
        )
    else:
        b.add("dist.backend", "nccl", "GPU cluster without full offload (B26)", ("cluster.gpu", "actor.offload"))


def _width_multiple(b: Builder, on_cpu: bool) -> None:
    """`fsdp.width_multiple`: batches and micro-batches are right-padded to a multiple of this many positions. On
    GPUs 8: the SDPA kernels want the attention mask's rows 8-aligned (else each call copies it), and compiled
    layers specialize on that alignment: an unaligned width recompiled them (about 11 s each on an H200 for a
    Qwen3-1.7B shape, tests/gpu/bench_loop.py, issue 29). On CPUs 1: nothing to align."""
    b.add(
        "fsdp.width_multiple",
        1 if on_cpu else 8,
        "CPU cluster: no alignment" if on_cpu else "GPU cluster: the SDPA mask alignment, one compiled graph",
        ("cluster.gpu",),
    )


def _cpus_per_node(b: Builder, c: Any) -> None:
    if c.cpus_per_node is not None:
        b.add("cluster.cpus_per_node", c.cpus_per_node, "set in the recipe", ("cluster.cpus_per_node",))
        return
    profile = gpu_catalog_cpus(c.gpu)
    if profile is not None:
        b.add("cluster.cpus_per_node", profile, f"node profile of GPU {c.gpu} in the GPU catalog", ("cluster.gpu",))
    else:
        b.add(
            "cluster.cpus_per_node",
            None,
            "not set and not in the GPU catalog: sized from the plan's needs",
            ("cluster.cpus_per_node", "cluster.gpu"),
        )


def gpu_catalog_cpus(gpu: str) -> int | None:
    """CPUs per node from the GPU catalog's node profile, when the catalog has one."""
    entry = GPUS.get(gpu)
    return entry.cpus_per_node if entry is not None else None
