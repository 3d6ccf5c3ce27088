"""The rule catalog: every constraint of Molt that the recipe, the model and the cluster decide.

`ALL_RULES` is the one explicit table (sorted by code): `Rule(code, name, severity, check, kinds)`. A code is an
area prefix plus three digits and is never reused; the name is the bad pattern in kebab case; the check's
docstring is the rule's documentation (`molt-compile rules CODE`). `run_rules` runs the rules that apply to the
recipe's kind, applies the recipe's `ignore:` table and reports ignores that suppressed nothing (IGNORE002).

Areas: ASYNC async queue and IS correction, EST estimators/KL/ref/filtering, BATCH batch arithmetic, PAR FSDP mesh,
MOE experts/R3/MTP, LOSS policy loss, VLLM engines, PLACE GPU counts, MEM memory, OPTIM optimizer/offload, DATA data files,
AGENT agent file, EVAL/CKPT cadences, PACK packing and attention, MODEL model-path info, DEAD settings with no
effect, IGNORE suppressions; Molt 0.2.1's IS gating (IS), KL against the rollout policy (KL),
score centering (SC), length penalties (PEN) and LoRA (LORA). Per-node bin packing is `lower/`'s (PLACE1xx).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from molt_compile.diagnostics import Diagnostic
from molt_compile.rules import (
    async_queue,
    batching,
    centering,
    data_agent,
    data_rows,
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
    shapes,
    vllm,
)
from molt_compile.rules._base import Rule
from molt_compile.source import SourceMap

BOTH = ("rl", "sft")

ALL_RULES: tuple[Rule, ...] = (
    Rule("AGENT001", "missing-agent", "error", data_agent.missing_agent),
    Rule("AGENT002", "agent-file-not-found", "error", data_agent.agent_file_not_found),
    Rule("AGENT003", "agent-file-not-python", "error", data_agent.agent_file_not_python),
    Rule("AGENT004", "agent-file-syntax-error", "error", data_agent.agent_file_syntax_error),
    Rule("AGENT005", "agent-runner-missing", "error", data_agent.agent_runner_missing),
    Rule("AGENT006", "agent-runner-not-a-runner", "error", data_agent.agent_runner_not_a_runner),
    Rule("AGENT007", "chat-agent-without-chat-template", "error", data_agent.chat_agent_without_chat_template),
    Rule("ASYNC001", "async-rollout-without-is-correction", "error", async_queue.async_rollout_without_is_correction),
    Rule("ASYNC002", "is-correction-with-top-p", "error", async_queue.is_correction_with_top_p),
    Rule("ASYNC003", "seq-level-is-without-mask", "error", async_queue.seq_level_is_without_mask),
    Rule("ASYNC004", "stale-rollouts-without-is-correction", "warning",
         async_queue.stale_rollouts_without_is_correction),
    Rule("ASYNC005", "is-threshold-band-excludes-on-policy", "error",
         async_queue.is_threshold_band_excludes_on_policy),
    Rule("ASYNC006", "generate-batch-forces-partial-rollout", "info",
         async_queue.generate_batch_forces_partial_rollout),
    Rule("BATCH001", "train-batch-not-divisible-by-dp", "error", batching.train_batch_not_divisible_by_dp, BOTH),
    Rule("BATCH002", "rollout-samples-fewer-than-dp", "error", batching.rollout_samples_fewer_than_dp),
    Rule("BATCH003", "rollout-samples-below-train-batch", "error", batching.rollout_samples_below_train_batch),
    Rule("BATCH004", "rollout-samples-not-multiple-of-train-batch", "warning",
         batching.rollout_samples_not_multiple_of_train_batch),
    Rule("BATCH005", "force-on-policy-with-several-epochs", "error", batching.force_on_policy_with_several_epochs),
    Rule("BATCH006", "dynamic-batch-without-packing", "error", batching.dynamic_batch_without_packing),
    Rule("BATCH007", "dynamic-batch-smaller-than-dp", "error", batching.dynamic_batch_smaller_than_dp),
    Rule("BATCH008", "rank-samples-not-multiple-of-micro-batch", "warning",
         batching.rank_samples_not_multiple_of_micro_batch),
    Rule("BATCH009", "dataset-smaller-than-batch", "error", batching.dataset_smaller_than_batch, BOTH),
    Rule("CKPT001", "ckpt-cadence-zero", "error", eval_ckpt.ckpt_cadence_zero, BOTH),
    Rule("CKPT002", "run-saves-nothing", "warning", eval_ckpt.run_saves_nothing, BOTH),
    Rule("DATA001", "prompt-probs-count-mismatch", "error", data_agent.prompt_probs_count_mismatch, BOTH),
    Rule("DATA002", "packing-with-vlm", "error", data_agent.packing_with_vlm, BOTH),
    Rule("DATA003", "local-data-file-missing", "warning", data_agent.local_data_file_missing, BOTH),
    Rule("DATA004", "images-on-text-model", "warning", data_agent.images_on_text_model, BOTH),
    Rule("DATA005", "local-model-path-missing", "warning", data_agent.local_model_path_missing, BOTH),
    Rule("DATA006", "chat-rows-without-chat-template", "error", data_rows.chat_rows_without_chat_template),
    Rule("DATA007", "data-key-missing-from-rows", "error", data_rows.data_key_missing_from_rows, BOTH),
    Rule("DATA008", "data-row-malformed", "error", data_rows.data_row_malformed, BOTH),
    Rule("DATA009", "data-prompt-empty", "warning", data_rows.data_prompt_empty, BOTH),
    Rule("DEAD001", "dead-rollout-knob", "warning", dead_knobs.dead_rollout_knob),
    Rule("DEAD002", "freezing-steps-without-critic", "warning", dead_knobs.freezing_steps_without_critic),
    Rule("DEAD003", "discount-unused-by-estimator", "warning", dead_knobs.discount_unused_by_estimator),
    Rule("DEAD004", "adaptive-kl-with-zero-coef", "warning", dead_knobs.adaptive_kl_with_zero_coef),
    Rule("DEAD005", "moe-knob-on-dense-model", "warning", dead_knobs.moe_knob_on_dense_model, BOTH),
    Rule("DEAD006", "sequence-parallel-without-tp", "warning", dead_knobs.sequence_parallel_without_tp, BOTH),
    Rule("DEAD007", "optimizer-knob-unused-by-scheduler", "warning", dead_knobs.optimizer_knob_unused_by_scheduler,
         BOTH),
    Rule("DEAD008", "whiten-unused-by-estimator", "warning", dead_knobs.whiten_unused_by_estimator),
    Rule("DEAD009", "visual-encoder-freeze-on-text-model", "warning",
         dead_knobs.visual_encoder_freeze_on_text_model, BOTH),
    Rule("EST001", "group-estimator-with-single-sample", "error", estimators.group_estimator_with_single_sample),
    Rule("EST002", "gae-without-critic-section", "error", estimators.gae_without_critic_section),
    Rule("EST003", "critic-without-gae", "error", estimators.critic_without_gae),
    Rule("EST004", "distill-without-teacher", "error", estimators.distill_without_teacher),
    Rule("EST005", "distill-with-nonpositive-kl-coef", "error", estimators.distill_with_nonpositive_kl_coef),
    Rule("EST006", "distill-forces-reward-kl", "info", estimators.distill_forces_reward_kl),
    Rule("EST007", "kl-loss-with-k1", "warning", estimators.kl_loss_with_k1),
    Rule("EST008", "kl-reward-with-group-estimator", "warning", estimators.kl_reward_with_group_estimator),
    Rule("EST009", "kl-coef-without-ref", "error", estimators.kl_coef_without_ref),
    Rule("EST010", "ref-without-kl", "warning", estimators.ref_without_kl),
    Rule("EST011", "dynamic-filtering-empty-range", "error", estimators.dynamic_filtering_empty_range),
    Rule("EST012", "dynamic-filtering-with-single-sample", "error", estimators.dynamic_filtering_with_single_sample),
    Rule("EST013", "dynamic-filtering-with-builtin-distill-agent", "error",
         estimators.dynamic_filtering_with_builtin_distill_agent),
    Rule("EVAL001", "eval-cadence-zero", "error", eval_ckpt.eval_cadence_zero, BOTH),
    Rule("EVAL002", "eval-only-without-dataset", "error", eval_ckpt.eval_only_without_dataset),
    Rule("EVAL003", "eval-settings-without-dataset", "warning", eval_ckpt.eval_settings_without_dataset, BOTH),
    Rule("EVAL004", "eval-dataset-never-used", "warning", eval_ckpt.eval_dataset_never_used),
    Rule("IGNORE001", "unknown-code-in-ignore", "warning", ignores.unknown_code_in_ignore, BOTH),
    Rule("IGNORE002", "unused-ignore", "warning", ignores.unused_ignore, BOTH),
    Rule("IGNORE003", "ignore-without-reason", "warning", ignores.ignore_without_reason, BOTH),
    Rule("IS001", "is-threshold-arity", "error", gating.is_threshold_arity),
    Rule("IS002", "is-single-threshold-band", "info", gating.is_single_threshold_band),
    Rule("IS003", "divergence-gating-with-clip-or-geo", "error", gating.divergence_gating_with_clip_or_geo),
    Rule("IS004", "divergence-gating-with-lower-bound", "error", gating.divergence_gating_with_lower_bound),
    Rule("IS005", "gating-without-is", "warning", gating.gating_without_is),
    Rule("KL001", "kl-k1-loss-against-rollout", "error", kl_ref.kl_k1_loss_against_rollout),
    Rule("KL002", "kl-ref-defaults-to-rollout", "info", kl_ref.kl_ref_defaults_to_rollout),
    Rule("KL003", "distill-forces-kl-ref-model", "info", kl_ref.distill_forces_kl_ref_model),
    Rule("KL004", "kl-to-rollout-without-logprobs", "error", kl_ref.kl_to_rollout_without_logprobs),
    Rule("KL005", "kl-reward-against-rollout", "warning", kl_ref.kl_reward_against_rollout),
    Rule("KL006", "kl-reward-with-flash-reinforce", "warning", kl_ref.kl_reward_with_flash_reinforce),
    Rule("LAUNCH001", "slurm-time-format", "error", launch.slurm_time_format, BOTH),
    Rule("LAUNCH002", "ray-runtime-env-shape", "error", launch.ray_runtime_env_shape, BOTH),
    Rule("LAUNCH003", "slurm-option-shape", "error", launch.slurm_option_shape, BOTH),
    Rule("LAUNCH004", "slurm-requeue-needs-resume", "error", launch.slurm_requeue_needs_resume, BOTH),
    Rule("LORA001", "lora-negative-rank", "error", lora.lora_negative_rank, BOTH),
    Rule("LORA002", "lora-target-matches-nothing", "error", lora.lora_target_matches_nothing, BOTH),
    Rule("LORA003", "lora-on-moe-without-targets", "error", lora.lora_on_moe_without_targets, BOTH),
    Rule("LORA004", "lora-on-tied-head", "error", lora.lora_on_tied_head),
    Rule("LORA005", "lora-low-learning-rate", "warning", lora.lora_low_learning_rate, BOTH),
    Rule("LOSS001", "dual-clip-not-above-one", "error", loss.dual_clip_not_above_one),
    Rule("LOSS002", "dual-clip-without-ppo", "error", loss.dual_clip_without_ppo),
    Rule("LOSS003", "cispo-clip-ceiling-below-one", "error", loss.cispo_clip_ceiling_below_one),
    Rule("MEM001", "fsdp-memory-exceeds-gpu", "error", memory.fsdp_memory_exceeds_gpu, BOTH),
    Rule("MEM002", "fsdp-memory-tight", "warning", memory.fsdp_memory_tight, BOTH),
    Rule("MEM003", "engine-weights-exceed-gpu-share", "error", memory.engine_weights_exceed_gpu_share),
    Rule("MEM004", "engine-kv-cache-too-small", "error", memory.engine_kv_cache_too_small),
    Rule("MEM005", "engine-memory-tight", "warning", memory.engine_memory_tight),
    Rule("MEM006", "memory-not-estimated", "info", memory.memory_not_estimated, BOTH),
    Rule("MEM007", "weight-sync-buckets-exceed-engine-headroom", "error",
         memory.weight_sync_buckets_exceed_engine_headroom),
    Rule("MODEL001", "attention-replaced-by-sdpa", "info", packing.attention_replaced_by_sdpa, BOTH),
    Rule("MODEL002", "vlm-context-parallel-without-cp-hook", "error", packing.vlm_context_parallel_without_cp_hook,
         BOTH),
    Rule("MODEL003", "vlm-context-parallel-freezes-visual-encoder", "info",
         packing.vlm_context_parallel_freezes_visual_encoder, BOTH),
    Rule("MODEL004", "unknown-model-arch", "error", packing.unknown_model_arch, BOTH),
    Rule("MOE001", "moe-without-expert-parallel", "error", moe.moe_without_expert_parallel, BOTH),
    Rule("MOE002", "moe-with-tensor-parallel", "error", moe.moe_with_tensor_parallel, BOTH),
    Rule("MOE003", "experts-not-divisible-by-ep", "error", moe.experts_not_divisible_by_ep, BOTH),
    Rule("MOE004", "ep-not-dividing-world", "error", moe.ep_not_dividing_world, BOTH),
    Rule("MOE005", "moe-on-hf-fallback", "error", moe.moe_on_hf_fallback, BOTH),
    Rule("MOE006", "ep-group-crosses-node", "error", moe.ep_group_crosses_node, BOTH),
    Rule("MOE007", "routing-replay-on-dense-model", "error", moe.routing_replay_on_dense_model),
    Rule("MOE008", "routing-replay-with-partial-rollout", "error", moe.routing_replay_with_partial_rollout),
    Rule("MOE009", "routing-replay-with-mtp", "error", moe.routing_replay_with_mtp),
    Rule("MOE010", "mtp-with-prefix-caching", "error", moe.mtp_with_prefix_caching),
    Rule("MOE011", "mtp-without-mtp-head", "error", moe.mtp_without_mtp_head),
    Rule("MOE012", "expert-parallel-on-dense-model", "warning", moe.expert_parallel_on_dense_model, BOTH),
    Rule("MOE013", "routing-replay-forces-prefix-caching", "info", moe.routing_replay_forces_prefix_caching),
    Rule("OPTIM001", "muon-with-optimizer-offload", "error", optim.muon_with_optimizer_offload, BOTH),
    Rule("OPTIM002", "unknown-lr-scheduler", "error", optim.unknown_lr_scheduler, BOTH),
    Rule("OPTIM003", "muon-ns-steps-not-five", "error", optim.muon_ns_steps_not_five, BOTH),
    Rule("OPTIM004", "full-offload-on-one-rank", "error", optim.full_offload_on_one_rank, BOTH),
    Rule("PACK001", "packing-with-unsupported-attention", "error", packing.packing_with_unsupported_attention, BOTH),
    Rule("PACK002", "packing-custom-model-with-flash-attention", "error",
         packing.packing_custom_model_with_flash_attention, BOTH),
    Rule("PACK003", "hf-model-with-automodel-attention", "error", packing.hf_model_with_automodel_attention, BOTH),
    Rule("PACK004", "packing-architecture-without-thd", "error", packing.packing_architecture_without_thd, BOTH),
    Rule("PAR001", "pipeline-parallel-trainer", "error", parallelism.pipeline_parallel_trainer, BOTH),
    Rule("PAR002", "world-not-divisible-by-model-parallel", "error", parallelism.world_not_divisible_by_model_parallel,
         BOTH),
    Rule("PAR003", "model-parallel-group-crosses-node", "warning", parallelism.model_parallel_group_crosses_node,
         BOTH),
    Rule("PAR004", "hf-fallback-with-model-parallel", "error", parallelism.hf_fallback_with_model_parallel, BOTH),
    Rule("PAR005", "critic-with-sequence-parallel", "error", parallelism.critic_with_sequence_parallel),
    Rule("PAR006", "actor-tp-does-not-split-heads", "error", shapes.actor_tp_does_not_split_the_model, BOTH),
    Rule("PEN001", "overlong-penalty-factor-invalid", "error", penalties.overlong_penalty_factor_invalid),
    Rule("PEN002", "overlong-buffer-out-of-range", "error", penalties.overlong_buffer_out_of_range),
    Rule("PEN003", "stop-properly-coef-above-one", "error", penalties.stop_properly_coef_above_one),
    Rule("PEN004", "length-penalties-both-set", "error", penalties.length_penalties_both_set),
    Rule("PEN005", "stop-properly-scale-with-negative-rewards", "warning",
         penalties.stop_properly_scale_with_negative_rewards),
    Rule("PEN006", "overlong-factor-without-buffer", "warning", penalties.overlong_factor_without_buffer),
    Rule("PLACE001", "gpus-exceed-cluster", "error", placement.gpus_exceed_cluster, BOTH),
    Rule("PLACE002", "role-wider-than-cluster", "error", placement.role_wider_than_cluster, BOTH),
    Rule("PLACE003", "colocated-role-size-mismatch", "error", placement.colocated_role_size_mismatch),
    Rule("PLACE006", "unknown-gpu-type", "error", placement.unknown_gpu_type, BOTH),
    Rule("PLACE007", "idle-gpus", "warning", placement.idle_gpus, BOTH),
    Rule("PLACE008", "colocated-engines-exceed-ranks", "error", placement.colocated_engines_exceed_ranks),
    Rule("SC001", "score-centering-top-k-invalid", "error", centering.score_centering_top_k_invalid),
    Rule("SC002", "score-centering-with-several-epochs", "error", centering.score_centering_with_several_epochs),
    Rule("SC003", "score-centering-sampling", "error", centering.score_centering_sampling),
    Rule("SC004", "score-centering-with-tensor-parallel", "error",
         centering.score_centering_with_tensor_parallel),
    Rule("SC005", "score-centering-with-sequence-is", "error", centering.score_centering_with_sequence_is),
    Rule("SC006", "score-centering-with-divergence-gating", "error",
         centering.score_centering_with_divergence_gating),
    Rule("SC007", "score-centering-ratio-drifts", "warning", centering.score_centering_ratio_drifts),
    Rule("VLLM001", "uni-executor-with-tensor-parallel", "error", vllm.uni_executor_with_tensor_parallel),
    Rule("VLLM002", "pipeline-parallel-engine-without-ray", "error", vllm.pipeline_parallel_engine_without_ray),
    Rule("VLLM003", "data-parallel-engine-without-mp", "error", vllm.data_parallel_engine_without_mp),
    Rule("VLLM004", "engine-data-parallel-with-pipeline-parallel", "error",
         vllm.engine_data_parallel_with_pipeline_parallel),
    Rule("VLLM005", "mp-engine-wider-than-node", "error", vllm.mp_engine_wider_than_node),
    Rule("VLLM006", "hf-engine-with-parallel-mesh", "error", vllm.hf_engine_with_parallel_mesh),
    Rule("VLLM007", "max-new-tokens-exceeds-context", "error", vllm.max_new_tokens_exceeds_context),
    Rule("VLLM008", "decode-context-parallel-not-dividing-tp", "error", vllm.decode_context_parallel_not_dividing_tp),
    Rule("VLLM009", "rollout-tp-does-not-split-heads", "error", shapes.rollout_tp_does_not_split_the_model),
    Rule("VLLM010", "logprobs-for-centering-or-kl", "info", vllm.logprobs_for_centering_or_kl),
    Rule("VLLM011", "unknown-moe-backend", "warning", vllm.unknown_moe_backend),
    Rule("VLLM012", "router-balance-without-cache-aware", "warning", vllm.router_balance_without_cache_aware),
)
"""Every rule, sorted by code. PLACE004/PLACE005 are not used: per-node packing and CPUs are lower/'s PLACE1xx."""

