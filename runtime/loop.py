"""The RL loop: asynchronous rollout, FSDP2 training and weight sync, executing one compiled plan.

    python -m runtime PLAN.json

Algorithm, exactly (`reference/molt_rules.md` §4; the plan decides every number):

- A generator actor streams prompt groups (n rollouts each) through agent runners and the rollout engines, filters
  them, and puts one `RolloutBatch` per step on `rollout_queue`. Before each batch it takes a token from
  `rollout_slots`, which holds `queue.size` tokens: generation is never more than `queue.size` batches ahead.
- This loop takes a batch, hands a slot back (before training, so the next batch is generated with the current,
  soon stale, weights; with `force_sync` only after the weight sync, so there is no overlap), computes π_old (and
  π_ref) with the FSDP group (not when the plan has no old-logprob pass: force_on_policy with KL off, where the
  training forward's detached log-probs are π_old, Molt B28), the values V_old with the critic group (gae:
  runtime/critic.py), per-token KL, clipped rewards, advantages and returns (runtime.algo), trains the critic on
  the returns, trains `max_epochs` passes in optimizer windows of micro_batch × grad_accum rows (force_on_policy:
  one window, the whole batch; micro-batches of fixed rows or of a token budget, padded or
  packed: runtime/trainer.py) with the global token-mean loss and the IS correction against the
  engines' logprobs, then streams the weights to every engine under the engine lock (engines paused, buckets
  broadcast from trainer rank 0 over the weight-sync group, resumed), checks them with a probe (engine vs trainer
  logprobs on a fixed sequence), logs, evaluates when the generator sends an eval round, and checkpoints.
- Every wait goes through the supervisor (runtime/supervisor.py): a dead actor (engine, trainer rank, generator,
  queue, lock) or a phase past `train.stall_timeout_s` ends the run with `RunAborted` (actor, phase, likely recipe
  key, prompt books); after SIGINT/SIGTERM the current phase gets `train.stop_timeout_s`. Every exit path tears down
  what was started (`Started`).
- Exact resume: each checkpoint records the prompt books (`Books`: the positions of the seeded data order trained or
  dropped); a resumed generator skips exactly those, so the prompts in flight at the save are trained after it, and
  the records logged after the save (metrics.jsonl, prompts.jsonl) are dropped before they are logged again.
- Not done here: what `schemas/capabilities.py` lists (the compiler refuses plans that ask for it, CAP001).

The driver process is the controller and the trainer loop (the plan's `controller` and `trainer` roles); what it
starts, and with which options, is runtime/roles.py.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
import torch
from ray.util.queue import Queue

from runtime import algo, ckpt
from runtime.books import Books
from runtime.critic import critic_metrics, start_critic_group
from runtime.datasource import derive_at_start
from runtime.engines import engines_ready
from runtime.experience import (
    Experience,
    check_image_alignment,
    image_token_count,
    pad_batch_to_multiple,
    partial_rollout_metrics,
)
from runtime.generator import EngineLock, Generator
from runtime.messages import EndOfStream, EvalResult, RolloutBatch
from runtime.metrics import MetricsSink, drop_records_after
from runtime.plot import plot_run
from runtime.reference import start_reference_group
from runtime.roles import (
    create_placement_groups,
    probe_sequence,
    role_options,
    start_fsdp_group,
    start_rollout,
    start_runners,
)
from runtime.supervisor import RunAborted, RunStopped, Started, StopFlag, Supervisor
from runtime.trainer import fill_for_training, start_trainer_group
from runtime.weight_sync_driver import WeightSyncLink
from schemas.plan import Plan

REQUEUE_EXIT_STATUS = 75
"""Exit status of `python -m runtime` after SIGUSR1: checkpointed, run me again (EX_TEMPFAIL; the Slurm script
requeues the job on it, molt_compile/slurm.py holds the same number)."""


@dataclass
class RunResult:
    status: str                     # "finished" | "stopped" | "requeue" (checkpointed on SIGUSR1)
    step: int
    accounting: dict[str, int]
    last_checkpoint: str | None
    metrics_path: Path
    plot_path: Path | None = None
    timeline: list[dict] = field(default_factory=list)


def run(plan: Plan, *, live: bool = True) -> RunResult:
    """Run the plan; raises `RunAborted` (actor, phase, likely key, accounting) when an actor dies or a phase stalls.
    Values the compiler deferred to the job's start (DATA010: it could not count the prompts) are derived first."""
    plan = derive_at_start(plan)
    rl = plan.rl
    stop = StopFlag()
    sup = Supervisor(rl.supervisor, stop)
    started = Started()
    try:
        return _run(plan, live, sup, started)
    except RunStopped as exc:  # stopped during start-up (the loop handles its own phases)
        print(f"{exc}; tearing the run down", flush=True)
        acc = settle_accounting(started.generator_accounting(rl.supervisor.stop_timeout_s), 0)
        return RunResult("stopped", 0, acc, None, Path(rl.logging.out_dir) / "metrics.jsonl")
    finally:
        started.teardown(rl.supervisor.stop_timeout_s)
        stop.restore()


