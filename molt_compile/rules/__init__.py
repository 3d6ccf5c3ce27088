"""The rule catalog: every constraint of Molt that the recipe, the model and the cluster decide.

`ALL_RULES` is the one explicit table (sorted by code): `Code(code, name, severity, check, kinds)`, rows of the
catalog of every code (`molt_compile/codes.py`). A code is an
area prefix plus three digits and is never reused; the name is the bad pattern in kebab case; the check's
docstring is the rule's documentation (`molt-compile rules CODE`). `run_rules` runs the rules that apply to the
recipe's kind, applies the recipe's `ignore:` table and reports ignores that suppressed nothing (IGNORE002).

Areas: ASYNC async queue and IS correction, EST estimators/KL/ref/filtering, BATCH batch arithmetic, PAR FSDP mesh,
MOE experts/R3/MTP, LOSS policy loss, VLLM engines, PLACE GPU counts, MEM memory, OPTIM optimizer/offload, DATA data files,
AGENT agent file, EVAL/CKPT cadences, PACK packing and attention, MODEL model-path info, DEAD settings with no
effect, IGNORE suppressions; Molt 0.2.1's IS gating (IS), KL against the rollout policy (KL),
score centering (SC), length penalties (PEN) and LoRA (LORA); SAMP sampling settings. Per-node bin packing is
`lower/`'s (PLACE1xx).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from functools import cache

from molt_compile.codes import BUILTIN, Code
from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.rules import (
    agent_file,
    async_queue,
    batching,
    centering,
    data_rows,
    data_sources,
    dead_knobs,
    estimators,
    eval_ckpt,
    gating,
    ignores,
    kl_ref,
    launch,
    lora,
    loss,
    memory,
    moe,
    optim,
    packing,
    parallelism,
    penalties,
    placement,
    routing,
    sampling,
    shapes,
    vllm,
)
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe

BOTH = ("rl", "sft")

ALL_RULES: tuple[Code, ...] = (
    Code("AGENT001", "missing-agent", "error", agent_file.missing_agent),
    Code("AGENT002", "agent-file-not-found", "error", agent_file.agent_file_not_found),
    Code("AGENT003", "agent-file-not-python", "error", agent_file.agent_file_not_python),
    Code("AGENT004", "agent-file-syntax-error", "error", agent_file.agent_file_syntax_error),
    Code("AGENT005", "agent-runner-missing", "error", agent_file.agent_runner_missing),
    Code("AGENT006", "agent-runner-not-a-runner", "error", agent_file.agent_runner_not_a_runner),
    Code("AGENT007", "chat-agent-without-chat-template", "error", agent_file.chat_agent_without_chat_template),
    Code("ASYNC001", "async-rollout-without-is-correction", "error", async_queue.async_rollout_without_is_correction),
    Code("ASYNC002", "is-correction-with-top-p", "error", async_queue.is_correction_with_top_p),
    Code("ASYNC003", "seq-level-is-without-mask", "error", async_queue.seq_level_is_without_mask),
    Code(
        "ASYNC004", "stale-rollouts-without-is-correction", "warning", async_queue.stale_rollouts_without_is_correction
    ),
    Code("ASYNC005", "is-threshold-band-excludes-on-policy", "error", async_queue.is_threshold_band_excludes_on_policy),
    Code(
        "ASYNC006", "generate-batch-forces-partial-rollout", "info", async_queue.generate_batch_forces_partial_rollout
    ),
    Code("ASYNC007", "alternate-without-colocated-engines", "error", async_queue.alternate_without_colocated_engines),
    Code("ASYNC008", "alternate-without-force-sync", "error", async_queue.alternate_without_force_sync),
    Code("BATCH001", "train-batch-not-divisible-by-dp", "error", batching.train_batch_not_divisible_by_dp, BOTH),
    Code("BATCH002", "rollout-samples-fewer-than-dp", "error", batching.rollout_samples_fewer_than_dp),
    Code("BATCH003", "rollout-samples-below-train-batch", "error", batching.rollout_samples_below_train_batch),
    Code(
        "BATCH004",
        "rollout-samples-not-multiple-of-train-batch",
        "warning",
        batching.rollout_samples_not_multiple_of_train_batch,
    ),
    Code("BATCH005", "force-on-policy-with-several-epochs", "error", batching.force_on_policy_with_several_epochs),
    Code("BATCH006", "dynamic-batch-without-packing", "error", batching.dynamic_batch_without_packing),
    Code("BATCH007", "dynamic-batch-smaller-than-dp", "error", batching.dynamic_batch_smaller_than_dp),
    Code(
        "BATCH008",
        "rank-samples-not-multiple-of-micro-batch",
        "warning",
        batching.rank_samples_not_multiple_of_micro_batch,
    ),
    Code("BATCH009", "dataset-smaller-than-batch", "error", batching.dataset_smaller_than_batch, BOTH),
    Code("CKPT001", "ckpt-cadence-zero", "error", eval_ckpt.ckpt_cadence_zero, BOTH),
    Code("CKPT002", "run-saves-nothing", "warning", eval_ckpt.run_saves_nothing, BOTH),
    Code("CKPT003", "best-metric-without-eval", "error", eval_ckpt.best_metric_without_eval),
    Code("CKPT004", "best-metric-unknown", "error", eval_ckpt.best_metric_unknown),
    Code("CKPT005", "large-job-without-checkpoints", "info", eval_ckpt.large_job_without_checkpoints, BOTH),
    Code("DATA001", "prompt-probs-count-mismatch", "error", data_sources.prompt_probs_count_mismatch, BOTH),
    Code("DATA002", "packing-with-vlm", "error", data_sources.packing_with_vlm, BOTH),
    Code("DATA003", "local-data-file-missing", "warning", data_sources.local_data_file_missing, BOTH),
    Code("DATA004", "images-on-text-model", "error", data_sources.images_on_text_model, BOTH),
    Code("DATA005", "local-model-path-missing", "warning", data_sources.local_model_path_missing, BOTH),
    Code("DATA006", "chat-rows-without-chat-template", "error", data_rows.chat_rows_without_chat_template),
    Code("DATA007", "data-key-missing-from-rows", "error", data_rows.data_key_missing_from_rows, BOTH),
    Code("DATA008", "data-row-malformed", "error", data_rows.data_row_malformed, BOTH),
    Code("DATA009", "data-prompt-empty", "warning", data_rows.data_prompt_empty, BOTH),
    Code("DATA010", "data-counted-at-job-start", "warning", data_rows.data_counted_at_job_start, BOTH),
    Code("DATA011", "data-rows-not-all-scanned", "info", data_rows.data_rows_not_all_scanned, BOTH),
    Code(
        "DATA012",
        "interleave-probs-not-a-distribution",
        "error",
        data_sources.interleave_probs_not_a_distribution,
        BOTH,
    ),
    Code("DEAD001", "dead-rollout-knob", "warning", dead_knobs.dead_rollout_knob),
    Code("DEAD002", "freezing-steps-without-critic", "warning", dead_knobs.freezing_steps_without_critic),
    Code("DEAD003", "discount-unused-by-estimator", "warning", dead_knobs.discount_unused_by_estimator),
    Code("DEAD004", "adaptive-kl-with-zero-coef", "warning", dead_knobs.adaptive_kl_with_zero_coef),
    Code("DEAD005", "moe-knob-on-dense-model", "warning", dead_knobs.moe_knob_on_dense_model, BOTH),
    Code("DEAD006", "sequence-parallel-without-tp", "warning", dead_knobs.sequence_parallel_without_tp, BOTH),
    Code(
        "DEAD007", "optimizer-knob-unused-by-scheduler", "warning", dead_knobs.optimizer_knob_unused_by_scheduler, BOTH
    ),
    Code("DEAD008", "whiten-unused-by-estimator", "warning", dead_knobs.whiten_unused_by_estimator),
    Code(
        "DEAD009",
        "visual-encoder-freeze-on-text-model",
        "warning",
        dead_knobs.visual_encoder_freeze_on_text_model,
        BOTH,
    ),
    Code("EST001", "group-estimator-with-single-sample", "error", estimators.group_estimator_with_single_sample),
    Code("EST002", "gae-without-critic-section", "error", estimators.gae_without_critic_section),
    Code("EST003", "critic-without-gae", "error", estimators.critic_without_gae),
    Code("EST004", "distill-without-teacher", "error", estimators.distill_without_teacher),
    Code("EST005", "distill-with-nonpositive-kl-coef", "error", estimators.distill_with_nonpositive_kl_coef),
    Code("EST006", "distill-forces-reward-kl", "info", estimators.distill_forces_reward_kl),
    Code("EST007", "kl-loss-with-k1", "warning", estimators.kl_loss_with_k1),
    Code("EST008", "kl-reward-with-group-estimator", "warning", estimators.kl_reward_with_group_estimator),
    Code("EST009", "kl-coef-without-ref", "error", estimators.kl_coef_without_ref),
    Code("EST010", "ref-without-kl", "warning", estimators.ref_without_kl),
    Code("EST011", "dynamic-filtering-empty-range", "error", estimators.dynamic_filtering_empty_range),
    Code("EST012", "dynamic-filtering-with-single-sample", "error", estimators.dynamic_filtering_with_single_sample),
    Code(
        "EST013",
        "dynamic-filtering-with-builtin-distill-agent",
        "error",
        estimators.dynamic_filtering_with_builtin_distill_agent,
    ),
    Code("EVAL001", "eval-cadence-zero", "error", eval_ckpt.eval_cadence_zero, BOTH),
    Code("EVAL002", "eval-only-without-dataset", "error", eval_ckpt.eval_only_without_dataset),
    Code("EVAL003", "eval-settings-without-dataset", "warning", eval_ckpt.eval_settings_without_dataset, BOTH),
    Code("EVAL004", "eval-dataset-never-used", "warning", eval_ckpt.eval_dataset_never_used),
    Code("IGNORE001", "unknown-code-in-ignore", "warning", ignores.unknown_code_in_ignore, BOTH),
    Code("IGNORE002", "unused-ignore", "warning", ignores.unused_ignore, BOTH),
    Code("IGNORE003", "ignore-without-reason", "warning", ignores.ignore_without_reason, BOTH),
    Code("IS001", "is-threshold-arity", "error", gating.is_threshold_arity),
    Code("IS002", "is-single-threshold-band", "info", gating.is_single_threshold_band),
    Code("IS003", "divergence-gating-with-clip-or-geo", "error", gating.divergence_gating_with_clip_or_geo),
    Code("IS004", "divergence-gating-with-lower-bound", "error", gating.divergence_gating_with_lower_bound),
    Code("IS005", "gating-without-is", "warning", gating.gating_without_is),
    Code("KL001", "kl-k1-loss-against-rollout", "error", kl_ref.kl_k1_loss_against_rollout),
    Code("KL002", "kl-ref-defaults-to-rollout", "info", kl_ref.kl_ref_defaults_to_rollout),
    Code("KL003", "distill-forces-kl-ref-model", "info", kl_ref.distill_forces_kl_ref_model),
    Code("KL004", "kl-to-rollout-without-logprobs", "error", kl_ref.kl_to_rollout_without_logprobs),
    Code("KL005", "kl-reward-against-rollout", "warning", kl_ref.kl_reward_against_rollout),
    Code("KL006", "kl-reward-with-flash-reinforce", "warning", kl_ref.kl_reward_with_flash_reinforce),
    Code("LAUNCH001", "slurm-time-format", "error", launch.slurm_time_format, BOTH),
    Code("LAUNCH002", "ray-runtime-env-shape", "error", launch.ray_runtime_env_shape, BOTH),
    Code("LAUNCH003", "slurm-option-shape", "error", launch.slurm_option_shape, BOTH),
    Code("LAUNCH004", "slurm-requeue-needs-resume", "error", launch.slurm_requeue_needs_resume, BOTH),
    Code("LAUNCH005", "slurm-output-dir-missing", "warning", launch.slurm_output_dir_missing, BOTH),
    Code("LORA001", "lora-negative-rank", "error", lora.lora_negative_rank, BOTH),
    Code("LORA002", "lora-target-matches-nothing", "error", lora.lora_target_matches_nothing, BOTH),
    Code("LORA003", "lora-on-moe-without-targets", "error", lora.lora_on_moe_without_targets, BOTH),
    Code("LORA004", "lora-on-tied-head", "error", lora.lora_on_tied_head),
    Code("LORA005", "lora-low-learning-rate", "warning", lora.lora_low_learning_rate, BOTH),
    Code("LOSS001", "dual-clip-not-above-one", "error", loss.dual_clip_not_above_one),
    Code("LOSS002", "dual-clip-without-ppo", "error", loss.dual_clip_without_ppo),
    Code("LOSS003", "cispo-clip-ceiling-below-one", "error", loss.cispo_clip_ceiling_below_one),
    Code("MEM001", "fsdp-memory-exceeds-gpu", "error", memory.fsdp_memory_exceeds_gpu, BOTH),
    Code("MEM002", "fsdp-memory-tight", "warning", memory.fsdp_memory_tight, BOTH),
    Code("MEM003", "engine-weights-exceed-gpu-share", "error", memory.engine_weights_exceed_gpu_share),
    Code("MEM004", "engine-kv-cache-too-small", "error", memory.engine_kv_cache_too_small),
    Code("MEM005", "engine-memory-tight", "warning", memory.engine_memory_tight),
    Code("MEM006", "memory-not-estimated", "info", memory.memory_not_estimated, BOTH),
    Code(
        "MEM007",
        "weight-sync-buckets-exceed-engine-headroom",
        "error",
        memory.weight_sync_buckets_exceed_engine_headroom,
    ),
    Code("MEM008", "fsdp-host-memory-exceeds-node", "error", memory.fsdp_host_memory_exceeds_node, BOTH),
    Code("MODEL001", "attention-replaced-by-sdpa", "info", packing.attention_replaced_by_sdpa, BOTH),
    Code(
        "MODEL002", "vlm-context-parallel-without-cp-hook", "error", packing.vlm_context_parallel_without_cp_hook, BOTH
    ),
    Code(
        "MODEL003",
        "vlm-context-parallel-freezes-visual-encoder",
        "info",
        packing.vlm_context_parallel_freezes_visual_encoder,
        BOTH,
    ),
    Code("MODEL004", "unknown-model-arch", "error", packing.unknown_model_arch, BOTH),
    Code("MODEL005", "model-shape-unknown", "warning", packing.model_shape_unknown, BOTH),
    Code("MODEL006", "automodel-asked-runs-on-hf", "warning", parallelism.automodel_asked_runs_on_hf, BOTH),
    Code("MOE001", "moe-without-expert-parallel", "error", moe.moe_without_expert_parallel, BOTH),
    Code("MOE002", "moe-with-tensor-parallel", "error", moe.moe_with_tensor_parallel, BOTH),
    Code("MOE003", "experts-not-divisible-by-ep", "error", moe.experts_not_divisible_by_ep, BOTH),
    Code("MOE004", "ep-not-dividing-world", "error", moe.ep_not_dividing_world, BOTH),
    Code("MOE005", "moe-on-hf-fallback", "error", moe.moe_on_hf_fallback, BOTH),
    Code("MOE006", "ep-group-crosses-node", "error", moe.ep_group_crosses_node, BOTH),
    Code("MOE007", "routing-replay-on-dense-model", "error", routing.routing_replay_on_dense_model),
    Code("MOE008", "routing-replay-with-partial-rollout", "error", routing.routing_replay_with_partial_rollout),
    Code("MOE009", "routing-replay-with-mtp", "error", routing.routing_replay_with_mtp),
    Code("MOE010", "mtp-with-prefix-caching", "error", routing.mtp_with_prefix_caching),
    Code("MOE011", "mtp-without-mtp-head", "error", routing.mtp_without_mtp_head),
    Code("MOE012", "expert-parallel-on-dense-model", "warning", moe.expert_parallel_on_dense_model, BOTH),
    Code("MOE013", "routing-replay-forces-prefix-caching", "info", routing.routing_replay_forces_prefix_caching),
    Code("MOE014", "tied-embeddings-on-automodel", "error", moe.tied_embeddings_on_automodel, BOTH),
    Code("MOE015", "dispatcher-in-env", "error", moe.dispatcher_in_env, BOTH),
    Code("MOE016", "routing-replay-with-pipeline-parallel", "error", routing.routing_replay_with_pipeline_parallel),
    Code(
        "MOE017",
        "routing-replay-with-decode-context-parallel",
        "error",
        routing.routing_replay_with_decode_context_parallel,
    ),
    Code("MOE018", "routing-replay-on-compiled-cpu-engine", "error", routing.routing_replay_on_compiled_cpu_engine),
    Code("OPTIM001", "muon-with-optimizer-offload", "error", optim.muon_with_optimizer_offload, BOTH),
    Code("OPTIM002", "unknown-lr-scheduler", "error", optim.unknown_lr_scheduler, BOTH),
    Code("OPTIM003", "muon-ns-steps-not-five", "error", optim.muon_ns_steps_not_five, BOTH),
    Code("OPTIM004", "full-offload-on-one-rank", "error", optim.full_offload_on_one_rank, BOTH),
    Code("PACK001", "packing-with-unsupported-attention", "error", packing.packing_with_unsupported_attention, BOTH),
    Code(
        "PACK002",
        "packing-custom-model-with-flash-attention",
        "error",
        packing.packing_custom_model_with_flash_attention,
        BOTH,
    ),
    Code("PACK003", "hf-model-with-automodel-attention", "error", packing.hf_model_with_automodel_attention, BOTH),
    Code("PACK004", "packing-architecture-without-thd", "error", packing.packing_architecture_without_thd, BOTH),
    Code("PACK005", "tilelang-without-dsa-kernels", "error", packing.tilelang_without_dsa_kernels, BOTH),
    Code("PACK006", "tilelang-not-bf16", "error", packing.tilelang_not_bf16, BOTH),
    Code("PAR001", "pipeline-parallel-trainer", "error", parallelism.pipeline_parallel_trainer, BOTH),
    Code(
        "PAR002",
        "world-not-divisible-by-model-parallel",
        "error",
        parallelism.world_not_divisible_by_model_parallel,
        BOTH,
    ),
    Code("PAR003", "model-parallel-group-crosses-node", "warning", parallelism.model_parallel_group_crosses_node, BOTH),
    Code("PAR004", "hf-fallback-with-model-parallel", "error", parallelism.hf_fallback_with_model_parallel, BOTH),
    Code("PAR005", "critic-with-sequence-parallel", "error", parallelism.critic_with_sequence_parallel),
    Code("PAR006", "actor-tp-does-not-split-heads", "error", shapes.actor_tp_does_not_split_the_model, BOTH),
    Code("PAR007", "dp-replicate-does-not-split-dp", "error", parallelism.dp_replicate_does_not_split_dp, BOTH),
    Code("PAR008", "tensor-parallel-without-a-plan", "error", parallelism.tensor_parallel_without_a_plan, BOTH),
    Code("PEN001", "overlong-penalty-factor-invalid", "error", penalties.overlong_penalty_factor_invalid),
    Code("PEN002", "overlong-buffer-out-of-range", "error", penalties.overlong_buffer_out_of_range),
    Code("PEN003", "stop-properly-coef-above-one", "error", penalties.stop_properly_coef_above_one),
    Code("PEN004", "length-penalties-both-set", "error", penalties.length_penalties_both_set),
    Code(
        "PEN005",
        "stop-properly-scale-with-negative-rewards",
        "warning",
        penalties.stop_properly_scale_with_negative_rewards,
    ),
    Code("PEN006", "overlong-factor-without-buffer", "warning", penalties.overlong_factor_without_buffer),
    Code("PLACE001", "gpus-exceed-cluster", "error", placement.gpus_exceed_cluster, BOTH),
    Code("PLACE002", "role-wider-than-cluster", "error", placement.role_wider_than_cluster, BOTH),
    Code("PLACE003", "colocated-role-size-mismatch", "error", placement.colocated_role_size_mismatch),
    Code("PLACE006", "unknown-gpu-type", "error", placement.unknown_gpu_type, BOTH),
    Code("PLACE007", "idle-gpus", "warning", placement.idle_gpus, BOTH),
    Code("PLACE008", "colocated-engines-exceed-ranks", "error", placement.colocated_engines_exceed_ranks),
    Code("SAMP001", "min-new-tokens-beyond-cap", "error", sampling.min_new_tokens_beyond_cap),
    Code("SAMP002", "min-new-tokens-in-training", "warning", sampling.min_new_tokens_in_training),
    Code("SC001", "score-centering-top-k-invalid", "error", centering.score_centering_top_k_invalid),
    Code("SC002", "score-centering-with-several-epochs", "error", centering.score_centering_with_several_epochs),
    Code("SC003", "score-centering-sampling", "error", centering.score_centering_sampling),
    Code("SC004", "score-centering-with-tensor-parallel", "error", centering.score_centering_with_tensor_parallel),
    Code("SC005", "score-centering-with-sequence-is", "error", centering.score_centering_with_sequence_is),
    Code("SC006", "score-centering-with-divergence-gating", "error", centering.score_centering_with_divergence_gating),
    Code("SC007", "score-centering-ratio-drifts", "warning", centering.score_centering_ratio_drifts),
    Code("VLLM001", "uni-executor-with-tensor-parallel", "error", vllm.uni_executor_with_tensor_parallel),
    Code("VLLM002", "pipeline-parallel-engine-without-ray", "error", vllm.pipeline_parallel_engine_without_ray),
    Code("VLLM003", "data-parallel-engine-without-mp", "error", vllm.data_parallel_engine_without_mp),
    Code(
        "VLLM004",
        "engine-data-parallel-with-pipeline-parallel",
        "error",
        vllm.engine_data_parallel_with_pipeline_parallel,
    ),
    Code("VLLM005", "mp-engine-wider-than-node", "error", vllm.mp_engine_wider_than_node),
    Code("VLLM006", "hf-engine-with-parallel-mesh", "error", vllm.hf_engine_with_parallel_mesh),
    Code("VLLM007", "max-new-tokens-exceeds-context", "error", vllm.max_new_tokens_exceeds_context),
    Code("VLLM008", "decode-context-parallel-not-dividing-tp", "error", vllm.decode_context_parallel_not_dividing_tp),
    Code("VLLM009", "rollout-tp-does-not-split-heads", "error", shapes.rollout_tp_does_not_split_the_model),
    Code("VLLM010", "logprobs-for-centering-or-kl", "info", vllm.logprobs_for_centering_or_kl),
    Code("VLLM011", "unknown-moe-backend", "warning", vllm.unknown_moe_backend),
    Code("VLLM012", "router-balance-without-cache-aware", "warning", vllm.router_balance_without_cache_aware),
    Code("VLLM013", "hf-engine-on-hybrid-model", "error", vllm.hf_engine_on_hybrid_model),
    Code("VLLM014", "omni-vision-tower-not-synced", "error", vllm.omni_vision_tower_not_synced),
    Code("VLLM015", "max-len-beyond-model-positions", "error", shapes.max_len_beyond_model_positions),
)
"""Every rule, sorted by code. PLACE004/PLACE005 are not used: per-node packing and CPUs are lower/'s PLACE1xx."""

