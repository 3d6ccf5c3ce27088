"""Plan v1: the compiled, immutable job. The runtime reads only this; it never re-derives or re-validates.

A plan is produced by `molt_compile.lower.lower()` from a validated recipe and its derived values. It is
deterministic: the same recipe gives byte-identical JSON on any machine (no time, host, or dict-order
dependence; paths are relative to the project root, the compile-time working directory). `fingerprint` is the
sha256 of the canonical JSON of the plan without the fingerprint itself.

Layout:
- identity: `schema_version`, `name`, `kind`, `fingerprint`, `source`, `recipe` (the resolved recipe, YAML keys);
- resources: `cluster`, `placement_groups`, `roles` (each with its `instances`), `gpu_map`;
- explanation: `derived` (every derived value with reason and inputs);
- launch: `env`, `runtime_env`, `entrypoint`;
- runtime slices: `rl` (kind rl) or `sft` (kind sft). Each Ray actor gets only the slice it needs.

Placeholders: `entrypoint` and `SftRuntime.command` contain `{plan_file}` (and, for SFT, `{node_rank}` and
`{master_addr}`), which the launcher substitutes; they are not part of the plan's identity.

Device slots: on GPU clusters (`cluster.device == "cuda"`) a device slot is a Ray `GPU`. On CPU clusters
(`cluster.gpu: cpu`) it is the custom Ray resource `device_slot`, which the launcher declares on every node
(`cluster.node_resources`), so bin packing works exactly as with GPUs and CPUs stay free for runners.
Each instance's `ray_options` is exactly what to pass to `.options(...)` (with the placement group and bundle).

Rank mapping: an FSDP role's rank r uses the r-th bundle of its placement group in node-sorted order at run time
(Molt placement.py; Ray PACK does not promise bundle order = node order). `bundle_nodes` and `instances[].node`
are where the compiler's bin packing put them; the runtime may log a mismatch but must not re-plan.

Why one module of ~950 lines: it is one versioned contract (PLAN_SCHEMA_VERSION) between the compiler and the runtime,
read top to bottom like a schema: every field with the docstring that documents it, each runtime slice next to the
sections it shares. Most of the lines are those docstrings; splitting the classes over files would split the contract
without shortening any one reader's path through it.
"""

import hashlib
import json
from typing import Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict

PLAN_SCHEMA_VERSION: Final = 1
PLAN_FILE_PLACEHOLDER = "{plan_file}"
"""Substituted by the launcher with the plan file's path (relative to the job's working directory)."""
DEVICE_SLOT_RESOURCE = "device_slot"
"""Custom Ray resource standing for one device on CPU clusters."""


def plain(value: Any) -> Any:
    """A plan (or any part of it) as JSON data: models become dicts of their fields in declaration order.

    Used instead of pydantic's serializer so that compiling never builds the plan's core schema (DESIGN §8);
    `lower()` builds every model with its declared types, and `from_json` validates everything it reads. Only
    models and lists of models are converted; every other field already holds JSON data (tuples encode as lists),
    so large maps (`gpu_map`, bundles) pass through untouched.
    """
    if isinstance(value, BaseModel):
        return {k: plain(v) for k, v in value.__dict__.items()}
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [plain(v) for v in value]
    return value