def _run(plan: Plan, live: bool, sup: Supervisor, started: Started) -> RunResult:
    rl = plan.rl
    if rl.trainer is None:  # eval.only: no trainer in the plan, one eval round
        from runtime.eval_only import run_eval_only

        return run_eval_only(plan, sup, started, live=live)
    # ------------------------------------------------------------------------------------------------ setup
    ckpt.check_dir(rl.ckpt.dir)  # unwritable or full: now, not at the first save hours in
    skipped: list[str] = []
    resume_from = ckpt.latest(rl.ckpt.dir, skipped) if rl.ckpt.resume else None
    for line in skipped:
        print(f"resume: skipped checkpoint {line}", flush=True)
    out_dir = Path(rl.logging.out_dir)
    if resume_from is not None:  # the steps logged after the save are trained again: their records go
        for name in ("metrics.jsonl", PROMPTS_LOG):
            drop_records_after(out_dir / name, resume_from[1]["step"])
    sink = MetricsSink(out_dir, Path(rl.logging.tensorboard_dir) if rl.logging.tensorboard_dir
                       else None, rl.schedule.total_steps, live, append=resume_from is not None,
                       wandb=rl.logging.wandb, config=plan.recipe, engine=rl.engines.kind)
    started.sink = sink
    prompts_log = (out_dir / PROMPTS_LOG).open("a" if resume_from is not None else "w")
    started.files.append(prompts_log)
    with sup.phase("placement groups", "the Ray cluster", "cluster"):
        pgs = create_placement_groups(plan, sup)
    started.pgs = list(pgs.values())
    # The engines load their model while the trainer (and critic, reference) ranks build theirs: at scale both take
    # minutes. A watched engine that dies meanwhile ends the run by name.
    engines, router = start_rollout(plan, pgs, sup, wait=False)
    started.handles += engines
    for i, e in enumerate(engines):
        sup.watch(f"rollout.engine[{i}]", e, "weights_version", "rollout.engine")
    trainer = start_fsdp_group(start_trainer_group, plan, "actor", rl.trainer.world, "trainer", pgs, sup, started)
    critic = separate_ref = None
    if rl.critic is not None:
        critic = start_fsdp_group(start_critic_group, plan, "critic", rl.critic.world, "critic", pgs, sup, started)
    if rl.ref is not None and not rl.ref.colocated:
        separate_ref = start_fsdp_group(start_reference_group, plan, "ref", rl.ref.world, "reference", pgs, sup,
                                        started)
    with sup.phase("engine start-up", "rollout.engine", "rollout"):
        sup.get(engines_ready(engines))
    step, kl_coef, books = 0, rl.algo.kl.coef, Books()
    last_ckpt = None
    if resume_from is not None:
        last_ckpt, state = str(resume_from[0]), resume_from[1]
        with sup.phase("checkpoint load", "actor", "ckpt.resume"):
            trainer.load_checkpoint(last_ckpt)
            if critic is not None:
                critic.load_checkpoint(str(Path(last_ckpt) / ckpt.CRITIC_DIR))
        step, kl_coef, books = state["step"], state["kl_coef"], Books.from_state(state)
        print(f"resumed from {last_ckpt} at step {step}", flush=True)
    kl_ctl = algo.make_kl_controller(kl_coef, rl.algo.kl.target, rl.algo.kl.horizon)
    probe_ids = probe_sequence(plan)
    link = WeightSyncLink(rl.weight_sync, rl.engines.dtype, trainer, engines, rl.weight_sync.check_unassigned,
                          get=sup.get)
    with sup.phase("weight-sync group", "trainer rank 0 and the engines", "rollout.engine"):
        link.connect()
        if step > 0:  # resumed weights must reach the engines before the first rollout
            sync_weights(link, trainer, engines, None, probe_ids, step, sup)

    # Depth-Q pipeline: the generator may have at most Q batches produced and not yet taken by this loop.
    # Each slot token carries the trainer's latest step (the generator uses it for eval timing).
    queue_size = rl.queue.size
    rollout_queue = Queue(maxsize=queue_size, actor_options=role_options(plan, "queue.rollout"))
    rollout_slots = Queue(maxsize=queue_size, actor_options=role_options(plan, "queue.slots"))
    started.queues += [rollout_queue, rollout_slots]
    for name, q in (("queue.rollout", rollout_queue), ("queue.slots", rollout_slots)):
        sup.watch(name, q.actor, "qsize", "train.async.queue_size")
    for _ in range(queue_size):
        rollout_slots.put(step)
    lock = EngineLock.options(**role_options(plan, "lock")).remote()
    started.handles.append(lock)
    sup.watch("lock", lock, "held", "train.async.partial_rollout")
    runners = start_runners(plan, router)
    started.handles += runners
    with sup.phase("agent runner start-up", "runner", "agent.path"):
        sup.get([r.pid.remote() for r in runners])  # an agent file that fails to import stops the run here, clearly
    generator = ray.remote(Generator).options(**role_options(plan, "generator")).remote(
        plan.rl, runners, rollout_queue, rollout_slots, lock)
    started.handles.append(generator)
    started.generator = generator
    generator_done = generator.run.remote(step, books.done_positions(), books.trained, dict(books.dropped))
    sup.watch_call("generator", generator, generator_done, "agent")
    accounting: dict[str, int] = {}
    timeline: list[dict] = []
    status = "finished"
    last_eval_step = -1
    best = (ckpt.best_record(rl.ckpt.dir) or {}).get("best_metric") if resume_from is not None else None
    last_ckpt_step = step  # the step last saved (a requeue saves the current one unless it is saved)
    last_save_s: float | None = None  # how long this run's last save took (does one fit after SIGTERM?)
    step_start = time.time()
    sink.status(f"step {step}: waiting for the first rollout batch")
    started.books = books

    # ------------------------------------------------------------------------------------------------ loop
    try:
        while True:
            wait_start = time.time()
            with sup.phase("waiting for a rollout batch", "generator", "rollout / agent"):
                msg = sup.next_message(rollout_queue)
            actor_idle_wait = time.time() - wait_start
            match msg:
                case None:  # stop requested (SIGUSR1: checkpoint, for a requeue; SIGINT/SIGTERM: when it fits)
                    status = "requeue" if sup.stop.requeue else "stopped"
                    with sup.phase("stopping the generator", "generator", "agent"):
                        sup.unwatch("generator")
                        accounting = sup.get(generator.stop.remote(), timeout=rl.supervisor.stop_timeout_s)
                    if step > 0 and step != last_ckpt_step and (
                            sup.stop.requeue or save_fits(rl, last_save_s, time.monotonic() - sup.stop.at)):
                        with sup.phase("checkpoint save", "actor", "ckpt.dir"):
                            last_ckpt = save_checkpoint(trainer, critic, rl, step, kl_ctl.value, books)
                        why = "for the requeue" if sup.stop.requeue else "before stopping"
                        print(f"checkpointed step {step} {why}: {last_ckpt}", flush=True)
                    break
                case EndOfStream():
                    accounting = msg.accounting
                    if msg.reason == "error":  # the generator raised: its error ends the run, by name
                        with sup.phase("waiting for a rollout batch", "generator", "agent"):
                            sup.get(generator_done)
                    break
                case EvalResult():
                    rollout_slots.put(step)
                    sink.log(step, msg.metrics)
                    last_eval_step = step
                    best = ckpt.keep_best(best, msg.metrics, rl.ckpt, trainer, critic, sup,
                                          {"step": step, "kl_coef": kl_ctl.value, "prompts": books.state()})
                    continue
                case RolloutBatch():
                    pass
            books.seen(msg)
            timeline.append({"batch": len(timeline), "slot_acquired_at": msg.slot_acquired_at,
                             "dequeued_at": wait_start + actor_idle_wait, "policy_version": msg.policy_version})
            if not rl.queue.force_sync:
                rollout_slots.put(step)  # the next batch may start now, with the weights of this step
            queue_depth = rollout_queue.qsize()

            # --- make experience: π_old, π_ref, V_old, KL, rewards, advantages and returns ---
            t0 = time.time()
            with sup.phase("log-probs (π_old, π_ref)", "actor", "actor.micro_batch_size"):
                batch: Experience = sup.get(msg.experience)
                real = batch.batch_size
                padded = pad_batch_to_multiple(batch, rl.trainer.row_multiple)
                padded_ref = ray.put(padded)
                old = ref = None  # no old-logprob pass (force_on_policy, KL off: B28): the training forward is π_old
                if rl.trainer.old_logprob_pass:
                    old, ref = trainer.forward_logprobs(padded_ref)  # ref: a colocated reference's, same ranks
                if separate_ref is not None:
                    ref = separate_ref.forward_logprobs(padded_ref)
            if rl.algo.kl.ref == "rollout" and rl.algo.kl.coef > 0:
                ref = padded.rollout_log_probs  # KL against the rollout policy: the engine's log-probs (Molt 0.2.1)
            values = None
            if critic is not None:
                with sup.phase("values (V_old)", "critic", "critic.micro_batch_size"):
                    values = critic.values(padded_ref)
            mask = batch.action_mask
            kl = algo.kl_estimate(old[:real], ref[:real], rl.algo.kl.estimator, mask,
                                  ref=rl.algo.kl.ref) if ref is not None else None
            shaping = LengthShaping(rl.algo, batch)
            rewards = algo.prepare_rewards(rl.algo.estimator, batch.rewards, batch.rollout_ids.tolist(),
                                           batch.group_ids.tolist(), tuple(rl.algo.reward_clip), shape=shaping.shape)
            adv = algo.compute_advantages(
                rl.algo.estimator, rewards, mask, kl=None if rl.algo.kl.use_loss else kl, kl_coef=kl_ctl.value,
                gamma=rl.algo.gamma, lam=rl.algo.lam, values=values[:real] if values is not None else None,
                whiten_advantages=rl.algo.whiten)
            pad_rows = padded.batch_size - real
            train_batch = fill_for_training(padded, old, ref, _pad_rows(adv.advantages, pad_rows),
                                            _pad_rows(adv.returns, pad_rows), values)
            make_experience_s = time.time() - t0

            # --- critic step (gae), then the policy step on the FSDP group (none while the critic warms up) ---
            t0 = time.time()
            train_ref = ray.put(train_batch)
            critic_stats = {}
            if critic is not None:
                with sup.phase("critic step", "critic", "critic"):
                    critic_stats = critic.train(train_ref)
            critic_train_s = time.time() - t0
            t0 = time.time()
            actor_frozen = step < rl.trainer.freezing_steps
            train_stats = {}
            if not actor_frozen:
                with sup.phase("policy step", "actor", "actor"):
                    train_stats = trainer.train(train_ref, kl_ctl.value)
            policy_train_s = time.time() - t0
            step += 1
            books.trained_batch(msg)
            prompts_log.write(json.dumps({"step": step, "prompts": sorted(msg.prompt_positions)}) + "\n")
            prompts_log.flush()

            # --- weight sync to every engine, under the engine lock, then the probe (a frozen actor: nothing new) ---
            sync_stats = {}
            if not actor_frozen:
                with sup.phase("weight sync", "trainer rank 0 and the engines", "rollout.engine"):
                    sync_stats = sync_weights(link, trainer, engines, lock, probe_ids, step, sup)
            if rl.queue.force_sync:
                rollout_slots.put(step)
            mean_kl = float(algo.masked_mean(kl, mask)) if kl is not None else 0.0
            kl_ctl.update(mean_kl, real)

            # --- metrics, checkpoint ---
            metrics = {
                **msg.metrics, **batch_metrics(batch, adv.advantages, None if old is None else old[:real]),
                **image_metrics(batch, rl.model.path), **partial_rollout_metrics(batch, step - 1),
                **{f"train/{k}": v for k, v in train_stats.items()}, **sync_stats,
                **{f"critic/{k}": v for k, v in critic_stats.items()}, **critic_metrics(values, adv.returns, batch),
                "train/kl": mean_kl, "train/kl_coef": kl_ctl.value,
                "policy_version": float(msg.policy_version), "staleness": float(step - 1 - msg.policy_version),
                "queue/size": float(queue_size), "queue/depth": float(queue_depth),
                "timing/generation": msg.generation_s, "timing/vllm_idle_wait": msg.vllm_idle_wait_s,
                "timing/actor_idle_wait": actor_idle_wait, "timing/make_experience": make_experience_s,
                "timing/policy_train": policy_train_s, "prompts/trained": float(books.trained),
                **shaping.metrics, "train/actor_frozen": float(actor_frozen),
            }
            if critic is not None:
                metrics["timing/critic_train"] = critic_train_s
            if rl.schedule.ckpt_every and step % rl.schedule.ckpt_every == 0:
                t0 = time.time()
                with sup.phase("checkpoint save", "actor", "ckpt.dir"):
                    last_ckpt = save_checkpoint(trainer, critic, rl, step, kl_ctl.value, books)
                last_ckpt_step = step
                metrics["timing/ckpt"] = last_save_s = time.time() - t0
            metrics["timing/step_total"] = time.time() - step_start
            step_start = time.time()
            if step % rl.schedule.log_every == 0:
                sink.log(step, metrics)
    except RunStopped as exc:
        print(f"{exc}; tearing the run down", flush=True)
        status = "stopped"
        accounting = started.generator_accounting(rl.supervisor.stop_timeout_s)
    except RunAborted as exc:
        accounting = started.generator_accounting(min(rl.supervisor.stop_timeout_s, 10.0))
        exc.with_accounting(settle_accounting(accounting, books.trained))
        print(f"run aborted: {exc}", file=sys.stderr, flush=True)
        raise

    # ------------------------------------------------------------------------------------------------ teardown
    sup.unwatch("generator")
    accounting = settle_accounting(accounting, books.trained)
    if status == "finished":
        with sup.phase("end of the generator", "generator", "agent"):
            sup.get(generator_done)
            if rl.eval.enabled and rl.eval.every and step > 0 and last_eval_step != step:
                final_eval = sup.get(generator.evaluate.remote())  # the final weights are evaluated too
                sink.log(step, final_eval)
                ckpt.keep_best(best, final_eval, rl.ckpt, trainer, critic, sup,
                               {"step": step, "kl_coef": kl_ctl.value, "prompts": books.state()})
    sink.close()
    started.sink = None
    if status == "finished" and rl.ckpt.final_save:
        with sup.phase("HF export", "actor", "ckpt.hf_dir"):
            trainer.export_hf(rl.ckpt.hf_dir)
    plot = plot_run(sink.path, out_dir / "metrics.png", f"{plan.name} ({plan.fingerprint[:12]})")
    return RunResult(status, step, accounting, last_ckpt, sink.path, plot, timeline)