RULES_BY_CODE: dict[str, Rule] = {r.code: r for r in ALL_RULES}
UNUSED_IGNORE = "IGNORE002"


def run_rules(recipe, derived, source: SourceMap | None) -> list[Diagnostic]:
    """Run every rule for `recipe.kind`, apply `ignore:` and report ignores that suppressed nothing."""
    source = source if source is not None else SourceMap()
    found: list[Diagnostic] = []
    for rule in ALL_RULES:
        if recipe.kind in rule.kinds and rule.code != UNUSED_IGNORE:
            found.extend(_run(rule, rule.check(recipe, derived, source)))
    ignored = getattr(recipe, "ignore", {}) or {}
    kept, fired = [], set()
    for d in found:
        if d.code in ignored and not d.code.startswith("IGNORE"):
            fired.add(d.code)
        else:
            kept.append(d)
    unused = RULES_BY_CODE[UNUSED_IGNORE]
    kept.extend(_run(unused, unused.check(recipe, derived, source, fired=frozenset(fired))))
    return kept


def _run(rule: Rule, produced: Iterable[Diagnostic]) -> list[Diagnostic]:
    """Materialize one check, stamping the row's name and severity. A crashing check becomes an error diagnostic
    (a compiler bug, reported with the rule's code) instead of a traceback."""
    try:
        return [replace(d, name=rule.name, severity=rule.severity) for d in produced]
    except Exception as exc:  # one broken rule must not hide the others
        return [Diagnostic(code=rule.code, severity="error", name=rule.name,
                           message=f"internal error in rule {rule.code} ({type(exc).__name__}: {exc}); please report",
                           help="this is a compiler bug, not a problem of the recipe")]
