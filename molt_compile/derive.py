"""Derive: every number the rules, the lowering and the runtime need, computed once, each with a reason.

`derive(recipe, source)` returns a `Derived`: an ordered map from a stable dotted name to a `DerivedValue`
(`name`, `value`, `reason`, `inputs`, `forced`). `inputs` are dotted recipe keys (YAML names) or other derived
names; `explain` resolves them to `file:line` through the SourceMap. A value that cannot be computed (a
non-integral division, a dataset that cannot be counted) is `None` and its reason says why; the rules turn
that into a diagnostic, derive itself never reports errors. Pure: no I/O except counting rows of a local
dataset (schemas/datafiles.py). Never imports torch, ray, vllm or transformers.

Access: `derived["actor.dp"].value`, `derived.value("actor.dp")`, `for dv in derived.values(): ...`.

Names (RL recipes; `*` marks names that also exist for `kind: sft`). Section refs are `reference/molt_rules.md`.

| name | value | rule |
|---|---|---|
| `kind` * | "rl" or "sft" | |
| `cluster.device` * | "cuda", or "cpu" when `cluster.gpu: cpu` (GPU counts become CPU device slots) | |
| `cluster.device_resource` * | Ray resource a device slot is: "GPU", or the custom "device_slot" on a CPU cluster | |
| `cluster.total_gpus` * | nodes × gpus_per_node (device slots on a CPU cluster) | |
| `cluster.cpus_per_node` * | CPUs Ray may use per node: recipe, GPU catalog node profile, else None (lower sizes it) | J5 |
| `model.backend` | the training backend that runs: hf when set, or when the architecture has no AutoModel custom class | H9 |
| `model.attn` * | only where it is not the recipe's: sdpa for model.attn outside te/sdpa/flex/tilelang on an AutoModel custom model without packing (`model_attn` reads either) | B20 |
| `dist.backend` * | torch.distributed backend: gloo (cpu), nccl, or "cuda:nccl,cpu:gloo" with offload full | B26 |
| `actor.world` * | actor.nodes × actor.gpus_per_node | §3.2 |
| `actor.model_parallel` * | tp × cp (EP excluded) = ranks that receive the same samples | G2 |
| `actor.dp` * | world / (tp × cp), None when not integral | G2, G3 |
| `actor.grad_accum` * | batch / (micro × dp); 1 under dynamic batching; None when not integral | G4, B25 |
| `actor.packing` * | effective packing (RL VLM forces it off) | B5 |
| `actor.num_gpus` | GPU fraction each policy worker requests: 0.2 when colocated, else 1 | B33 |
| `actor.temperature` | logits temperature of actor/ref/critic = rollout.temperature | B17 |
| `actor.shuffle_microbatches` | microbatch shuffling (only tp×cp ≤ 1 and no dynamic batching) | G11 |
| `actor.dynamic_batch_max_tokens` | token cap per microbatch = max_tokens_per_gpu × cp × tp, None when off | G9 |
| `actor.local_batch_size` | samples per rank per step under dynamic batching = batch // dp, None when off | G9 |
| `actor.old_logprob_pass` | π_old from a no-grad forward before the step; off with KL coef 0 and no reference under force_on_policy or one optimizer step per rollout batch (one epoch, samples = train.batch_size) | B28 |
| `actor.scheduler_steps` * | LR-scheduler length (optimizer steps), None when the dataset size is unknown | B10, B11 |
| `actor.warmup_steps` * | ceil(scheduler_steps × warmup_ratio) | §1.1 |
| `ref.exists` | a reference model / teacher is built (`ref:` present) | B8 |
| `ref.path` | ref.path or model.path | B9 |
| `ref.colocated` | ref shares the actor's GPUs | B8, J2 |
| `ref.world`, `ref.model_parallel`, `ref.dp`, `ref.grad_accum`, `ref.num_gpus` | as for the actor (only when ref exists) | G4, J2 |
| `critic.exists` | a value model is built (estimator gae) | B8 |
| `critic.path`, `critic.colocated`, `critic.world`, `critic.model_parallel`, `critic.dp`, `critic.grad_accum`, `critic.num_gpus` | as above (only when critic exists); world = actor's | J3 |
| `critic.max_epochs` | critic.max_epochs or train.max_epochs | B9 |
| `critic.freeze_moe_router` | critic.freeze_moe_router or actor.freeze.moe_router | B9 |
| `critic.scheduler_steps`, `critic.warmup_steps` | critic LR schedule | B10 |
| `fsdp.colocate` | any FSDP role is colocated with the actor (one shared PACK group) | B8 |
| `fsdp.total_gpus` | GPUs of the FSDP groups (0 when eval.only) | §3.2, J4 |
| `rollout.executor` | vLLM executor: set, or uni / mp / ray derived | B15 |
| `rollout.gpus_per_engine` | tp × pp × dp | §3.2 |
| `rollout.engine_num_gpus` | GPUs the engine actor itself requests (mp: tp×dp, uni: 1, ray: 0 when its workers take them) | §3.1 |
| `rollout.bundle_gpus` | GPUs per bundle of the engines' PACK group (mp: tp×dp, else 1) | §3.1 |
| `rollout.bundles` | bundles in the engines' group | §3.1 |
| `rollout.total_gpus` | engines × gpus_per_engine | §3.2 |
| `rollout.colocated` | engines share the actor's GPUs (`rollout.placement: colocate`) | — |
| `rollout.own_gpus` | GPUs only the engines use: rollout.total_gpus, 0 when colocated | — |
| `rollout.expert_parallel_size` | vLLM EP per engine = tp × dp when expert_parallel, else 1 | I8 |
| `rollout.max_model_len` | data.max_len | B16 |
| `rollout.generate_batch_size` | generate_batch_size or batch_size | B4 |
| `rollout.runners` | max(1, runners) | B27 |
| `rollout.samples_per_step` | batch_size × n_samples_per_prompt | G5 |
| `rollout.logprobs` | the rollout asks the engine for logprobs: IS on, score centering, or KL to the rollout | B14, X6 |
| `rollout.logprobs_mode` | processed_logprobs when logprobs are requested, else raw_logprobs | B14, X6 |
| `rollout.top_logprobs` | k of score centering (top-k log-probs per generated token), else 0 | 0.2.1 §3.4 |
| `rollout.prefix_caching` | as set; forced on by routing_replay | 0.2.1 X5 |
| `train.partial_rollout` | as set, or on when generate_batch_size > rollout.batch_size (Molt X4; the off-policy rules read it, the plan keeps the recipe's engine-lock setting) | 0.2.1 X4 |
| `algo.is_correction.band` | [low, high]; one value HIGH → [None (-inf), HIGH] | 0.2.1 X1 |
| `algo.kl.ref` | model or rollout: as set, else rollout; on_policy_distill forces model | 0.2.1 X2, X3 |
| `algo.kl.to_rollout` | KL coef > 0 against the rollout policy (no reference model needed) | 0.2.1 X7 |
| `algo.score_centering` | score_centering_top_k ≥ 2 | 0.2.1 F5 |
| `actor.lora` | LoRA adapters on the trained model (actor.lora.dim > 0) | 0.2.1 F1, F14 |
| `cluster.used_gpus` * | fsdp.total_gpus + rollout.own_gpus (SFT: actor.world) | J1 |
| `cluster.idle_gpus` * | total - used (negative: over-subscribed) | J1 |
| `weight_sync.world_size` | rollout.total_gpus + 1 (trainer rank 0 + every engine worker) | §3.2, I8 |
| `weight_sync.method` | nccl_broadcast on GPUs (cuda_ipc with colocated engines), gloo_broadcast on CPU | DESIGN §6 |
| `weight_sync.engine_rank_offsets` | 1 + i × rollout.gpus_per_engine (engine i's first worker) | §3.2 |
| `weight_sync.bucket_bytes` | 512 MiB on GPUs, 64 MiB on CPU | DESIGN §6 |
| `algo.kl.coef`, `algo.kl.estimator`, `algo.kl.use_loss` | effective KL settings (on_policy_distill forces k1, no loss, coef 1.0) | B2 |
| `algo.kl.adaptive` | adaptive KL controller (target set) | C9 |
| `algo.is_correction.enabled` | IS correction level != off | B14, B31 |
| `agent.path` | agent file, or the built-in distill agent for on_policy_distill | B2 |
| `agent.max_turns` | MAX_AGENT_TURNS exported to runners | §1.4 |
| `data.prompt_count` | prompts after the max_samples caps (local json/jsonl/parquet/arrow files, save_to_disk dirs), else None | B11 |
| `train.steps_per_episode` | prompt_count // rollout.batch_size (trainer steps per pass) | B11 |
| `train.total_steps` * | RL: steps_per_episode × episodes; SFT: steps_per_epoch × max_epochs | B11, M6 |
| `train.optimizer_steps` | B11 max_steps (scheduler steps) | B11 |
| `train.optimizer_steps_per_step` | optimizer steps per trainer step | G8, G10 |
| `eval.enabled` * | an eval dataset is set (RL: and eval.every or at_start or only) | |
| `eval.every` * | eval cadence in steps, None for never (RL -1); SFT -1 → steps_per_epoch | B12, M1 |
| `eval.batch_size`, `eval.n_samples_per_prompt`, `eval.temperature`, `eval.top_p`, `eval.max_new_tokens` | eval sampling with rollout fallbacks | B13 |
| `ckpt.every` * | save cadence in steps, None for never (-1) | B12 |
| `ckpt.dcp_keep` * | ckpt.dcp_keep or ckpt.keep | B7 |
| `sft.nnodes`, `sft.nproc_per_node`, `sft.master_port` | torchrun layout (SFT only) | §5.1 |
| `data.sample_count`, `train.steps_per_epoch` | SFT rows (counted as above) and optimizer steps per epoch | M6 |
| `data.count_at_start` | when the rows cannot be counted here (DATA010): the inputs the job derives the values above from at start (`schemas/schedule.py`) | issue 30 |
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from schemas.catalog import GPUS
from schemas.plan import RlCountInputs, SftCountInputs
from schemas.schedule import count_rows, probs_problem, rl_schedule, sft_schedule

COLOCATED_GPU_FRACTION = 0.2
"""What each colocated FSDP worker requests (Molt B33): actor + ref + critic = 0.6 of one GPU bundle."""
SFT_MASTER_PORT = 29500
"""torchrun rendezvous port of the Molt SFT scripts (§5.1)."""
DISTILL_AGENT_PATH = "builtin:distill"
"""Agent used by on_policy_distill when the recipe names none: single-turn, reward 0 (Molt B2)."""
_MISSING = object()


@dataclass(frozen=True)
class DerivedValue:
    """One derived number: its value, a one-line reason, and the keys it was computed from."""

    name: str
    value: Any
    reason: str
    inputs: tuple[str, ...] = ()
    forced: bool = False
    """True when the value overrides what the recipe wrote (Molt forces it); rules report these as info."""

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "reason": self.reason, "inputs": list(self.inputs)}


class Derived:
    """Ordered, read-only map of derived names to `DerivedValue`s."""

    def __init__(self, items: dict[str, DerivedValue]):
        self._items = dict(items)

    def __getitem__(self, name: str) -> DerivedValue:
        try:
            return self._items[name]
        except KeyError:
            import difflib  # only for the error message

            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(f"no derived value {name!r}{hint}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, name: str) -> DerivedValue | None:
        return self._items.get(name)

    def value(self, name: str, default: Any = _MISSING) -> Any:
        """The value of `name`; KeyError for an unknown name unless a default is given."""
        if name in self._items:
            return self._items[name].value
        if default is _MISSING:
            return self[name].value  # raises with a did-you-mean
        return default

    def values(self) -> Iterator[DerivedValue]:
        return iter(self._items.values())

    def names(self) -> list[str]:
        return list(self._items)

    def to_list(self) -> list[dict]:
        return [dv.to_json() for dv in self._items.values()]


class _Builder:
    """Collects derived values in order; `add` returns the value so derivations read as assignments."""

    def __init__(self) -> None:
        self.items: dict[str, DerivedValue] = {}

    def add(self, name: str, value: Any, reason: str, inputs: tuple[str, ...] = (), forced: bool = False) -> Any:
        self.items[name] = DerivedValue(name, value, reason, tuple(inputs), forced)
        return value

    def v(self, name: str) -> Any:
        return self.items[name].value


# ---------------------------------------------------------------------------------------------- entry point
def derive(recipe: Any, source: Any = None) -> Derived:
    """Every derived value of `recipe` (RlRecipe or SftRecipe). `source` locates the recipe file for data counts."""
    b = _Builder()
    b.add("kind", recipe.kind, f"kind: {recipe.kind}", ("kind",))
    _cluster(b, recipe)
    _backend(b, recipe, source)
    if recipe.kind == "sft":
        _sft(b, recipe, source)
    else:
        _rl(b, recipe, source)
    _attention(b, recipe, source)
    return Derived(b.items)


CUSTOM_NATIVE_ATTN = ("te", "sdpa", "flex", "tilelang")
"""Attentions an AutoModel custom model runs as asked without packing (Molt B20); any other runs as sdpa."""


def model_attn(r: Any, d: Derived) -> str:
    """The attention that runs (the plan's `model.attn`): the derived one (B20) where it differs, else the recipe's."""
    return d.value("model.attn") if "model.attn" in d else r.model.attn


def _attention(b: _Builder, r: Any, source: Any) -> None:
    """`model.attn` when the attention that runs is not the recipe's: on an AutoModel custom model without packing,
    one outside CUSTOM_NATIVE_ATTN (the schema default flash_attention_2 among them) runs as sdpa (B20: Molt prints a
    notice and switches). Absent otherwise: the recipe's value runs (the plan takes `model_attn`)."""
    from molt_compile.rules._base import model_facts

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


def _backend(b: _Builder, r: Any, source: Any) -> None:
    from molt_compile.rules._base import hf_fallback, model_facts

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
    else:
        b.add("model.backend", "automodel", "model.backend: automodel", ("model.backend", "model.arch"))


def resolve_path(value: str, key: str, source: Any = None) -> str:
    """A path from the recipe as the plan writes it: relative to the job root (the recipe's project root, where the
    job runs: `SourceMap.job_root`) when inside it, else absolute. The same from any working directory.

    A value written in a file is relative to that file (a base in `recipes/base/` resolves against itself); a
    value from `--set` or a schema default is relative to the job root (the recipe's directory when the recipe is
    in no project). Absolute paths stay absolute. Without a source map (unit tests of bare recipes) the working
    directory stands in for the job root. Never touches the file system.
    """
    if os.path.isabs(value):
        return os.path.normpath(value)
    if source is None:
        return plan_path(os.path.join(os.getcwd(), value), os.getcwd())
    pos = source.pos(key)
    root = source.job_root
    if pos.layer == "file" and pos.file:
        base = os.path.dirname(os.path.abspath(pos.file))
    else:
        base = root or os.path.dirname(os.path.abspath(source.root_file or "."))
    return plan_path(os.path.join(base, value), root)


def plan_path(absolute: str, root: str | None) -> str:
    """An absolute path as the plan writes it: relative to `root` when inside it (posix), else absolute."""
    absolute = os.path.normpath(absolute)
    if root:
        rel = os.path.relpath(absolute, root)
        if rel != ".." and not rel.startswith(".." + os.sep):
            return rel.replace(os.sep, "/")
    return absolute


def local_path(plan_value: str, source: Any = None) -> str:
    """Where the compiler finds a plan path on this machine (to count rows, or to tell a local checkpoint from a
    hub name): joined to the job root, which need not be the working directory."""
    root = source.job_root if source is not None else None
    return os.path.join(root, plan_value) if root and not os.path.isabs(plan_value) else plan_value


def resolve_sources(spec: str, key: str, source: Any = None) -> list[str]:
    """A comma-separated dataset spec as a list of project-root-relative sources (`path@data_dir` kept)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        path, at, rest = item.partition("@")
        out.append(resolve_path(path, key, source) + (at + rest if at else ""))
    return out


# ---------------------------------------------------------------------------------------------- cluster
def _cluster(b: _Builder, r: Any) -> None:
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
    offload = r.actor.offload
    if on_cpu:
        b.add("dist.backend", "gloo", "CPU cluster: torch.distributed over gloo", ("cluster.gpu",))
    elif offload == "full":
        b.add(
            "dist.backend", "cuda:nccl,cpu:gloo", "actor.offload full keeps parameters on CPU (B26)", ("actor.offload",)
        )
    else:
        b.add("dist.backend", "nccl", "GPU cluster without full offload (B26)", ("cluster.gpu", "actor.offload"))


def _cpus_per_node(b: _Builder, c: Any) -> None:
    if c.cpus_per_node is not None:
        b.add("cluster.cpus_per_node", c.cpus_per_node, "set in the recipe", ("cluster.cpus_per_node",))
        return
    profile = _gpu_catalog_cpus(c.gpu)
    if profile is not None:
        b.add("cluster.cpus_per_node", profile, f"node profile of GPU {c.gpu} in the GPU catalog", ("cluster.gpu",))
    else:
        b.add(
            "cluster.cpus_per_node",
            None,
            "not set and not in the GPU catalog: sized from the plan's needs",
            ("cluster.cpus_per_node", "cluster.gpu"),
        )


def _gpu_catalog_cpus(gpu: str) -> int | None:
    """CPUs per node from the GPU catalog's node profile, when the catalog has one."""
    entry = GPUS.get(gpu)
    return entry.cpus_per_node if entry is not None else None


# ---------------------------------------------------------------------------------------------- FSDP roles
def _fsdp_role(
    b: _Builder,
    role: str,
    world: int,
    world_reason: str,
    world_inputs: tuple[str, ...],
    mesh: Any,
    batch: int,
    micro: int,
    dynamic: bool,
    mesh_key: str,
    train_key: str,
) -> None:
    """world, model_parallel, dp and grad_accum of one FSDP role (actor, ref, critic or the SFT model)."""
    b.add(f"{role}.world", world, world_reason, world_inputs)
    mp = mesh.tp * mesh.cp
    b.add(
        f"{role}.model_parallel",
        mp,
        f"tp {mesh.tp} × cp {mesh.cp}; EP is not counted (G2)",
        (f"{mesh_key}.tp", f"{mesh_key}.cp"),
    )
    if world % mp:
        b.add(
            f"{role}.dp",
            None,
            f"world {world} is not divisible by tp × cp = {mp} (G3)",
            (f"{role}.world", f"{role}.model_parallel"),
        )
    else:
        b.add(
            f"{role}.dp", world // mp, f"world {world} / (tp × cp = {mp})", (f"{role}.world", f"{role}.model_parallel")
        )
    dp = b.v(f"{role}.dp")
    inputs = (f"{train_key}.batch_size", f"{train_key}.micro_batch_size", f"{role}.dp")
    if dynamic:
        b.add(
            f"{role}.grad_accum",
            1,
            "dynamic batching builds microbatches by tokens: one window (B25)",
            ("train.dynamic_batch",),
        )
    elif dp is None:
        b.add(f"{role}.grad_accum", None, "dp is undefined", inputs)
    elif batch % (micro * dp):
        b.add(
            f"{role}.grad_accum",
            None,
            f"batch_size {batch} is not a multiple of micro_batch_size {micro} × dp {dp} = {micro * dp} (G4)",
            inputs,
        )
    else:
        b.add(
            f"{role}.grad_accum",
            batch // (micro * dp),
            f"batch_size {batch} / (micro_batch_size {micro} × dp {dp})",
            inputs,
        )


def _rl_roles(b: _Builder, r: Any, source: Any = None) -> None:
    a, t = r.actor, r.train
    dynamic = t.dynamic_batch is not None
    _fsdp_role(
        b,
        "actor",
        a.nodes * a.gpus_per_node,
        f"actor.nodes {a.nodes} × actor.gpus_per_node {a.gpus_per_node}",
        ("actor.nodes", "actor.gpus_per_node"),
        a.mesh,
        t.batch_size,
        t.micro_batch_size,
        dynamic,
        "actor.mesh",
        "train",
    )
    # ref: exists exactly when the section is present (Recipe v1 makes Molt's hidden kl.coef > 0 switch explicit)
    if r.ref is None:
        bare = source is not None and source.is_set("ref")  # `ref:` alone is YAML null: no reference model
        b.add(
            "ref.exists",
            False,
            "`ref:` is empty (YAML null): no reference model" if bare else "no `ref:` section",
            ("ref",),
        )
    else:
        why = "teacher of on_policy_distill" if r.algo.estimator == "on_policy_distill" else "KL reference model"
        b.add("ref.exists", True, f"`ref:` section present ({why})", ("ref",))
        b.add(
            "ref.path",
            r.ref.path or r.model.path,
            "ref.path" if r.ref.path else "ref.path unset: the policy checkpoint (B9)",
            ("ref.path", "model.path"),
        )
        colocated = r.ref.placement == "colocate"
        b.add("ref.colocated", colocated, f"ref.placement is {r.ref.placement}", ("ref.placement",))
        nodes = r.ref.nodes or a.nodes
        gpn = r.ref.gpus_per_node or a.gpus_per_node
        _fsdp_role(
            b,
            "ref",
            nodes * gpn,
            f"ref nodes {nodes} × gpus_per_node {gpn} (unset: the actor's)",
            ("ref.nodes", "ref.gpus_per_node", "actor.nodes", "actor.gpus_per_node"),
            a.mesh,
            t.batch_size,
            t.micro_batch_size,
            dynamic,
            "actor.mesh",
            "train",
        )
    # critic: Molt builds one exactly for gae (B8); the section only configures it
    if r.algo.estimator != "gae":
        b.add("critic.exists", False, f"estimator {r.algo.estimator} needs no value model", ("algo.estimator",))
    else:
        critic = r.critic if r.critic is not None else _default_critic()
        b.add("critic.exists", True, "estimator gae needs a value model (B8)", ("algo.estimator",))
        b.add(
            "critic.path",
            critic.path or r.model.path,
            "critic.path" if critic.path else "critic.path unset: the policy checkpoint (B9)",
            ("critic.path", "model.path"),
        )
        b.add(
            "critic.colocated",
            critic.placement == "colocate",
            f"critic.placement is {critic.placement}",
            ("critic.placement",),
        )
        _fsdp_role(
            b,
            "critic",
            b.v("actor.world"),
            "the critic always has the actor's size (J3)",
            ("actor.world",),
            a.mesh,
            t.batch_size,
            t.micro_batch_size,
            dynamic,
            "actor.mesh",
            "train",
        )
        b.add(
            "critic.max_epochs",
            critic.max_epochs or t.max_epochs,
            "critic.max_epochs" if critic.max_epochs else "critic.max_epochs unset: train.max_epochs (B9)",
            ("critic.max_epochs", "train.max_epochs"),
        )
        b.add(
            "critic.freeze_moe_router",
            critic.freeze_moe_router or a.freeze.moe_router,
            "critic.freeze_moe_router or actor.freeze.moe_router (B9)",
            ("critic.freeze_moe_router", "actor.freeze.moe_router"),
        )
    ref_col = b.v("ref.exists") and b.v("ref.colocated")
    critic_col = b.v("critic.exists") and b.v("critic.colocated")
    colocate = bool(ref_col or critic_col)
    if colocate:
        who = " and ".join(n for n, c in (("ref", ref_col), ("critic", critic_col)) if c)
        b.add(
            "fsdp.colocate",
            True,
            f"{who} colocated with the actor: one shared PACK group (B8)",
            ("ref.placement", "critic.placement"),
        )
    else:
        b.add("fsdp.colocate", False, "no ref or critic shares the actor's GPUs", ("ref.placement", "critic.placement"))
    frac = COLOCATED_GPU_FRACTION
    shared = colocate or r.rollout.placement == "colocate"
    b.add(
        "actor.num_gpus",
        frac if shared else 1,
        "colocated: each model (and an engine) takes 0.2 GPU (B33)" if shared else "one whole GPU per rank",
        ("fsdp.colocate", "rollout.placement"),
    )
    for role, col in (("ref", ref_col), ("critic", critic_col)):
        if b.v(f"{role}.exists"):
            b.add(
                f"{role}.num_gpus",
                frac if col else 1,
                "colocated: 0.2 GPU of the actor's bundle (B33)" if col else "its own GPUs, one per rank",
                (f"{role}.colocated",),
            )
    _fsdp_total(b, r, ref_col, critic_col)


def _default_critic() -> Any:
    from schemas.recipe import Critic  # only for gae recipes without a critic section

    return Critic()


def _fsdp_total(b: _Builder, r: Any, ref_col: bool, critic_col: bool) -> None:
    if r.eval.only:
        b.add("fsdp.total_gpus", 0, "eval.only builds no FSDP model (J4)", ("eval.only",))
        return
    parts = [f"actor {b.v('actor.world')}"]
    total = b.v("actor.world")
    for role, col in (("ref", ref_col), ("critic", critic_col)):
        if not b.v(f"{role}.exists"):
            continue
        if col:
            parts.append(f"{role} colocated (+0)")
        else:
            parts.append(f"{role} {b.v(f'{role}.world')}")
            total += b.v(f"{role}.world")
    b.add(
        "fsdp.total_gpus",
        total,
        " + ".join(parts) + " (§3.2)",
        ("actor.world", "ref.world", "critic.world", "fsdp.colocate"),
    )


def _actor_extras(b: _Builder, r: Any) -> None:
    a, t = r.actor, r.train
    vlm = r.data.max_images_per_prompt > 0
    if vlm and a.packing:
        b.add(
            "actor.packing",
            False,
            "VLM run (data.max_images_per_prompt > 0): RL never packs images (B5)",
            ("actor.packing", "data.max_images_per_prompt"),
            forced=True,
        )
    else:
        b.add("actor.packing", a.packing, "actor.packing", ("actor.packing",))
    b.add(
        "actor.temperature",
        r.rollout.temperature,
        "trained models divide logits by rollout.temperature (B17)",
        ("rollout.temperature",),
    )
    mp = a.mesh.tp * a.mesh.cp
    shuffle = mp <= 1 and t.dynamic_batch is None
    b.add(
        "actor.shuffle_microbatches",
        shuffle,
        "only without tp/cp and without dynamic batching (G11)",
        ("actor.mesh.tp", "actor.mesh.cp", "train.dynamic_batch"),
    )
    if t.dynamic_batch is None:
        b.add("actor.dynamic_batch_max_tokens", None, "dynamic batching off", ("train.dynamic_batch",))
        b.add("actor.local_batch_size", None, "dynamic batching off", ("train.dynamic_batch",))
    else:
        cap = t.dynamic_batch.max_tokens_per_gpu * mp
        b.add(
            "actor.dynamic_batch_max_tokens",
            cap,
            f"max_tokens_per_gpu {t.dynamic_batch.max_tokens_per_gpu} × cp × tp {mp} (G9)",
            ("train.dynamic_batch.max_tokens_per_gpu", "actor.mesh.tp", "actor.mesh.cp"),
        )
        dp = b.v("actor.dp")
        b.add(
            "actor.local_batch_size",
            None if dp is None else t.batch_size // dp,
            "dp undefined" if dp is None else f"batch_size {t.batch_size} // dp {dp}; a remainder is dropped (G9)",
            ("train.batch_size", "actor.dp"),
        )


# ---------------------------------------------------------------------------------------------- rollout
def _rollout(b: _Builder, r: Any) -> None:
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
    _molt021_rollout(b, r, is_on)


def kl_ref_of(r: Any) -> str:
    """`algo.kl.ref` resolved (Molt 0.2.1 X2, X3): as set, else `model` under on_policy_distill, else `rollout`."""
    if r.algo.estimator == "on_policy_distill":
        return "model"
    return r.algo.kl.ref or "rollout"


def is_band(isc: Any) -> tuple[float | None, float]:
    """(low, high) of the IS band; a single value HIGH is (None, HIGH), i.e. [-inf, HIGH] (Molt 0.2.1 X1).
    Only valid for one or two values (V5 is rule IS001)."""
    t = isc.threshold
    values = [t] if isinstance(t, int | float) else list(t)
    if len(values) == 1:
        return None, float(values[0])
    return float(values[0]), float(values[-1])


def _molt021_rollout(b: _Builder, r: Any, is_on: bool) -> None:
    """Molt 0.2.1's derivations X1, X2/X3, X4, X5, X6 (train_rl_ray.py:1049-1201, 96-150)."""
    ro, algo = r.rollout, r.algo
    low, high = is_band(algo.is_correction)
    b.add(
        "algo.is_correction.band",
        [low, high],
        "one threshold value HIGH: [-inf, HIGH] (X1)" if low is None else "algo.is_correction.threshold",
        ("algo.is_correction.threshold",),
        forced=low is None,
    )
    ref_kind = kl_ref_of(r)
    if r.algo.estimator == "on_policy_distill":
        why = "on_policy_distill forces kl.ref model: the teacher (X2)"
    elif algo.kl.ref:
        why = "algo.kl.ref"
    else:
        why = "algo.kl.ref unset: the rollout policy (Molt 0.2.1 default, X3)"
    b.add(
        "algo.kl.ref",
        ref_kind,
        why,
        ("algo.kl.ref", "algo.estimator"),
        forced=algo.kl.ref is not None and algo.kl.ref != ref_kind,
    )
    coef = algo.kl.coef if "coef" in algo.kl.model_fields_set or r.algo.estimator != "on_policy_distill" else 1.0
    to_rollout = coef > 0 and ref_kind == "rollout"
    b.add(
        "algo.kl.to_rollout",
        to_rollout,
        "kl.coef > 0 and kl.ref rollout: the KL reference is the engine's sampled-token log-probs (B29)"
        if to_rollout
        else "no KL against the rollout policy",
        ("algo.kl.coef", "algo.kl.ref"),
    )
    k = algo.score_centering_top_k
    b.add(
        "algo.score_centering",
        k >= 2,
        f"score_centering_top_k {k}" + ("" if k >= 2 else ": off"),
        ("algo.score_centering_top_k",),
    )
    b.add(
        "rollout.top_logprobs",
        k if k >= 2 else 0,
        "score centering: the engine returns the top-k log-probs of every generated token (§3.4)"
        if k >= 2
        else "no top-k log-probs",
        ("algo.score_centering_top_k",),
    )
    need = is_on or k >= 2 or to_rollout
    why = " or ".join(
        w
        for w, on in (("IS correction", is_on), ("score centering", k >= 2), ("KL to the rollout policy", to_rollout))
        if on
    )
    b.add(
        "rollout.logprobs",
        need,
        f"{why} reads the engine's log-probs (X6)"
        if need
        else "no IS, score centering or KL to the rollout: no log-probs requested (B14, X6)",
        ("algo.is_correction.level", "algo.score_centering_top_k", "algo.kl.coef"),
    )
    b.add(
        "rollout.logprobs_mode",
        "processed_logprobs" if need else "raw_logprobs",
        f"{why} needs the log-probs of the processed (tempered) distribution (X6)"
        if need
        else "vLLM's raw logprobs (B14)",
        ("algo.is_correction.level", "algo.score_centering_top_k"),
    )
    gen = ro.generate_batch_size or ro.batch_size
    forced_partial = gen > ro.batch_size and not r.train.async_.partial_rollout
    b.add(
        "train.partial_rollout",
        r.train.async_.partial_rollout or forced_partial,
        f"generate_batch_size {gen} > rollout.batch_size {ro.batch_size}: Molt 0.2.1 turns partial rollout on (X4); "
        "the off-policy rules read this, the plan keeps the recipe's engine-lock setting"
        if forced_partial
        else "train.async.partial_rollout",
        ("train.async.partial_rollout", "rollout.generate_batch_size"),
        forced=forced_partial,
    )
    forced_prefix = r.train.routing_replay and not ro.prefix_caching
    b.add(
        "rollout.prefix_caching",
        ro.prefix_caching or forced_prefix,
        "routing_replay forces prefix caching on (vLLM's routed-experts capture needs it, X5)"
        if forced_prefix
        else "rollout.prefix_caching",
        ("rollout.prefix_caching", "train.routing_replay"),
        forced=forced_prefix,
    )
    lora = r.actor.lora
    b.add(
        "actor.lora",
        lora.dim > 0,
        f"actor.lora.dim {lora.dim}" + ("" if lora.dim > 0 else ": full fine-tuning"),
        ("actor.lora.dim",),
    )


def _executor(b: _Builder, ro: Any, per_engine: int) -> str:
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


def _gpu_totals(b: _Builder, r: Any) -> None:
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


# ---------------------------------------------------------------------------------------------- algorithm
def _algo(b: _Builder, r: Any) -> None:
    kl = r.algo.kl
    distill = r.algo.estimator == "on_policy_distill"
    if distill:
        coef_set = "coef" in kl.model_fields_set
        b.add(
            "algo.kl.coef",
            kl.coef if coef_set else 1.0,
            "set in the recipe" if coef_set else "on_policy_distill: coef defaults to 1.0 (B2)",
            ("algo.kl.coef", "algo.estimator"),
        )
        b.add(
            "algo.kl.estimator",
            "k1",
            "on_policy_distill forces k1 (B2)",
            ("algo.kl.estimator", "algo.estimator"),
            forced=kl.estimator != "k1",
        )
        b.add(
            "algo.kl.use_loss",
            False,
            "on_policy_distill folds the KL into the reward (B2)",
            ("algo.kl.use_loss", "algo.estimator"),
            forced=kl.use_loss,
        )
    else:
        b.add("algo.kl.coef", kl.coef, "algo.kl.coef", ("algo.kl.coef",))
        b.add("algo.kl.estimator", kl.estimator, "algo.kl.estimator", ("algo.kl.estimator",))
        b.add("algo.kl.use_loss", kl.use_loss, "algo.kl.use_loss", ("algo.kl.use_loss",))
    b.add(
        "algo.kl.adaptive",
        bool(kl.target),
        "kl.target set: adaptive controller (C9)" if kl.target else "kl.target unset: fixed coefficient",
        ("algo.kl.target",),
    )
    _old_logprob_pass(b, r)
    if r.agent is not None:
        b.add("agent.path", r.agent.path, "agent.path (relative to the recipe file)", ("agent.path",))
        b.add("agent.max_turns", r.agent.max_turns, "exported to runners as MAX_AGENT_TURNS", ("agent.max_turns",))
    elif distill:
        b.add(
            "agent.path",
            DISTILL_AGENT_PATH,
            "on_policy_distill without an agent: the built-in single-turn, reward-0 distill agent (B2)",
            ("agent", "algo.estimator"),
        )
        b.add("agent.max_turns", 1, "built-in distill agent is single-turn", ("algo.estimator",))
    else:
        b.add("agent.path", None, "no `agent:` section (required unless on_policy_distill, A3)", ("agent",))
        b.add("agent.max_turns", 1, "no agent", ("agent",))


def _old_logprob_pass(b: _Builder, r: Any) -> None:
    """B28: when the training forward sees the weights π_old was sampled against (force_on_policy, or one epoch
    whose rollout batch is exactly one train batch: one optimizer step, taken after every forward) and KL is off,
    the training forward's detached log-probs are π_old (ratio 1) and the no-grad pass before the step is skipped."""
    coef, ref = b.v("algo.kl.coef"), b.v("ref.exists")
    t, sps = r.train, b.v("rollout.samples_per_step")
    one_step = not t.force_on_policy and t.max_epochs == 1 and sps == t.batch_size
    inputs = (
        "train.force_on_policy",
        "train.max_epochs",
        "train.batch_size",
        "rollout.samples_per_step",
        "algo.kl.coef",
        "ref",
    )
    if t.force_on_policy:
        when = "force_on_policy"
    elif one_step:
        when = (
            f"one optimizer step per rollout batch (max_epochs 1, samples {sps} = train.batch_size "
            f"{t.batch_size}), taken after every forward of the batch"
        )
    else:
        b.add(
            "actor.old_logprob_pass",
            True,
            f"π_old: a no-grad forward before the step (samples {sps} vs train.batch_size {t.batch_size} × "
            f"max_epochs {t.max_epochs}: the policy moves within the batch)",
            inputs,
        )
        return
    if coef != 0 or ref:
        why = f"algo.kl.coef {coef} > 0" if coef != 0 else "a reference model (`ref:`) whose KL is taken against π_old"
        b.add("actor.old_logprob_pass", True, f"{when}, but {why}: π_old is computed before the step (B28)", inputs)
    else:
        b.add(
            "actor.old_logprob_pass",
            False,
            f"{when} with algo.kl.coef 0: the training forward's detached log-probs are π_old, the PPO "
            "ratio is 1; IS against the rollout log-probs still applies (B28)",
            inputs,
        )


# ---------------------------------------------------------------------------------------------- schedule
DEFERRED = "counted at job start (DATA010)"
"""Reason of a value that follows from rows the compiler could not count."""


def _rl_schedule(b: _Builder, r: Any, source: Any) -> None:
    ro, t, d = r.rollout, r.train, r.data
    count, why = count_rows(
        resolve_sources(d.prompts, "data.prompts", source), d.max_samples, d.prompt_probs, d.split, _job_root(source)
    )
    b.add("data.prompt_count", count, why, ("data.prompts", "data.max_samples", "data.prompt_probs"))
    critic = (r.critic if r.critic is not None else _default_critic()) if b.v("critic.exists") else None
    inputs = RlCountInputs(
        rollout_batch_size=ro.batch_size,
        n_samples_per_prompt=ro.n_samples_per_prompt,
        train_batch_size=t.batch_size,
        episodes=t.episodes,
        max_epochs=t.max_epochs,
        force_on_policy=t.force_on_policy,
        dynamic_filtering=bool(r.algo.dynamic_filtering),
        freezing_steps=r.actor.freezing_steps if critic is not None else 0,
        actor_warmup_ratio=r.actor.optimizer.warmup_ratio,
        critic_warmup_ratio=critic.optimizer.warmup_ratio if critic is not None else None,
    )
    per_step: tuple[Any, str, tuple[str, ...]]
    if t.force_on_policy:
        per_step = (1, "force_on_policy: one optimizer step per rollout batch (G10)", ("train.force_on_policy",))
    else:
        sps = b.v("rollout.samples_per_step")
        per_step = (
            sps // t.batch_size * t.max_epochs,
            f"samples {sps} // train.batch_size {t.batch_size} × max_epochs {t.max_epochs}; a partial window is "
            "dropped (G8)",
            ("rollout.samples_per_step", "train.batch_size", "train.max_epochs"),
        )
    if count is not None:
        values = rl_schedule(count, inputs)
    else:
        names = _RL_COUNTED + (_CRITIC_COUNTED if critic is not None else ())
        values = [(name, None, DEFERRED, ("data.prompt_count",)) for name in names]
        if not d.prompt_probs:  # interleaving by probability has no length at all (capability rl-data-format)
            b.add(
                "data.count_at_start",
                inputs.model_dump(),
                "the job counts the prompts at start and derives the values marked DATA010 with schemas/schedule.py",
                ("data.prompts",),
            )
    for name, value, why, keys in values:
        b.add(name, value, why, keys)
        if name == "train.optimizer_steps":
            b.add("train.optimizer_steps_per_step", *per_step)


_RL_COUNTED = (
    "train.steps_per_episode",
    "train.total_steps",
    "train.optimizer_steps",
    "actor.scheduler_steps",
    "actor.warmup_steps",
)
_CRITIC_COUNTED = ("critic.scheduler_steps", "critic.warmup_steps")


def _job_root(source: Any) -> str | None:
    return source.job_root if source is not None else None


def _rl_eval_ckpt(b: _Builder, r: Any) -> None:
    e, ro = r.eval, r.rollout
    enabled = e.dataset is not None
    b.add("eval.enabled", enabled, "eval.dataset set" if enabled else "no eval.dataset", ("eval.dataset",))
    if e.every == -1 or not enabled:
        b.add("eval.every", None, "eval.every -1: never (B12)" if enabled else "no eval", ("eval.every",))
    else:
        b.add("eval.every", e.every, f"every {e.every} steps", ("eval.every",))
    for key in ("batch_size", "n_samples_per_prompt", "temperature", "top_p", "max_new_tokens"):
        own = getattr(e, key)
        if own is not None:
            b.add(f"eval.{key}", own, "set in the recipe", (f"eval.{key}",))
        else:
            b.add(
                f"eval.{key}",
                getattr(ro, key),
                f"eval.{key} unset: rollout.{key} (B13)",
                (f"eval.{key}", f"rollout.{key}"),
            )
    _ckpt(b, r)


def _ckpt(b: _Builder, r: Any) -> None:
    c = r.ckpt
    b.add(
        "ckpt.every",
        None if c.every == -1 else c.every,
        "ckpt.every -1: never (B12)" if c.every == -1 else f"every {c.every} steps",
        ("ckpt.every",),
    )
    if c.dcp_keep is None:
        b.add("ckpt.dcp_keep", c.keep, "ckpt.dcp_keep unset: ckpt.keep (B7)", ("ckpt.dcp_keep", "ckpt.keep"))
    else:
        b.add("ckpt.dcp_keep", c.dcp_keep, "set in the recipe", ("ckpt.dcp_keep",))


def _rl(b: _Builder, r: Any, source: Any) -> None:
    _rl_roles(b, r, source)
    _actor_extras(b, r)
    _rollout(b, r)
    _gpu_totals(b, r)
    _algo(b, r)
    _rl_schedule(b, r, source)
    _rl_eval_ckpt(b, r)


# ---------------------------------------------------------------------------------------------- SFT
def _sft(b: _Builder, r: Any, source: Any) -> None:
    a, t, d = r.actor, r.train, r.data
    _fsdp_role(
        b,
        "actor",
        a.nodes * a.gpus_per_node,
        f"actor.nodes {a.nodes} × actor.gpus_per_node {a.gpus_per_node}",
        ("actor.nodes", "actor.gpus_per_node"),
        a.mesh,
        t.batch_size,
        t.micro_batch_size,
        False,
        "actor.mesh",
        "train",
    )
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
        _job_root(source),
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
    _ckpt(b, r)