PROMPTS_LOG = "prompts.jsonl"
"""One line per trained step: `{"step": s, "prompts": [positions]}`, the positions (in the seeded data order of
runtime/generator.py) of the prompts trained at that step: what an exact resume is checked against."""


# ---------------------------------------------------------------------------------------------------- steps
class LengthShaping:
    """The plan's length penalty (DAPO overlong or ProRL stop-properly) on the merged rewards, before the clip; its
    mean R' − R is logged as `train/overlong_penalty` or `train/stop_properly_penalty`."""

    def __init__(self, algo_plan, batch: Experience):
        self.a, self.batch, self.metrics = algo_plan, batch, {}
        on = algo_plan.overlong_buffer_len is not None or algo_plan.stop_properly_penalty_coef is not None
        self.shape = self._shape if on else None

    def _shape(self, merged) -> torch.Tensor:
        from runtime.algo import penalties

        a, b, n = self.a, self.batch, merged.rewards.numel()
        if a.overlong_buffer_len is not None:
            peak = penalties.peak_per_rollout(b.attention_mask.sum(-1), merged.sample_to_rollout, n)
            shaped, delta = penalties.overlong_penalty(merged.rewards, peak, buffer_len=a.overlong_buffer_len,
                                                       factor=a.overlong_penalty_factor, max_len=a.overlong_max_len)
            name = "train/overlong_penalty"
        else:
            trunc = penalties.truncated_per_rollout(b.truncated, merged.sample_to_rollout, n)
            shaped, delta = penalties.stop_properly_penalty(merged.rewards, trunc, coef=a.stop_properly_penalty_coef)
            name = "train/stop_properly_penalty"
        self.metrics[name] = float(delta.mean()) if n else 0.0
        return shaped


