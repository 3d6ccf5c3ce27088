"""SFT lowering: one torchrun per node (no engines, no agents), and the SFT runtime slice (`Plan.sft`)."""

from __future__ import annotations

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.lower.common import (
    batching_fields,
    ckpt_plan,
    cluster_plan,
    count_at_start,
    derived_entries,
    diag,
    instance,
    logging_plan,
    lora_plan,
    model_plan,
    optimizer_plan,
    ray_options,
    required,
    role_plan,
    runtime_env,
    source_path,
)
from molt_compile.paths import resolve_path, resolve_sources
from molt_compile.source import SourceMap
from schemas.plan import (
    PLAN_FILE_PLACEHOLDER,
    Plan,
    RolePlan,
    SftCountInputs,
    SftDataPlan,
    SftRuntime,
    SftSchedulePlan,
    SftTrainerPlan,
)
from schemas.recipe import SftRecipe

SFT_MODULE = "runtime.sft"


def lower_sft(r: SftRecipe, d: Derived, source: SourceMap | None) -> tuple[Plan | None, list[Diagnostic]]:
    diags = required(d, ["actor.dp", "actor.grad_accum"], source)
    a, c = r.actor, r.cluster
    if a.nodes > c.nodes or a.gpus_per_node > c.gpus_per_node:
        diags.append(
            diag(
                "PLACE105",
                f"SFT needs {a.nodes} node(s) x {a.gpus_per_node} GPUs but the cluster has "
                f"{c.nodes} x {c.gpus_per_node}",
                "lower actor.nodes / actor.gpus_per_node or grow the cluster",
                "actor.nodes",
                source,
            )
        )
    if diags:
        return None, diags
    nnodes, nproc = a.nodes, a.gpus_per_node
    gpu_map: list[list[list[str]]] = [[[] for _ in range(c.gpus_per_node)] for _ in range(c.nodes)]
    for n in range(nnodes):
        for g in range(nproc):
            gpu_map[n][g].append(f"sft.rank[{n * nproc + g}]")
    command = _torchrun_command(nnodes, nproc, d.value("sft.master_port"))
    sft = _sft_runtime(r, d, source, command)
    env = dict(r.env)
    plan = Plan.model_construct(
        name=r.name,
        kind="sft",
        source=source_path(source),
        recipe=r.model_dump(mode="json", by_alias=True),
        cluster=cluster_plan(r, d, 1.0),
        derived=derived_entries(d),
        placement_groups=[],
        roles=[_torchrun_role(nnodes, nproc, d.value("cluster.device") == "cpu")],
        gpu_map=gpu_map,
        env=env,
        runtime_env=runtime_env(r, env, sft.ckpt, sft.logging),
        entrypoint=command,
        sft=sft,
    )
    return plan.with_fingerprint(), []


def _torchrun_command(nnodes: int, nproc: int, port: int) -> list[str]:
    """The per-node command; the launcher fills {node_rank} and {master_addr}."""
    return [
        "torchrun",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--node-rank",
        "{node_rank}",
        "--master-addr",
        "{master_addr}",
        "--master-port",
        str(port),
        "-m",
        SFT_MODULE,
        PLAN_FILE_PLACEHOLDER,
    ]


def _torchrun_role(nnodes: int, nproc: int, on_cpu: bool) -> RolePlan:
    instances = [
        instance(index=n, label=f"torchrun[{n}]", node=n, bundle_indices=[], devices=[[n, g] for g in range(nproc)])
        for n in range(nnodes)
    ]
    return role_plan(
        name="torchrun",
        actor_class="Torchrun",
        count=nnodes,
        num_gpus=nproc,
        num_cpus=0,
        placement_group=None,
        scheduling="DEFAULT",
        ray_options=ray_options(nproc, 0, on_cpu),
        instances=instances,
    )


def _sft_runtime(r: SftRecipe, d: Derived, source: SourceMap | None, command: list[str]) -> SftRuntime:
    a, e = r.actor, r.eval
    return SftRuntime.model_construct(
        device=d.value("cluster.device"),
        dist_backend=d.value("dist.backend"),
        nnodes=a.nodes,
        nproc_per_node=a.gpus_per_node,
        master_port=d.value("sft.master_port"),
        command=command,
        model=model_plan(r, d, source),
        trainer=_trainer(r, d),
        data=_data(r, d, source),
        eval_dataset=resolve_sources(e.dataset, "eval.dataset", source)[0] if e.dataset else None,
        eval_split=e.split,
        schedule=SftSchedulePlan.model_construct(
            steps_per_epoch=d.value("train.steps_per_epoch"),
            total_steps=d.value("train.total_steps"),
            log_every=r.logging.every,
            ckpt_every=d.value("ckpt.every"),
            eval_every=d.value("eval.every"),
        ),
        ckpt=ckpt_plan(r, d, source),
        logging=logging_plan(r, source),
    )


def _trainer(r: SftRecipe, d: Derived) -> SftTrainerPlan:
    a, t = r.actor, r.train
    return SftTrainerPlan.model_construct(
        **batching_fields(r, d),
        packing=d.value("actor.packing"),
        sequence_parallel=a.sequence_parallel,
        offload=a.offload,
        optimizer=optimizer_plan(a.optimizer, d.value("actor.warmup_steps"), d.value("actor.scheduler_steps")),
        aux_loss_coef=a.aux_loss_coef,
        freeze_moe_router=a.freeze.moe_router,
        freeze_visual_encoder=a.freeze.visual_encoder,
        seed=t.seed,
        full_determinism=t.full_determinism,
        lora=lora_plan(a.lora),
    )


def _data(r: SftRecipe, d: Derived, source: SourceMap | None) -> SftDataPlan:
    dt = r.data
    return SftDataPlan.model_construct(
        dataset=resolve_sources(dt.dataset, "data.dataset", source),
        probs=dt.dataset_probs,
        split=dt.split,
        input_key=dt.input_key,
        output_key=dt.output_key,
        chat_template=_chat_template(dt.chat_template, source),
        train_on_last_turn_only=dt.train_on_last_turn_only,
        image_key=dt.image_key,
        max_images_per_prompt=dt.max_images_per_prompt,
        max_len=dt.max_len,
        max_samples=dt.max_samples,
        dataloader_num_workers=dt.dataloader_num_workers,
        sample_count=d.value("data.sample_count"),
        count_at_start=count_at_start(SftCountInputs, d),
    )


def _chat_template(value: str | None, source: SourceMap | None) -> str | None:
    """A .jinja path is resolved like other paths; a literal template is kept."""
    if value and value.endswith(".jinja") and "\n" not in value:
        return resolve_path(value, "data.chat_template", source)
    return value
