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
| `model.compile_layers` * | the recipe's; unset: on for a dense text model on the hf backend on GPUs without LoRA, else off | |
| `dist.backend` * | torch.distributed backend: gloo (cpu), nccl, or "cuda:nccl,cpu:gloo" with offload full | B26 |
| `actor.world` * | actor.nodes × actor.gpus_per_node | §3.2 |
| `actor.model_parallel` * | tp × cp (EP excluded) = ranks that receive the same samples | G2 |
| `actor.dp` * | world / (tp × cp), None when not integral | G2, G3 |
| `actor.device_mesh` | the trainer's meshes, nemo-automodel's layout: dp_replicate × dp_shard × cp × tp, and ep_shard × ep with experts; None when the sizes do not divide the ranks | §3.3 |
| `actor.grad_accum` * | batch / (micro × dp); 1 under dynamic batching; None when not integral | G4, B25 |
| `actor.packing` * | actor.packing as written (packing on a VLM run is DATA002, never rewritten) | B5 |
| `actor.num_gpus` | GPU fraction each policy worker requests: 0.2 when colocated, else 1 | B33 |
| `actor.temperature` | logits temperature of actor/ref/critic = rollout.temperature | B17 |
| `actor.shuffle_microbatches` | microbatch shuffling (only tp×cp ≤ 1 and no dynamic batching) | G11 |
| `actor.micro_batches_by_length` | a window's rows go to its fixed micro-batches longest together (least padding): on where microbatches are shuffled and not packed | G11 |
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
| `critic.path`, `critic.colocated`, `critic.world`, `critic.model_parallel`, `critic.dp`, `critic.grad_accum`, `critic.local_batch_size`, `critic.num_gpus` | as above (only when critic exists); world = actor's; the critic runs no cp: model_parallel = tp, dp = world / tp | J3 |
| `critic.max_epochs` | critic.max_epochs or train.max_epochs | B9 |
| `critic.value_clip` | critic.value_clip, the schema's default without a `critic:` section | |
| `critic.freeze_moe_router` | critic.freeze_moe_router or actor.freeze.moe_router | B9 |
| `critic.scheduler_steps`, `critic.warmup_steps` | critic LR schedule | B10 |
| `fsdp.colocate` | any FSDP role is colocated with the actor (one shared PACK group) | B8 |
| `fsdp.width_multiple` | positions each batch and micro-batch is right-padded to a multiple of: 8 on GPUs (SDPA mask alignment; compiled layers keep one graph), 1 on CPUs | |
| `fsdp.row_multiple` | lcm of the built FSDP worlds: every group of a step gets equal rows per rank | |
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

from typing import TYPE_CHECKING

from molt_compile.derive.algo import DISTILL_AGENT_PATH, derive_algo, is_band, kl_ref_of
from molt_compile.derive.cluster import (
    CUSTOM_NATIVE_ATTN,
    derive_attention,
    derive_backend,
    derive_cluster,
    derive_compile_layers,
    model_attn,
)
from molt_compile.derive.roles import COLOCATED_GPU_FRACTION, derive_actor_extras, derive_rl_roles
from molt_compile.derive.rollout import derive_gpu_totals, derive_rollout
from molt_compile.derive.schedule import DEFERRED, derive_rl_eval_ckpt, derive_rl_schedule
from molt_compile.derive.sft import SFT_MASTER_PORT, derive_sft
from molt_compile.derive.values import Builder, Derived, DerivedValue

if TYPE_CHECKING:
    from molt_compile.source import SourceMap
    from schemas.recipe import RlRecipe, SftRecipe

__all__ = [
    "COLOCATED_GPU_FRACTION",
    "CUSTOM_NATIVE_ATTN",
    "DEFERRED",
    "DISTILL_AGENT_PATH",
    "SFT_MASTER_PORT",
    "Derived",
    "DerivedValue",
    "derive",
    "is_band",
    "kl_ref_of",
    "model_attn",
]


def derive(recipe: RlRecipe | SftRecipe, source: SourceMap | None = None) -> Derived:
    """Every derived value of `recipe` (RlRecipe or SftRecipe). `source` locates the recipe file for data counts."""
    b = Builder()
    b.add("kind", recipe.kind, f"kind: {recipe.kind}", ("kind",))
    derive_cluster(b, recipe)
    derive_backend(b, recipe, source)
    if recipe.kind == "sft":
        derive_sft(b, recipe, source)
    else:
        derive_rl(b, recipe, source)
    derive_attention(b, recipe, source)
    derive_compile_layers(b, recipe, source)
    return Derived(b.items)


def derive_rl(b: Builder, r: RlRecipe, source: SourceMap | None) -> None:
    derive_rl_roles(b, r, source)
    derive_actor_extras(b, r)
    derive_rollout(b, r)
    derive_gpu_totals(b, r)
    derive_algo(b, r)
    derive_rl_schedule(b, r, source)
    derive_rl_eval_ckpt(b, r)