def sync_weights(link: WeightSyncLink, trainer, engines, lock, probe_ids: list[int], version: int,
                 sup: Supervisor) -> dict[str, float]:
    """Stream the weights to every engine (paused around the update, `runtime.weight_sync`); then the probe.

    `lock` is None only before the generator exists (resume), when nothing can be generating.
    """
    t0 = time.time()
    if lock is not None:
        with sup.phase("weight sync: waiting for the engine lock", "generator (holds the engine lock)",
                       "agent.episode_timeout_s"):
            sup.get(lock.acquire.remote())
    t1 = time.time()
    try:
        sup.get([e.pause.remote() for e in engines])
        stats = link.sync(version)
        sup.get([e.resume.remote() for e in engines])
    finally:
        if lock is not None:
            ray.get(lock.release.remote(), timeout=sup.bounds.stop_timeout_s)
    t2 = time.time()
    trainer_lp = torch.tensor(trainer.probe_logprobs(probe_ids))
    engine_lp = [torch.tensor(lp) for lp in sup.get([e.score.remote(probe_ids) for e in engines])]
    diffs = torch.stack([(lp - trainer_lp).abs() for lp in engine_lp])
    return {
        **stats, "timing/weight_sync_lock_wait": t1 - t0, "timing/weight_sync_total": t2 - t0,
        "timing/probe": time.time() - t2,
        "weight_sync/logprob_diff_max": float(diffs.max()), "weight_sync/logprob_diff_mean": float(diffs.mean()),
    }