RULES_BY_CODE: dict[str, Code] = {r.code: r for r in ALL_RULES}


@cache
def catalog() -> dict[str, Code]:
    """Every code, sorted: the builtin ones (`codes.BUILTIN`) and the rule table above."""
    rows: list[Code] = [*BUILTIN.values(), *ALL_RULES]
    return {c.code: c for c in sorted(rows, key=lambda c: c.code)}


UNKNOWN_IGNORE, UNUSED_IGNORE = "IGNORE001", "IGNORE002"
KNOWN_CODES = frozenset(RULES_BY_CODE)
"""The rule codes an `ignore:` may name (the ignore checks take them from here: they cannot import this table)."""


def run_rules(recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap | None) -> list[Diagnostic]:
    """Run every rule for `recipe.kind`, apply `ignore:` and report ignores that suppressed nothing."""
    source = source if source is not None else SourceMap()
    found: list[Diagnostic] = []
    for rule in ALL_RULES:
        if recipe.kind in rule.kinds and rule.code != UNUSED_IGNORE:
            codes = {"known": KNOWN_CODES} if rule.code == UNKNOWN_IGNORE else {}
            found.extend(_run(rule, rule.findings(recipe, derived, source, **codes)))
    ignored = getattr(recipe, "ignore", {}) or {}
    kept, fired = [], set()
    for d in found:
        if d.code in ignored and not d.code.startswith("IGNORE"):
            fired.add(d.code)
        else:
            kept.append(d)
    unused = RULES_BY_CODE[UNUSED_IGNORE]
    kept.extend(_run(unused, unused.findings(recipe, derived, source, known=KNOWN_CODES, fired=frozenset(fired))))
    return kept


def _run(rule: Code, produced: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Materialize one check, stamping the row's code, name and severity. A crashing check becomes an error diagnostic
    (a compiler bug, reported with the rule's code) instead of a traceback."""
    try:
        return [replace(d, code=rule.code, name=rule.name, severity=rule.severity) for d in produced]
    except Exception as exc:  # one broken rule must not hide the others
        broken = replace(rule, severity="error")
        return [
            broken.diagnostic(
                f"internal error in rule {rule.code} ({type(exc).__name__}: {exc}); please report",
                help="this is a compiler bug, not a problem of the recipe",
            )
        ]