def _compact(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _pretty(data: dict[str, Any]) -> str:
    """Two-level layout of canonical JSON (the C encoder does each line; indent= would fall back to pure Python)."""
    lines = ["{"]
    keys = sorted(data)
    for i, key in enumerate(keys):
        value, comma = data[key], "," if i < len(keys) - 1 else ""
        if isinstance(value, list) and value:
            lines.append(f" {_compact(key)}: [")
            lines += [f"  {_compact(item)}{',' if j < len(value) - 1 else ''}" for j, item in enumerate(value)]
            lines.append(f" ]{comma}")
        elif isinstance(value, dict) and value:
            lines.append(f" {_compact(key)}: {{")
            sub = sorted(value)
            lines += [
                f"  {_compact(k)}: {_compact(value[k])}{',' if j < len(sub) - 1 else ''}" for j, k in enumerate(sub)
            ]
            lines.append(f" }}{comma}")
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


class PlanModel(BaseModel):
    """Base of every plan model: frozen, unknown keys are errors.

    The attribute docstrings document every field in this file; they are not copied into pydantic's JSON Schema
    (`use_attribute_docstrings` parses the source of every class at import, ~50 ms, and compiling must stay fast,
    DESIGN §8). `defer_build` builds validators on first use (the runtime's `from_json`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


JsonValue = Any


# ---------------------------------------------------------------------------------------------- resources
class ClusterPlan(PlanModel):
    nodes: int
    """Nodes of the job."""
    gpus_per_node: int
    """Device slots per node (GPUs, or CPU device slots when `device == "cpu"`)."""
    gpu: str
    """GPU catalog key, or `cpu`."""
    device: Literal["cuda", "cpu"]
    """torch device of the trained models and engines."""
    device_resource: Literal["GPU", "device_slot"]
    """Ray resource that one device slot is."""
    cpus_per_node: int
    """Ray CPUs each node offers: the recipe's, the GPU catalog's node profile, else what the placement needs."""
    node_resources: dict[str, float]
    """What every node must declare to Ray (`ray start --num-cpus/--num-gpus/--resources`)."""
    total_gpus: int
    """nodes x gpus_per_node."""
    used_gpus: int
    """Device slots the job occupies (colocated roles share)."""


class PlacementGroupPlan(PlanModel):
    name: str
    """Stable name: `rollout`, `fsdp` (shared by colocated roles), `actor`, `ref`, `critic`."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
    """Ray placement strategy."""
    bundles: list[dict[str, float]]
    """Ray bundles in order, e.g. `{"GPU": 1, "CPU": 1}`."""
    bundle_nodes: list[int]
    """Node index where the compiler's bin packing put each bundle."""


class RayOptions(PlanModel):
    num_cpus: float
    """`num_cpus` of the Ray actor."""
    num_gpus: float
    """`num_gpus` of the Ray actor (0 on CPU clusters)."""
    resources: dict[str, float] = {}
    """Custom resources (`device_slot` on CPU clusters)."""


class InstancePlan(PlanModel):
    index: int
    """Rank / engine index / runner index within the role."""
    label: str
    """The name used in `gpu_map`, e.g. `actor.rank[3]`, `rollout.engine[0]`."""
    node: int
    """Node the instance is expected on (its first device's node)."""
    bundle_indices: list[int]
    """Bundles of the role's placement group this instance uses (several for a ray-executor engine's workers)."""
    devices: list[list[int]]
    """`[node, local device index]` of every device slot it occupies (empty for CPU-only roles)."""


class RolePlan(PlanModel):
    name: str
    """Stable role name: rollout.engine, router, actor, ref, critic, controller, lock, queue.rollout, queue.slots,
    generator, runner, trainer (RL); torchrun (SFT)."""
    actor_class: str
    """What the runtime instantiates for this role (a logical class name)."""
    count: int
    """Number of instances."""
    num_gpus: float
    """Device slots each instance requests (0.2 when colocated; 0 for a ray-executor engine whose workers hold them)."""
    num_cpus: float
    """CPUs each instance requests."""
    placement_group: str | None
    """Name of its placement group, or None."""
    scheduling: Literal["placement_group", "SPREAD", "DEFAULT"]
    """How Ray schedules it."""
    ray_options: RayOptions
    """Exactly what to pass to `.options(...)` (plus the placement group strategy)."""
    instances: list[InstancePlan]
    """One entry per instance, in rank order."""
    env: dict[str, str] = {}
    """Extra environment of this role's processes (on top of the job env)."""


# ---------------------------------------------------------------------------------------------- derived
class DerivedEntry(PlanModel):
    name: str
    """Dotted derived name, e.g. `actor.dp`."""
    value: JsonValue
    """The value (None when it could not be computed; the reason says why)."""
    reason: str
    """One line: how it was computed."""
    inputs: list[str]
    """Recipe keys and derived names it was computed from."""


# ---------------------------------------------------------------------------------------------- RL slices
class ModelPlan(PlanModel):
    path: str
    """Policy checkpoint (local path relative to the project root, or a hub name)."""
    arch: str | None
    """Catalog architecture key, when known."""
    backend: Literal["automodel", "hf"]
    """The training backend that runs: hf when the recipe says so or the architecture has no AutoModel class."""
    dtype: Literal["bfloat16", "float16", "float32"]
    """FSDP compute dtype (torch name). Master weights stay fp32."""
    attn: str
    """Attention implementation of the trained models."""
    gradient_checkpoint: Literal["full", "selective", "none"]
    """Activation checkpointing (the reference model never checkpoints)."""
    compile_layers: bool
    """Each decoder layer's forward under `torch.compile`."""
    disable_fast_tokenizer: bool
    """Load the slow tokenizer."""
    router_dtype: Literal["bfloat16", "float16", "float32"]
    """Compute dtype of the MoE routers (torch name); their master weights stay fp32."""
    moe_dispatcher: Literal["torch", "deepep", "hybridep", "uccl_ep"] | None
    """MoE token dispatcher of the automodel backend's MoE layers (`model.moe_dispatcher`; Molt's
    `MOLT_MOE_DISPATCHER`, B19); None for a model known to be dense."""


class EnginesPlan(PlanModel):
    kind: Literal["vllm", "hf"]
    """Engine implementation."""
    device: Literal["cuda", "cpu"]
    """torch device of the engines (the cluster's)."""
    count: int
    """Number of engines."""
    tp: int
    """Tensor parallel per engine."""
    pp: int
    """Pipeline parallel per engine."""
    dp: int
    """Data parallel per engine."""
    gpus_per_engine: int
    """tp x pp x dp."""
    executor: Literal["uni", "mp", "ray"]
    """vLLM distributed executor (derived when `auto`)."""
    expert_parallel: bool
    """vLLM TP+EP hybrid."""
    dtype: str
    """Engine dtype."""
    max_model_len: int
    """Context length (data.max_len)."""
    max_num_seqs: int
    """hf engine: sequences it decodes at once, one KV-cache slot each (more requests wait for a free slot): the
    requests the generator keeps in flight per engine, at most 256. vLLM keeps its own max_num_seqs."""
    gpu_memory_utilization: float
    """vLLM memory fraction."""
    enforce_eager: bool
    """Disable CUDA graphs."""
    prefix_caching: bool
    """vLLM prefix caching."""
    seeds: list[int]
    """Seed of engine i = train.seed + i."""
    router_policy: str
    """Request routing policy across engines."""
    router_balance_abs: int
    """cache_aware: sticky until max - min in-flight requests > abs (and the ratio below)."""
    router_balance_rel: float
    """cache_aware: ... and max > rel x min in-flight requests."""
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"]
    """vLLM logprobs mode."""
    max_images_per_prompt: int
    """vLLM limit_mm_per_prompt (0: text only)."""
    extra_engine_args: dict[str, JsonValue]
    """Only the engine knobs the recipe set (attention_backend, block_size, ...), with vLLM's argument names."""
    routed_experts: bool
    """Engines return the experts each token was routed to (R3, `train.routing_replay`)."""
    routing_hook: bool
    """vLLM engines capture that routing in Molt's worker extension (a hook on each MoE router, kept per KV slot:
    `runtime/engines/vllm_routing.py`) instead of vLLM's own `enable_return_routed_experts`, which only vLLM's Model
    Runner V2 (CUDA, with Triton) implements: vLLM engines on CPU."""


class AgentPlan(PlanModel):
    path: str
    """Agent file relative to the project root, or `builtin:distill`."""
    chat: bool
    """The file's runner is chat-style (`ChatAgentRunner`, or `PRERENDER_PROMPT = False`): rows reach it as chat
    messages, and it samples through the OpenAI-compatible chat server."""
    max_turns: int
    """Turn limit (also exported as MAX_AGENT_TURNS)."""
    env: dict[str, str]
    """Environment of the runner processes."""
    runners: int
    """Number of agent runner actors."""
    max_restarts: int
    """Restarts of one runner actor within `restart_window_s` (its in-flight groups are re-sent); one more death in
    the window and the generator gives that runner up (the run ends when every runner is given up)."""
    restart_window_s: float
    """The window of `max_restarts`: deaths longer ago no longer count."""
    step_timeout_s: float
    """Bound on one `Env.step` (rollout dropped as `step_timeout`)."""
    episode_timeout_s: float
    """Bound on one episode (rollout dropped as `episode_timeout`)."""
    group_timeout_s: float
    """Bound on one group's call to its runner: past it the group is dropped (`episode_timeout`) and the runner,
    which stopped answering, is restarted."""
    max_prompt_attempts: int
    """A prompt whose runner died under it is sent at most this many times, then dropped as `agent_crash`; a prompt
    that was the only one on a runner when it died (or stopped answering) is dropped at once (quarantined)."""


class RlCountInputs(PlanModel):
    """What the job derives its step count and LR schedule from when the compiler could not count the prompts
    (DATA010): `schemas/schedule.py` maps a row count and these to the values `derive` would have written."""

    rollout_batch_size: int
    """Prompt groups per trainer step (rollout.batch_size)."""
    n_samples_per_prompt: int
    """Rollouts per prompt."""
    train_batch_size: int
    """Samples per optimizer step (train.batch_size)."""
    episodes: int
    """Passes over the prompts."""
    max_epochs: int
    """Training passes per rollout batch."""
    force_on_policy: bool
    """One optimizer step per rollout batch."""
    dynamic_filtering: bool
    """Dropped groups are backfilled (only the reason's text)."""
    freezing_steps: int
    """Optimizer steps the actor waits for the critic (0 without a critic)."""
    actor_warmup_ratio: float
    """actor.optimizer.warmup_ratio."""
    critic_warmup_ratio: float | None
    """critic.optimizer.warmup_ratio (None: no critic)."""


class RlDataPlan(PlanModel):
    prompts: list[str]
    """Prompt sources (relative to the project root; `path@data_dir` kept)."""
    probs: list[float] | None
    """Interleave probabilities."""
    split: str
    """Split name."""
    input_key: str
    """Prompt column."""
    label_key: str | None
    """Label column."""
    tools_key: str | None
    """Tool schema column."""
    image_key: str | None
    """Image column of a VLM run (None: text prompts, `max_images_per_prompt` 0)."""
    max_images_per_prompt: int
    """> 0 marks a VLM run."""
    apply_chat_template: bool
    """Rows are chat messages."""
    max_len: int
    """Total context budget."""
    max_samples: int
    """Cap per source and on the blend."""
    dataloader_num_workers: int
    """Dataloader workers."""
    prompt_count: int | None
    """Prompts after caps, counted at compile time (None: unknown)."""
    count_at_start: RlCountInputs | None = None
    """Set when the compiler could not count the prompts (not on the compiling machine, a hub name): the job counts
    them at start and fills in `prompt_count`, the step count and the LR schedule's length (`schemas/schedule.py`).
    None: counted at compile time."""


class SamplingPlan(PlanModel):
    n_samples_per_prompt: int
    """Group size."""
    max_new_tokens: int | None
    """Per-turn cap (None: what context is left)."""
    min_new_tokens: int
    """Tokens per turn before an EOS may be sampled (0: off; the runner cuts it to the turn's cap)."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus sampling."""
    logprobs: bool
    """Ask the engine for sampled-token logprobs."""
    top_logprobs: int
    """Top-k log-probs per generated token for score centering (0: none; eval always 0)."""


class EvalPlan(PlanModel):
    enabled: bool
    """An eval dataset is set."""
    dataset: str | None
    """Eval source (relative to the project root)."""
    split: str
    """Eval split."""
    every: int | None
    """Eval every N steps (None: never)."""
    at_start: bool
    """Baseline eval at step 0 on fresh runs."""
    only: bool
    """Eval once and exit."""
    batch_size: int
    """Prompt groups per eval round."""
    sampling: SamplingPlan
    """Eval sampling (rollout fallbacks applied)."""
    pass_k: list[int]
    """The k of each reported pass@k (unbiased estimator over n_samples_per_prompt samples): 1, 2, 4, ... below n,
    and n itself."""


class GeneratorPlan(PlanModel):
    batch_size: int
    """Prompt groups per training step."""
    generate_batch_size: int
    """Prompt groups kept in flight."""
    episodes: int
    """Passes over the prompts."""
    dynamic_filtering: list[float] | None
    """Open interval (lo, hi) on group mean score, None: off."""
    seed: int
    """Sampler seed."""
    rollout_dump_dir: str | None
    """Each rollout batch is saved here as `rollout_step{N}.pt` (N: the step that trains it). None: off."""
    rollout_replay_dir: str | None
    """Batches are loaded from `rollout_step{N}.pt` here instead of generated (training only); the run ends at the
    first missing step. None: off."""


class QueuePlan(PlanModel):
    size: int
    """Depth of the rollout queue and slot queue."""
    partial_rollout: bool
    """Generation skips the engine lock (pause/resume around sync)."""
    force_sync: bool
    """Return the slot only after the train step and its sync."""
    colocated_gpus: Literal["overlap", "alternate"]
    """`alternate`: each train step holds the engine lock with the engines paused, from the experience pass through
    the weight sync (the trainer has the shared GPUs alone); `overlap`: the engines generate beside it."""


class MeshPlan(PlanModel):
    tp: int
    """Tensor parallel."""
    cp: int
    """Context parallel."""
    ep: int
    """Expert parallel."""
    pp: int
    """Pipeline parallel."""
    dp_replicate: int
    """HSDP replicas of the data-parallel ranks (1: FSDP over all of them)."""


class OptimizerPlan(PlanModel):
    name: Literal["adam", "muon"]
    """Optimizer family."""
    lr: float
    """Learning rate."""
    betas: list[float]
    """AdamW betas."""
    eps: float
    """AdamW eps."""
    weight_decay: float
    """AdamW weight decay."""
    max_norm: float
    """Gradient clip norm (<= 0: off)."""
    scheduler: str
    """transformers scheduler name."""
    warmup_steps: int | None
    """Warmup optimizer steps (None: dataset size unknown, no warmup)."""
    total_steps: int | None
    """Scheduler length in optimizer steps (None: unknown)."""
    min_lr_ratio: float
    """LR floor as a fraction of lr."""
    muon: dict[str, JsonValue] | None
    """Muon settings when name is muon."""


class LossPlan(PlanModel):
    mode: Literal["ppo", "cispo", "gspo"]
    """Policy surrogate."""
    clip_low: float
    """Clip band low offset."""
    clip_high: float
    """Clip band high offset (cispo: absolute ceiling)."""
    dual_clip: float | None
    """Dual-clip bound."""
    entropy_coef: float
    """Entropy coefficient."""
    aux_loss_coef: float
    """MoE aux loss coefficient."""
    router_z_loss_coef: float
    """MoE router z-loss coefficient (0: off)."""
    agg_mode: Literal["token-mean", "seq-mean-token-mean", "prompt-mean-token-mean"]
    """Aggregation of the policy-gradient term over an optimizer step's window on all DP ranks (KL and entropy
    stay token-mean)."""


class LoraPlan(PlanModel):
    dim: int
    """Adapter rank (> 0)."""
    alpha: int
    """Adapter alpha."""
    scale: float
    """alpha / dim: the merge is W + scale x B @ A."""
    target_modules: list[str] | None
    """fnmatch wildcards on full module names; None: every linear layer (lm_head excluded)."""


class FsdpTrainerPlan(PlanModel):
    """What every FSDP trainer takes, RL policy and SFT model alike (the fields the two plans share)."""

    world: int
    """Ranks of the FSDP group."""
    dp: int
    """Data-parallel size."""
    mesh: MeshPlan
    """FSDP mesh."""
    micro_batch_size: int
    """Per-rank microbatch."""
    grad_accum: int
    """Microbatches per optimizer step."""
    batch_size: int
    """Global samples per optimizer step."""
    max_epochs: int
    """Epochs over each batch (RL: each rollout batch)."""
    width_multiple: int
    """Batches and micro-batches are right-padded to a multiple of this many positions (8 on GPUs: the SDPA mask
    alignment, which compiled layers otherwise recompile on; 1 on CPUs)."""
    packing: bool
    """Sequence packing (actor.packing)."""
    sequence_parallel: bool
    """Sequence parallel in TP."""
    offload: Literal["none", "optimizer", "full"]
    """CPU offload."""
    optimizer: OptimizerPlan
    """The trained model's optimizer."""
    freeze_moe_router: bool
    """Freeze the MoE router."""
    freeze_visual_encoder: bool
    """Freeze the vision tower."""
    full_determinism: bool
    """Full determinism."""
    seed: int
    """torch seed of every rank (train.seed)."""
    lora: LoraPlan | None
    """LoRA adapters (None: full fine-tuning)."""


class TrainerPlan(FsdpTrainerPlan):
    force_on_policy: bool
    """One optimizer step per rollout batch: each rank's whole shard is one accumulation window (Molt G10), for
    fixed and token-budget micro-batches alike; max_epochs is 1 (BATCH005)."""
    old_logprob_pass: bool
    """π_old comes from a no-grad forward of the batch before the step (`forward_logprobs`). False (force_on_policy
    with KL coef 0 and no reference, Molt B28): the training forward's detached log-probs are π_old, so the PPO
    ratio is exactly 1; IS against the rollout log-probs still applies."""
    dynamic_batch_max_tokens: int | None
    """Token cap per microbatch (None: fixed-size microbatches)."""
    local_batch_size: int | None
    """Samples per rank per step under dynamic batching."""
    shuffle_microbatches: bool
    """Molt's replay loader shuffles rows into micro-batches (G11: tp x cp <= 1, no dynamic batching). Explain's fact:
    the runtime realizes it as `micro_batches_by_length`."""
    micro_batches_by_length: bool
    """Each optimizer-step window's rows go to its fixed micro-batches by length, longest together (least padding),
    where Molt shuffles them (`shuffle_microbatches`) and they are not packed; else contiguous rows. The policy,
    the reference and the critic all cut micro-batches by this section."""
    loss: LossPlan
    """Policy loss."""
    freezing_steps: int
    """gae: policy frozen for the first N steps."""
    temperature: float
    """Logits temperature (rollout.temperature)."""
    routing_replay: bool
    """R3 routing replay."""
    row_multiple: int
    """Rows of each batch are padded to a multiple of this (empty action masks): the lcm of the worlds of the
    policy, a reference and the critic, so every rank of every FSDP group gets as many rows."""


class RefPlan(PlanModel):
    path: str
    """Reference / teacher checkpoint."""
    colocated: bool
    """Shares the actor's bundles."""
    world: int
    """Ranks."""
    dp: int
    """Data-parallel size."""
    grad_accum: int
    """As the actor's (Molt checks it for every FSDP group)."""


class CriticPlan(PlanModel):
    path: str
    """Initial critic weights."""
    colocated: bool
    """Shares the actor's bundles."""
    world: int
    """Ranks (always the actor's)."""
    mesh: MeshPlan
    """The critic's device mesh: the actor's tp (nemo-automodel's TP plan, the scalar head replicated), FSDP2 over
    the rest of its ranks (no cp, ep, pp or HSDP: those are the actor's alone)."""
    dp: int
    """Data-parallel size: world / tp (the critic runs no cp, so under the actor's cp it has cp times the actor's
    data-parallel ranks)."""
    grad_accum: int
    """Microbatches per optimizer step, over the critic's own dp."""
    local_batch_size: int | None
    """Rows of one optimizer-step window of a rank under dynamic batching: train.batch_size // the critic's dp
    (None when off)."""
    value_clip: float
    """PPO value clip."""
    max_epochs: int
    """Critic epochs per step."""
    optimizer: OptimizerPlan
    """Critic optimizer."""
    freeze_moe_router: bool
    """Freeze the critic's router."""


class KlPlan(PlanModel):
    coef: float
    """(Initial) KL coefficient."""
    estimator: Literal["k1", "k2", "k3"]
    """KL estimator."""
    use_loss: bool
    """KL as loss term (else in the reward)."""
    ref: Literal["model", "rollout"]
    """KL reference: the reference model's log-probs, or the rollout engine's sampled-token log-probs."""
    to_rollout: bool
    """The KL is on (coef > 0) against the rollout policy: the engine's sampled-token log-probs are π_ref (derived
    `algo.kl.to_rollout`)."""
    target: float | None
    """Adaptive controller target."""
    horizon: int
    """Adaptive controller horizon."""


class IsCorrectionPlan(PlanModel):
    enabled: bool
    """The IS correction applies (level is not off; derived `algo.is_correction.enabled`)."""
    level: Literal["off", "token", "seq", "geo"]
    """IS level."""
    mode: Literal["mask", "clip", "trunc"]
    """IS mode."""
    gating: Literal["ratio", "binary_kl", "tv"]
    """Statistic the band tests."""
    low: float | None
    """Band low (None: -inf)."""
    high: float
    """Band high."""


class AlgoPlan(PlanModel):
    estimator: str
    """Advantage estimator."""
    gamma: float
    """Discount."""
    lam: float
    """GAE lambda."""
    whiten: bool
    """Whiten advantages."""
    reward_clip: list[float]
    """[lo, hi] reward clamp."""
    kl: KlPlan
    """Effective KL settings."""
    is_correction: IsCorrectionPlan
    """Importance sampling correction."""
    score_centering_top_k: int
    """Score centering on the engine's top-k log-probs (0: off)."""
    overlong_buffer_len: float | None
    """DAPO overlong penalty buffer B (None: off)."""
    overlong_penalty_factor: float
    """Largest overlong penalty."""
    overlong_max_len: int
    """L of the overlong ramp: data.max_len."""
    stop_properly_penalty_coef: float | None
    """ProRL stop-properly coefficient on truncated rollouts (None: off)."""


class SchedulePlan(PlanModel):
    steps_per_episode: int | None
    """Trainer steps per pass over the prompts (None: run until the prompts are exhausted)."""
    total_steps: int | None
    """Trainer steps of the run (None: unknown)."""
    log_every: int
    """Log every N steps."""
    ckpt_every: int | None
    """Checkpoint every N steps (None: never)."""
    eval_every: int | None
    """Eval every N steps (None: never)."""


class CkptPlan(PlanModel):
    dir: str
    """DCP root (relative to the job's working directory)."""
    hf_dir: str
    """HF export directory."""
    keep: int
    """HF exports kept (<= 0: all)."""
    dcp_keep: int
    """DCP checkpoints kept (<= 0: all)."""
    max_disk_gb: float | None
    """Disk budget."""
    save_hf: bool
    """HF snapshot at each save."""
    resume: bool
    """Resume from the newest checkpoint."""
    final_save: bool
    """Export HF weights at the end."""
    best_metric_key: str | None
    """Eval metric whose improvement saves `<dir>/best` (higher is better; resolved from the recipe: "" is
    `eval/pass1` when the run evaluates, Molt's first `*_pass1`). None: no best checkpoint ("none", no eval, SFT)."""
    warm_resume_rollouts: bool
    """Keep untrained rollouts for resume."""


class LoggingPlan(PlanModel):
    out_dir: str
    """metrics.jsonl and plots go here (`runs/<name>`)."""
    every: int
    """Log every N steps."""
    tensorboard_dir: str | None
    """TensorBoard directory."""
    wandb: dict[str, JsonValue] | None
    """wandb settings (the key stays an `${env:...}` reference)."""


class WeightSyncPlan(PlanModel):
    method: Literal["gloo_broadcast", "nccl_broadcast", "cuda_ipc"]
    """How weights reach the engines after each step: bucket by bucket (`bucket_bytes`), trainer rank 0 casts its
    shard rows to `engines.dtype` into the bucket and receives every other rank's rows (cast by that rank) straight
    into their place, then broadcasts the bucket over a dedicated process group (gloo on CPU, NCCL on GPUs) to every
    engine worker, which loads it as it arrives;
    `cuda_ipc` (engines on trainer rank 0's GPU): the buckets stay in two GPU slots the engines map through CUDA IPC,
    and the group (gloo) carries only the hand-shakes."""
    world_size: int
    """Members of the weight-sync group: trainer rank 0 + every engine worker."""
    engine_rank_offsets: list[int]
    """Group rank of engine i's first worker (its workers follow it)."""
    bucket_bytes: int
    """Size of one broadcast bucket; sender and each receiver hold at most two."""
    master_port: int
    """Port of the group's store on trainer rank 0's node (0: a free port chosen there at start)."""
    timeout_s: int
    """How long forming the group or one broadcast may take before the run fails."""
    check_unassigned: bool
    """`train.check_weight_update_equal`: after each sync every engine reports the parameters it did not assign
    (`weight_sync/unassigned_params`, a warning names them; the run goes on, as in Molt)."""


class SupervisorPlan(PlanModel):
    poll_s: float
    """How often the driver checks the actors' health, the stop flag and the stall bound while it waits."""
    stall_timeout_s: float
    """A phase that waits longer than this ends the run as stalled."""
    stop_timeout_s: float
    """After a stop signal, the current phase gets this long before everything is torn down."""


class RlRuntime(PlanModel):
    device: Literal["cuda", "cpu"]
    """torch device."""
    dist_backend: str
    """torch.distributed backend."""
    model: ModelPlan
    """The trained model."""
    engines: EnginesPlan
    """Rollout engines."""
    agent: AgentPlan
    """Agent and runners."""
    data: RlDataPlan
    """Prompt data."""
    sampling: SamplingPlan
    """Rollout sampling."""
    eval: EvalPlan
    """Evaluation."""
    generator: GeneratorPlan
    """Generator loop."""
    queue: QueuePlan
    """Async queue."""
    trainer: TrainerPlan | None
    """Policy trainer (None with eval.only)."""
    ref: RefPlan | None
    """Reference / teacher (None: none)."""
    critic: CriticPlan | None
    """Critic (None: none)."""
    algo: AlgoPlan
    """Advantages, KL, IS."""
    schedule: SchedulePlan
    """Step counts and cadences."""
    ckpt: CkptPlan
    """Checkpoints."""
    logging: LoggingPlan
    """Metrics."""
    weight_sync: WeightSyncPlan
    """Weight sync."""
    supervisor: SupervisorPlan
    """Bounds of the driver's supervision (deaths, stalls, stops)."""


# ---------------------------------------------------------------------------------------------- SFT slice
class SftCountInputs(PlanModel):
    """What an SFT job derives its step count and LR schedule from when the compiler could not count the dataset
    (DATA010; `schemas/schedule.py`)."""

    batch_size: int
    """Global batch (rows per optimizer step)."""
    max_epochs: int
    """Epochs."""
    warmup_ratio: float
    """actor.optimizer.warmup_ratio."""
    eval_every_epoch: bool
    """eval.every -1 with an eval set: evaluate once per epoch (steps_per_epoch)."""


class SftDataPlan(PlanModel):
    dataset: list[str]
    """Training sources (relative to the project root)."""
    probs: list[float] | None
    """Interleave probabilities."""
    split: str
    """Split."""
    input_key: str
    """Prompt column."""
    output_key: str | None
    """Reply column."""
    chat_template: str | None
    """Chat template override."""
    train_on_last_turn_only: bool
    """Supervise only the last assistant turn."""
    image_key: str | None
    """Image column (VLM SFT)."""
    max_images_per_prompt: int
    """Rows with more images are dropped."""
    max_len: int
    """Sequence length."""
    max_samples: int
    """Cap on samples."""
    dataloader_num_workers: int
    """Dataloader workers."""
    sample_count: int | None
    """Rows counted at compile time (None: unknown)."""
    count_at_start: SftCountInputs | None = None
    """Set when the compiler could not count the rows: the job counts them at start and fills in `sample_count`, the
    step counts, a per-epoch eval cadence and the LR schedule's length (`schemas/schedule.py`). None: counted here."""


class SftTrainerPlan(FsdpTrainerPlan):
    aux_loss_coef: float
    """MoE aux loss."""


class SftSchedulePlan(PlanModel):
    steps_per_epoch: int | None
    """Optimizer steps per epoch (None: unknown)."""
    total_steps: int | None
    """Optimizer steps of the run."""
    log_every: int
    """Log every N steps."""
    ckpt_every: int | None
    """Checkpoint every N steps (None: never)."""
    eval_every: int | None
    """Eval every N steps (None: no eval)."""


class SftRuntime(PlanModel):
    device: Literal["cuda", "cpu"]
    """torch device."""
    dist_backend: str
    """torch.distributed backend."""
    nnodes: int
    """torchrun --nnodes."""
    nproc_per_node: int
    """torchrun --nproc-per-node."""
    master_port: int
    """torchrun --master-port."""
    command: list[str]
    """The per-node command, with `{node_rank}`, `{master_addr}` and `{plan_file}` placeholders."""
    model: ModelPlan
    """The trained model."""
    trainer: SftTrainerPlan
    """Trainer."""
    data: SftDataPlan
    """Data."""
    eval_dataset: str | None
    """Eval source."""
    eval_split: str
    """Eval split."""
    schedule: SftSchedulePlan
    """Steps and cadences."""
    ckpt: CkptPlan
    """Checkpoints."""
    logging: LoggingPlan
    """Metrics."""


# ---------------------------------------------------------------------------------------------- the plan
class Plan(PlanModel):
    schema_version: Literal[1] = PLAN_SCHEMA_VERSION
    """Plan format version."""
    name: str
    """Job name (recipe name)."""
    kind: Literal["rl", "sft"]
    """Recipe kind."""
    fingerprint: str = ""
    """sha256 of the canonical JSON of the plan without this field."""
    source: str
    """Recipe path relative to the project root (absolute when outside it)."""
    recipe: dict[str, JsonValue]
    """The resolved recipe (after extends and --set, defaults filled), YAML key names."""
    cluster: ClusterPlan
    """The cluster."""
    derived: list[DerivedEntry]
    """Every derived value with its reason."""
    placement_groups: list[PlacementGroupPlan]
    """Ray placement groups in creation order."""
    roles: list[RolePlan]
    """Roles in creation order."""
    gpu_map: list[list[list[str]]]
    """node -> device slot -> labels of the instances on it (empty list: idle)."""
    env: dict[str, str]
    """Job-wide environment (recipe env, agent env, MAX_AGENT_TURNS)."""
    runtime_env: dict[str, JsonValue]
    """Ray runtime_env of the job."""
    entrypoint: list[str]
    """The job's command, `python -m runtime {plan_file}` (SFT: the torchrun command)."""
    rl: RlRuntime | None = None
    """Runtime slice of an RL plan."""
    sft: SftRuntime | None = None
    """Runtime slice of an SFT plan."""

    # ------------------------------------------------------------------ identity and serialization
    def canonical_json(self, *, with_fingerprint: bool = True) -> str:
        """Sorted keys, no whitespace, UTF-8 text: equal plans give equal strings (the fingerprint's input)."""
        data = plain(self)
        if not with_fingerprint:
            data.pop("fingerprint")
        return _compact(data)

    def compute_fingerprint(self) -> str:
        return hashlib.sha256(self.canonical_json(with_fingerprint=False).encode()).hexdigest()

    def with_fingerprint(self) -> Self:
        """A copy whose `fingerprint` is set (lower() returns plans built this way)."""
        return self.model_copy(update={"fingerprint": self.compute_fingerprint()})

    def to_json(self, indent: int | None = 1) -> str:
        """Canonical JSON, keys sorted either way so the text is deterministic. `indent=None`: one compact line.
        Otherwise (the default, used for plan and golden files) each top-level key, and each item of a top-level
        list or map (a derived value, a role, a node of the GPU map, a runtime section), is on its own line,
        compact within (the `indent` width itself is fixed at one space: the layout is the canonical one)."""
        data = plain(self)
        return _compact(data) if indent is None else _pretty(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        """Parse a plan; the fingerprint must match the content (a hand-edited plan is rejected)."""
        plan = cls.model_validate_json(text)
        if plan.fingerprint and plan.fingerprint != plan.compute_fingerprint():
            raise ValueError(
                "plan fingerprint does not match its content: the plan was edited after compiling; recompile the recipe"
            )
        return plan

    # ------------------------------------------------------------------ lookups
    def role(self, name: str) -> RolePlan:
        """The role called `name`; KeyError listing the roles when absent."""
        for r in self.roles:
            if r.name == name:
                return r
        raise KeyError(f"plan has no role {name!r}; roles: {', '.join(r.name for r in self.roles)}")

    def has_role(self, name: str) -> bool:
        return any(r.name == name for r in self.roles)

    def placement_group(self, name: str) -> PlacementGroupPlan:
        for pg in self.placement_groups:
            if pg.name == name:
                return pg
        raise KeyError(f"plan has no placement group {name!r}")

    def resource_demand(self) -> dict[str, float]:
        """Ray resources the job takes in all: every placement-group bundle, plus the `.options()` of every role
        instance scheduled outside a placement group (launchers check a cluster against this before running)."""
        demand: dict[str, float] = {}

        def add(res: dict[str, float], times: float = 1) -> None:
            for key, amount in res.items():
                if amount:
                    demand[key] = demand.get(key, 0.0) + amount * times

        for pg in self.placement_groups:
            for bundle in pg.bundles:
                add(bundle)
        for role in self.roles:
            if role.placement_group is None:
                opts = role.ray_options
                add({"CPU": opts.num_cpus, "GPU": opts.num_gpus, **opts.resources}, role.count)
        return demand

    def derived_value(self, name: str) -> JsonValue:
        for d in self.derived:
            if d.name == name:
                return d.value
        raise KeyError(f"plan has no derived value {name!r}")