def batch_metrics(batch: Experience, advantages: torch.Tensor, old: torch.Tensor | None) -> dict[str, float]:
    """Rollout statistics count each rollout once: a chat rollout may arrive as several step-samples that share its
    id and reward (their generated tokens add up, one truncated sample truncates the rollout). `old` is None
    without an old-logprob pass (then no `train/logprob_diff_max`: the trainer logs `train/mismatch/*`)."""
    mask = batch.action_mask
    ids, sample_to_rollout = torch.unique(batch.rollout_ids, return_inverse=True)
    n = len(ids)
    first = torch.full((n,), batch.batch_size).scatter_reduce(0, sample_to_rollout, torch.arange(batch.batch_size),
                                                              reduce="amin")
    rewards, scores, group_ids = batch.rewards[first], batch.scores[first], batch.group_ids[first]
    lengths = torch.zeros(n).index_add(0, sample_to_rollout, batch.response_length.float())
    truncated = torch.zeros(n).scatter_reduce(0, sample_to_rollout, batch.truncated.float(), reduce="amax")
    groups = group_ids.unique()
    group_std = [rewards[group_ids == g].std(unbiased=False) for g in groups]
    out = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std(unbiased=False)),
        "rollout/score_mean": float(scores.mean()),
        "rollout/pass1": float((scores > 0).float().mean()),
        "rollout/num_rollouts": float(n),
        "rollout/num_samples": float(batch.batch_size),
        "rollout/num_prompt_groups": float(len(groups)),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/truncated_rate": float(truncated.mean()),
        "rollout/group_reward_std": float(torch.stack(group_std).mean()),
        "train/advantage_mean": float(algo.masked_mean(advantages, mask)),
        "train/advantage_abs_mean": float(algo.masked_mean(advantages.abs(), mask)),
    }
    if old is not None:
        out["train/logprob_diff_max"] = float(((batch.rollout_log_probs - old).abs() * mask).max())
    return out


