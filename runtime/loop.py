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
  logprobs on a fixed sequence) before the lock goes back, logs, evaluates when the generator sends an eval round, and checkpoints.
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

import gc
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.queue import Queue

from runtime import algo, ckpt
from runtime.batch_stats import LengthShaping, batch_metrics, image_metrics, outcomes
from runtime.books import Books
from runtime.critic import critic_metrics, start_critic_group
from runtime.datasource import derive_at_start
from runtime.engine_lock import EngineLock, sync_weights, trainer_turn
from runtime.engines import engines_ready
from runtime.experience import (
    Experience,
    pad_batch_to_multiple,
    partial_rollout_metrics,
)
from runtime.generator import Generator
from runtime.messages import EndOfStream, EvalResult, RolloutBatch, RunResult
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
from schemas.plan import Plan, RlRuntime, TrainerPlan

REQUEUE_EXIT_STATUS = 75
"""Exit status of `python -m runtime` after SIGUSR1: checkpointed, run me again (EX_TEMPFAIL; the Slurm script
requeues the job on it, molt_compile/slurm.py holds the same number)."""


def run(plan: Plan, *, live: bool = True) -> RunResult:
    """Run the plan; raises `RunAborted` (actor, phase, likely key, accounting) when an actor dies or a phase stalls.
    Values the compiler deferred to the job's start (DATA010: it could not count the prompts) are derived first."""
    plan = derive_at_start(plan)
    rl = plan.rl
    assert rl is not None  # `python -m runtime` runs kind rl plans only
    stop = StopFlag()
    sup = Supervisor(rl.supervisor, stop)
    started = Started()
    try:
        if rl.eval.only:  # no trainer in the plan: one eval round
            from runtime.eval_only import run_eval_only

            return run_eval_only(plan, rl, sup, started, live=live)
        assert rl.trainer is not None  # a plan that trains has its trainer section (eval.only lowers to none)
        loop = RlLoop(plan, rl, rl.trainer, sup, started, live)
        loop.setup()
        loop.train()
        return loop.finish()
    except RunStopped as exc:  # stopped during start-up (`RlLoop.train` handles its own phases)
        print(f"{exc}; tearing the run down", flush=True)
        acc = settle_accounting(started.generator_accounting(rl.supervisor.stop_timeout_s), 0)
        return RunResult("stopped", 0, acc, None, Path(rl.logging.out_dir) / "metrics.jsonl")
    finally:
        started.teardown(rl.supervisor.stop_timeout_s)
        stop.restore()
        gc.unfreeze()  # `RlLoop.setup` froze them for the run only (a test process runs several)


