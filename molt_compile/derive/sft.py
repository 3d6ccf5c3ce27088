"""SFT recipes: torchrun layout, the model's FSDP role, dataset counts and the schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING

from molt_compile.derive.roles import BatchSplit, actor_world, fsdp_role
from molt_compile.derive.schedule import DEFERRED, derive_ckpt, job_root
from molt_compile.derive.values import Builder
from molt_compile.paths import resolve_sources
from schemas.plan import SftCountInputs
from schemas.schedule import count_rows, probs_problem, sft_schedule

if TYPE_CHECKING:
    from molt_compile.source import SourceMap
    from schemas.recipe import SftRecipe

SFT_MASTER_PORT = 29500
"""torchrun rendezvous port of the Molt SFT scripts (§5.1)."""


def derive_sft(b: Builder, r: SftRecipe, source: SourceMap | None) -> None:
    a, t, d = r.actor, r.train, r.data
    split = BatchSplit(a.mesh, t.batch_size, t.micro_batch_size, dynamic=False)
    fsdp_role(b, "actor", actor_world(a), split)
    b.add("actor.packing", a.packing, "actor.packing", ("actor.packing",))
    b.add("sft.nnodes", a.nodes, "one torchrun per node", ("actor.nodes",))
    b.add("sft.nproc_per_node", a.gpus_per_node, "one process per GPU", ("actor.gpus_per_node",))
    port = r.launch.slurm.master_port
    b.add(
        "sft.master_port",
        port,
        f"launch.slurm.master_port {port}: torchrun rendezvous port on the head node "
        f"(Molt's SFT scripts use {SFT_MASTER_PORT}, sft_omni3 29511; §5.1)",
        ("launch.slurm.master_port",),
    )
    total = b.v("cluster.total_gpus")
    world = b.v("actor.world")
    b.add("cluster.used_gpus", world, f"the SFT world {world}", ("actor.world",))
    b.add(
        "cluster.idle_gpus",
        total - world,
        f"cluster {total} - used {world}",
        ("cluster.total_gpus", "cluster.used_gpus"),
    )
    sources = resolve_sources(d.dataset, "data.dataset", source)
    count, why = count_rows(
        sources,
        d.max_samples,
        d.dataset_probs,
        d.split,
        job_root(source),
        seed=t.seed if d.dataset_probs else None,  # the interleave's seed (runtime/sft_data.py)
    )
    keys = ("data.dataset", "data.max_samples", "data.dataset_probs") + (("train.seed",) if d.dataset_probs else ())
    b.add("data.sample_count", count, why, keys)
    e = r.eval
    enabled = e.dataset is not None
    inputs = SftCountInputs(
        batch_size=t.batch_size,
        max_epochs=t.max_epochs,
        warmup_ratio=a.optimizer.warmup_ratio,
        eval_every_epoch=enabled and e.every == -1,
    )
    if count is not None:
        values = {name: (value, why, keys) for name, value, why, keys in sft_schedule(count, inputs)}
    else:
        names = ("train.steps_per_epoch", "train.total_steps", "actor.scheduler_steps", "actor.warmup_steps")
        values = {name: (None, DEFERRED, ("data.sample_count",)) for name in names}
        if inputs.eval_every_epoch:
            values["eval.every"] = (None, DEFERRED, ("eval.every", "train.steps_per_epoch"))
        if not d.dataset_probs or probs_problem(len(sources), d.dataset_probs) is None:  # else DATA001/DATA012
            b.add(
                "data.count_at_start",
                inputs.model_dump(),
                "the job counts the rows at start and derives the values marked DATA010 with schemas/schedule.py",
                ("data.dataset",),
            )
    for name in ("train.steps_per_epoch", "train.total_steps", "actor.scheduler_steps", "actor.warmup_steps"):
        b.add(name, *values[name])
    b.add(
        "actor.lora",
        a.lora.dim > 0,
        f"actor.lora.dim {a.lora.dim}" + ("" if a.lora.dim > 0 else ": full fine-tuning"),
        ("actor.lora.dim",),
    )
    b.add("eval.enabled", enabled, "eval.dataset set" if enabled else "no eval.dataset", ("eval.dataset",))
    if not enabled:
        b.add("eval.every", None, "no eval", ("eval.dataset",))
    elif e.every == -1:
        b.add("eval.every", *values["eval.every"])
    else:
        b.add("eval.every", e.every, f"every {e.every} steps", ("eval.every",))
    derive_ckpt(b, r)