def image_metrics(batch: Experience, model_path: str) -> dict[str, float]:
    """VLM batches: placeholder tokens and image features, counted separately (equal when aligned; the batch is
    checked row by row first, so a misaligned row stops the run instead of training on shifted features)."""
    if batch.mm_inputs is None:
        return {}
    from runtime.engines.weights import image_token_id, merge_size

    token_id, merge = image_token_id(model_path), merge_size(model_path)
    check_image_alignment(batch, token_id, merge)
    tokens = int(((batch.sequences == token_id) & batch.attention_mask).sum())
    features = sum(image_token_count(m, merge) for m in batch.mm_inputs)
    return {"rollout/image_tokens": float(tokens), "rollout/image_features": float(features),
            "rollout/images": float(sum(0 if m is None else len(m["image_grid_thw"]) for m in batch.mm_inputs))}


def save_checkpoint(trainer, critic, rl, step: int, kl_coef: float, books: Books) -> str:
    """Atomic: the ranks write into a temporary directory, the state goes in last, then one rename publishes it (a
    kill at any point leaves the previous checkpoint the newest complete one)."""
    tmp = ckpt.begin_save(rl.ckpt.dir, step)
    try:
        trainer.save_checkpoint(str(tmp))
        if critic is not None:
            critic.save_checkpoint(str(tmp / ckpt.CRITIC_DIR))
        ckpt.write_state(tmp, {"step": step, "kl_coef": kl_coef, "prompts": books.state()})
    except BaseException as exc:  # name the directory's trouble (a full disk reads as a torch enforce; DCP's
        # CheckpointException is a BaseException)
        trouble = None if isinstance(exc, KeyboardInterrupt | SystemExit) else ckpt.disk_trouble(
            rl.ckpt.dir, exc if isinstance(exc, OSError) else None)
        if trouble is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # the partial save: its room goes back
        raise RunAborted("actor", f"checkpoint save of step {step}", "ckpt.dir", f"could not save: {trouble}") from exc
    path = ckpt.publish(tmp)
    if rl.ckpt.save_hf:
        snapshots = Path(rl.ckpt.dir) / ckpt.HF_SNAPSHOTS
        trainer.export_hf(str(ckpt.step_dir(snapshots, step)))
        ckpt.prune_snapshots(snapshots, rl.ckpt.keep)
    ckpt.prune(rl.ckpt.dir, rl.ckpt.dcp_keep, rl.ckpt.max_disk_gb)
    return str(path)


def save_fits(rl, last_save_s: float | None, since_signal_s: float) -> bool:
    """After SIGINT/SIGTERM: save the current step when the plan checkpoints and a save fits in what is left of the
    stop bound (`train.stop_timeout_s`), judged by this run's last save (none yet: try; a save cut short by the
    bound leaves the previous checkpoint the newest complete one)."""
    if not rl.schedule.ckpt_every:
        return False
    return last_save_s is None or last_save_s < rl.supervisor.stop_timeout_s - since_signal_s


def settle_accounting(generator_accounting: dict[str, int], prompts_trained: int) -> dict[str, int]:
    """Prompts the generator batched but this loop never trained (queued when a stop came) end as `run_ended`."""
    acc = dict(generator_accounting)
    untrained = acc.pop("prompts/batched", 0) - prompts_trained
    if untrained:
        acc["prompts/dropped/run_ended"] = acc.get("prompts/dropped/run_ended", 0) + untrained
    acc["prompts/trained"] = prompts_trained
    return acc


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows, *t.shape[1:])]) if rows else t