class RlLoop:
    """The driver's RL run in stages (torchtune's recipe shape, as `runtime.sft.SftJob`): `setup` starts the
    roles and the generator, `train` takes batches until the stream ends or a stop comes, `finish` settles the books,
    evaluates the final weights, exports and plots. Every wait is a supervisor phase; a phase given `self.timings`
    logs its wall time as `timing/<its name>`."""

    # Ray actor handles and the FSDP groups' drivers (their methods are remote calls: typed Any)
    engines: list[Any]
    trainer: Any
    critic: Any
    separate_ref: Any
    lock: Any
    generator: Any

    def __init__(self, plan: Plan, rl: RlRuntime, trainer_plan: TrainerPlan, sup: Supervisor, started: Started,
                 live: bool):
        self.plan, self.rl, self.tp, self.sup, self.started, self.live = plan, rl, trainer_plan, sup, started, live
        self.step, self.status, self.last_eval_step = 0, "finished", -1
        self.accounting: dict[str, int] = {}
        self.timeline: list[dict] = []
        self.timings: dict[str, float] = {}  # this step's `timing/*`, filled by the timed phases
        self.last_ckpt: str | None = None
        self.last_save_s: float | None = None  # this run's last save (does one fit after SIGTERM?)

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self) -> None:
        self._open_logs()
        self._start_roles()
        self._start_generator()
        # What start-up left (imports, configs, tokenizer) lives as long as the run: frozen out of the collector's
        # full passes, which took up to 0.19 s each in the driver on one H100 (issue 29); `run` unfreezes them.
        gc.collect()
        gc.freeze()

    def _open_logs(self) -> None:
        """Checkpoint directory check, the checkpoint to resume from, and the logs (records after it dropped)."""
        rl, sup = self.rl, self.sup
        ckpt.check_dir(rl.ckpt.dir)  # unwritable or full: now, not at the first save hours in
        skipped: list[str] = []
        self.resume_from = ckpt.latest(rl.ckpt.dir, skipped) if rl.ckpt.resume else None
        for line in skipped:
            print(f"resume: skipped checkpoint {line}", flush=True)
        self.out_dir = Path(rl.logging.out_dir)
        resumed = self.resume_from is not None
        if self.resume_from is not None:  # the steps logged after the save are trained again: their records go
            for name in ("metrics.jsonl", PROMPTS_LOG):
                drop_records_after(self.out_dir / name, self.resume_from[1]["step"])
        assert rl.schedule.total_steps is not None  # derive_at_start counted the prompts
        self.sink = MetricsSink(self.out_dir, Path(rl.logging.tensorboard_dir) if rl.logging.tensorboard_dir
                                else None, rl.schedule.total_steps, self.live, append=resumed,
                                wandb=rl.logging.wandb, config=self.plan.recipe, engine=rl.engines.kind)
        self.started.sink = self.sink
        self.prompts_log = (self.out_dir / PROMPTS_LOG).open("a" if resumed else "w")
        self.started.files.append(self.prompts_log)
        with sup.phase("placement groups", "the Ray cluster", "cluster"):
            self.pgs = create_placement_groups(self.plan, sup)
        self.started.pgs = list(self.pgs.values())

    def _start_roles(self) -> None:
        """Engines, trainer, critic and reference groups, the rollout pipeline's actors; the resumed state; the
        weight-sync group."""
        plan, rl, sup, started, pgs = self.plan, self.rl, self.sup, self.started, self.pgs
        # The engines load their model while the trainer (and critic, reference) ranks build theirs: at scale both
        # take minutes. A watched engine that dies meanwhile ends the run by name.
        self.engines, self.router = start_rollout(plan, pgs, sup, wait=False)
        started.handles += self.engines
        for i, e in enumerate(self.engines):
            sup.watch(f"rollout.engine[{i}]", e, e.weights_version.remote, "rollout.engine")
        self.trainer = start_fsdp_group(start_trainer_group, plan, "actor", self.tp.world, "trainer", pgs, sup,
                                        started)
        self.critic = self.separate_ref = None
        if rl.critic is not None:
            self.critic = start_fsdp_group(start_critic_group, plan, "critic", rl.critic.world, "critic", pgs, sup,
                                           started)
        if rl.ref is not None and not rl.ref.colocated:
            self.separate_ref = start_fsdp_group(start_reference_group, plan, "ref", rl.ref.world, "reference", pgs,
                                                 sup, started)
        self._create_pipeline()
        self.probe_ids = probe_sequence(plan)  # the driver's tokenizer work, while the engines load
        with sup.phase("engine start-up", "rollout.engine", "rollout"):
            sup.get(engines_ready(self.engines))
        kl_coef, self.books = rl.algo.kl.coef, Books()
        if self.resume_from is not None:
            self.last_ckpt, state = str(self.resume_from[0]), self.resume_from[1]
            with sup.phase("checkpoint load", "actor", "ckpt.resume"):
                self.trainer.load_checkpoint(self.last_ckpt)
                if self.critic is not None:
                    self.critic.load_checkpoint(str(Path(self.last_ckpt) / ckpt.CRITIC_DIR))
            self.step, kl_coef, self.books = state["step"], state["kl_coef"], Books.from_state(state)
            print(f"resumed from {self.last_ckpt} at step {self.step}", flush=True)
        self.last_ckpt_step = self.step  # the step last saved (a requeue saves the current one unless it is saved)
        # a resumed launch that drops prompts and trains none has failed too (runtime.__main__.nothing_trained)
        self.books_at_start = {"trained": self.books.trained, "dropped": sum(self.books.dropped.values())}
        self.started.books = self.books
        self.kl_ctl = algo.make_kl_controller(kl_coef, rl.algo.kl.target, rl.algo.kl.horizon)
        self.link = WeightSyncLink(rl.weight_sync, rl.engines.dtype, self.trainer, self.engines,
                                   rl.weight_sync.check_unassigned, get=sup.get)
        with sup.phase("weight-sync group", "trainer rank 0 and the engines", "rollout.engine"):
            self.link.connect()
            if self.step > 0:  # resumed weights must reach the engines before the first rollout
                sync_weights(self.link, self.trainer, self.engines, None, self.probe_ids, self.step, sup, {})

    def _create_pipeline(self) -> None:
        """The rollout pipeline's actors (queues, engine lock, agent runners, generator), created once the model
        groups are built, while the engines finish loading: their processes' start-up (imports, the tokenizer, the
        agent, the prompts) is then off the path to the first rollout. Not earlier: on a small CPU node they would
        slow the engines' and the ranks' own start-up (imports that compete for the same cores). Nothing runs yet:
        the generator starts in `_start_generator`, once the engines are up and hold the resumed weights."""
        plan, rl, sup, started = self.plan, self.rl, self.sup, self.started
        self.rollout_queue = Queue(maxsize=rl.queue.size, actor_options=role_options(plan, "queue.rollout"))
        self.rollout_slots = Queue(maxsize=rl.queue.size, actor_options=role_options(plan, "queue.slots"))
        started.queues += [self.rollout_queue, self.rollout_slots]
        for name, q in (("queue.rollout", self.rollout_queue), ("queue.slots", self.rollout_slots)):
            actor: Any = q.actor
            sup.watch(name, actor, actor.qsize.remote, "train.async.queue_size")
        self.lock = EngineLock.options(**role_options(plan, "lock")).remote()  # type: ignore[attr-defined]  # @ray.remote
        started.handles.append(self.lock)
        sup.watch("lock", self.lock, self.lock.held.remote, "train.async.partial_rollout")
        self.runners = start_runners(plan, self.router)
        started.handles += self.runners
        self.generator = ray.remote(Generator).options(**role_options(plan, "generator")).remote(
            rl, self.runners, self.rollout_queue, self.rollout_slots, self.lock)
        started.handles.append(self.generator)

    def _start_generator(self) -> None:
        """The depth-Q pipeline: the generator may have at most Q batches produced and not yet taken by this loop.
        Each slot token carries the trainer's latest step (the generator uses it for eval timing)."""
        rl, sup = self.rl, self.sup
        for _ in range(rl.queue.size):
            self.rollout_slots.put(self.step)
        with sup.phase("agent runner start-up", "runner", "agent.path"):
            sup.get([r.pid.remote() for r in self.runners])  # an agent file that fails to import stops the run here
        books = self.books
        self.generator_done = self.generator.run.remote(self.step, books.done_positions(), books.trained,
                                                        dict(books.dropped))
        self.started.generator = self.generator  # asked for its accounting from now on
        sup.watch_call("generator", self.generator, self.generator_done, "agent")
        self.best = ((ckpt.best_record(self.rl.ckpt.dir) or {}).get("best_metric")
                     if self.resume_from is not None else None)
        self.sink.status(f"step {self.step}: waiting for the first rollout batch")

    # ------------------------------------------------------------------------------------------------ train
    def train(self) -> None:
        """Batches until the stream ends (data, total steps, a generator error) or a stop comes."""
        rl, sup = self.rl, self.sup
        step_start = time.time()  # a step's wall time runs from the previous step's end (evals in between count)
        try:
            while True:
                self.timings = {}
                with sup.phase("actor_idle_wait", "generator", "rollout / agent", self.timings):
                    msg = sup.next_message(self.rollout_queue)  # the time the trainer waited on the queue
                match msg:
                    case None:  # stop requested (SIGUSR1: checkpoint, for a requeue; SIGINT/SIGTERM: when it fits)
                        self._stop()
                        return
                    case EndOfStream():
                        self.accounting = msg.accounting
                        if msg.reason == "error":  # the generator raised: its error ends the run, by name
                            with sup.phase("waiting for a rollout batch", "generator", "agent"):
                                sup.get(self.generator_done)
                        return
                    case EvalResult():
                        self.rollout_slots.put(self.step)
                        self.sink.log(self.step, msg.metrics)
                        self.last_eval_step = self.step
                        self.best = ckpt.keep_best(self.best, msg.metrics, rl.ckpt, self.trainer, self.critic, sup,
                                                   self._state())
                    case RolloutBatch():
                        metrics = self.train_step(msg, step_start)
                        step_start = time.time()
                        if self.step % rl.schedule.log_every == 0:
                            self.sink.log(self.step, metrics)
        except RunStopped as exc:
            print(f"{exc}; tearing the run down", flush=True)
            self.status = "stopped"
            self.accounting = self.started.generator_accounting(rl.supervisor.stop_timeout_s)
        except RunAborted as exc:
            acc = self.started.generator_accounting(min(rl.supervisor.stop_timeout_s, 10.0))
            exc.with_accounting(settle_accounting(acc, self.books.trained))
            print(f"run aborted: {exc}", file=sys.stderr, flush=True)
            raise

    def train_step(self, msg: RolloutBatch, step_start: float) -> dict[str, float]:
        """One step on one batch: experience, critic step, policy step, weight sync and probe, checkpoint; its
        metrics."""
        rl, sup, books, timings = self.rl, self.sup, self.books, self.timings
        books.seen(msg)
        self.timeline.append({"batch": len(self.timeline), "slot_acquired_at": msg.slot_acquired_at,
                              "dequeued_at": time.time(), "policy_version": msg.policy_version})
        if not rl.queue.force_sync:
            self.rollout_slots.put(self.step)  # the next batch may start now, with the weights of this step
        queue_depth = self.rollout_queue.qsize()
        # alternate: the engines paused and the lock held from here through the sync (the GPUs they share are the
        # trainer's alone); overlap: they generate beside the step
        with trainer_turn(rl.queue, self.engines, self.lock, sup, timings) as sync_lock:
            with sup.phase("make_experience", "actor", "actor.micro_batch_size", timings):
                ex = self.make_experience(msg)
            train_ref = ray.put(ex.train_batch)
            critic_stats: dict[str, float] = {}
            if self.critic is not None:
                with sup.phase("critic_train", "critic", "critic", timings):
                    critic_stats = self.critic.train(train_ref)
            actor_frozen = self.step < self.tp.freezing_steps  # gae: the critic warms up, the policy waits
            train_stats: dict[str, float] = {}
            sync_stats: dict[str, float] = {}
            if not actor_frozen:
                with sup.phase("policy_train", "actor", "actor", timings):
                    train_stats = self.trainer.train(train_ref, self.kl_ctl.value)
            self.step += 1
            books.trained_batch(msg)
            self.prompts_log.write(json.dumps({"step": self.step, "prompts": sorted(msg.prompt_positions)}) + "\n")
            self.prompts_log.flush()
            if not actor_frozen:  # to every engine, under the engine lock, then the probe (frozen: nothing new)
                sync_stats = sync_weights(self.link, self.trainer, self.engines, sync_lock, self.probe_ids, self.step,
                                          sup, timings)
        if rl.queue.force_sync:
            self.rollout_slots.put(self.step)
        mean_kl = float(algo.masked_mean(ex.kl, ex.batch.action_mask)) if ex.kl is not None else 0.0
        self.kl_ctl.update(mean_kl, ex.batch.batch_size)
        if rl.schedule.ckpt_every and self.step % rl.schedule.ckpt_every == 0:
            with sup.phase("ckpt", "actor", "ckpt.dir", timings):
                self.last_ckpt = save_checkpoint(self.trainer, self.critic, rl, self.step, self.kl_ctl.value, books)
            self.last_ckpt_step, self.last_save_s = self.step, timings["timing/ckpt"]
        batch, real = ex.batch, ex.batch.batch_size
        return {
            **msg.metrics, **batch_metrics(batch, ex.advantages, None if ex.old is None else ex.old[:real]),
            **image_metrics(batch, rl.model.path), **partial_rollout_metrics(batch, self.step - 1),
            **{f"train/{k}": v for k, v in train_stats.items()}, **sync_stats,
            **{f"critic/{k}": v for k, v in critic_stats.items()}, **critic_metrics(ex.values, ex.returns, batch),
            "train/kl": mean_kl, "train/kl_coef": self.kl_ctl.value,
            "policy_version": float(msg.policy_version), "staleness": float(self.step - 1 - msg.policy_version),
            "queue/size": float(rl.queue.size), "queue/depth": float(queue_depth),
            "timing/generation": msg.generation_s, "timing/vllm_idle_wait": msg.vllm_idle_wait_s,
            "prompts/trained": float(books.trained), **ex.shaping_metrics, "train/actor_frozen": float(actor_frozen),
            **timings, "timing/step_total": time.time() - step_start,
        }

    def make_experience(self, msg: RolloutBatch) -> StepExperience:
        """π_old and π_ref (the FSDP groups; no old-logprob pass: the training forward is π_old, Molt B28), V_old
        (the critic), per-token KL, shaped and clipped rewards, advantages and returns."""
        a = self.rl.algo
        batch: Experience = self.sup.get(msg.experience)
        real = batch.batch_size
        padded = pad_batch_to_multiple(batch, self.tp.row_multiple)
        padded_ref = ray.put(padded)
        old = ref = values = None
        if self.tp.old_logprob_pass:
            old, ref = self.trainer.forward_logprobs(padded_ref)  # ref: a colocated reference's, same ranks
        if self.separate_ref is not None:
            ref = self.separate_ref.forward_logprobs(padded_ref)
        if a.kl.to_rollout:
            ref = padded.rollout_log_probs  # KL against the rollout policy: the engine's log-probs (Molt 0.2.1)
        if self.critic is not None:
            with self.sup.phase("values (V_old)", "critic", "critic.micro_batch_size"):
                values = self.critic.values(padded_ref)
        mask = batch.action_mask
        kl = None
        if ref is not None:
            assert old is not None  # the KL is on: the plan has an old-logprob pass (B28)
            kl = algo.kl_estimate(old[:real], ref[:real], a.kl.estimator, mask, ref=a.kl.ref)
        shaping = LengthShaping(a, batch)
        out = outcomes(batch)
        rewards = algo.prepare_rewards(a.estimator, out.rewards, out.rollout_ids.tolist(), out.group_ids.tolist(),
                                       (a.reward_clip[0], a.reward_clip[1]), shape=shaping.shape)
        adv = algo.compute_advantages(
            a.estimator, rewards, mask, kl=None if a.kl.use_loss else kl, kl_coef=self.kl_ctl.value, gamma=a.gamma,
            lam=a.lam, values=values[:real] if values is not None else None, whiten_advantages=a.whiten)
        pad_rows = padded.batch_size - real
        train_batch = fill_for_training(padded, old, ref, _pad_rows(adv.advantages, pad_rows),
                                        _pad_rows(adv.returns, pad_rows), values)
        return StepExperience(batch, train_batch, old, values, kl, adv.advantages, adv.returns, shaping.metrics)

    def _stop(self) -> None:
        """A stop signal: the generator's accounting, then a checkpoint of the current step when it is not saved and
        (SIGUSR1) a requeue asks for one or (SIGINT/SIGTERM) one fits in the stop bound."""
        rl, sup, stop = self.rl, self.sup, self.sup.stop
        self.status = "requeue" if stop.requeue else "stopped"
        with sup.phase("stopping the generator", "generator", "agent"):
            sup.unwatch("generator")
            self.accounting = sup.get(self.generator.stop.remote(), timeout=rl.supervisor.stop_timeout_s)
        if self.step > 0 and self.step != self.last_ckpt_step and (
                stop.requeue or save_fits(rl, self.last_save_s, time.monotonic() - stop.at)):
            with sup.phase("ckpt", "actor", "ckpt.dir"):
                self.last_ckpt = save_checkpoint(self.trainer, self.critic, rl, self.step, self.kl_ctl.value,
                                                 self.books)
            why = "for the requeue" if stop.requeue else "before stopping"
            print(f"checkpointed step {self.step} {why}: {self.last_ckpt}", flush=True)

    def _state(self) -> dict:
        return {"step": self.step, "kl_coef": self.kl_ctl.value, "prompts": self.books.state()}

    # ------------------------------------------------------------------------------------------------ finish
    def finish(self) -> RunResult:
        """Settle the prompt books; a finished run waits for the generator's end, evaluates the final weights (when
        the last eval was not at this step) and exports HF weights; the metrics plot."""
        rl, sup, step = self.rl, self.sup, self.step
        sup.unwatch("generator")
        accounting = settle_accounting(self.accounting, self.books.trained)
        if self.status == "finished":
            with sup.phase("end of the generator", "generator", "agent"):
                sup.get(self.generator_done)
                if rl.eval.enabled and rl.eval.every and step > 0 and self.last_eval_step != step:
                    final_eval = sup.get(self.generator.evaluate.remote())  # the final weights are evaluated too
                    self.sink.log(step, final_eval)
                    ckpt.keep_best(self.best, final_eval, rl.ckpt, self.trainer, self.critic, sup, self._state())
        self.sink.close()
        self.started.sink = None
        if self.status == "finished" and rl.ckpt.final_save:
            with sup.phase("HF export", "actor", "ckpt.hf_dir"):
                self.trainer.export_hf(rl.ckpt.hf_dir)
        plot = plot_run(self.sink.path, self.out_dir / "metrics.png", f"{self.plan.name} ({self.plan.fingerprint[:12]})")
        return RunResult(self.status, step, accounting, self.last_ckpt, self.sink.path, plot, self.timeline,
                         self.books_at_start)


@dataclass(frozen=True)
class StepExperience:
    """What `make_experience` hands the step: the batch as generated (`batch`, its real rows) and padded for the
    FSDP groups with π_old, π_ref, advantages and returns (`train_batch`), and what the metrics read."""

    batch: Experience
    train_batch: Experience
    old: torch.Tensor | None
    values: torch.Tensor | None
    kl: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor
    shaping_metrics: dict[str, float]


PROMPTS_LOG = "prompts.jsonl"
"""One line per trained step: `{"step": s, "prompts": [positions]}`, the positions (in the seeded data order of
runtime/generator.py) of the prompts trained at that step: what an exact resume is checked against."""


# ---------------------------------------------------------------------------------------------------- steps
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
