"""The generator: prompts -> groups -> agent runners -> filters -> Experience -> `rollout_queue`.

It runs as one async Ray actor next to the trainer loop (`reference/molt_rules.md` §4.2):

1. take a slot from `rollout_slots` (blocks while `queue.size` batches are produced and not yet trained: this is
   the back-pressure; the time blocked is `timing/vllm_idle_wait`);
2. run an eval round if one is due, send `EvalResult`, and go back to 1 (the trainer returns that slot);
3. produce one batch: keep `generate_batch_size` prompt groups in flight on the runners, take finished groups as
   they come, drop the ones the filters reject (§2.N, counted per reason), backfill with new prompts, stop as soon as
   `batch_size` groups passed. Unfinished and surplus groups persist into the next batch: generation never drains.
   Without `partial_rollout` the engine lock is held while producing, so a weight sync waits for the batch; with
   it a sync pauses the engines mid-batch (in-flight requests are kept, not drained or dropped) and they continue
   under the new weights. Either way every generated token records the weights version that sampled it
   (`Experience.policy_versions`; groups left in flight between batches can straddle a sync too, molt_rules.md
   D12): the trainer loop reports the rollout/partial_* and rollout/policy_version_* metrics, and the per-token IS
   correction divides by the sampling version's own log-probs (Molt masks nothing: D3);
4. put a `RolloutBatch` (the Experience itself goes to the object store) and go back to 1.

It ends with `EndOfStream` after `total_steps` batches or when the episodes run out of prompts.

Every dispatched prompt is accounted for: put into a batch (`prompts/batched`; the trainer loop turns that into
trained or `run_ended`), or dropped with a reason (`prompts/dropped/<reason>`), including the groups still in
flight when the run ends (`run_ended`), also when the generator itself fails. A group whose runner died or stopped
answering is re-sent alone, up to `agent.max_prompt_attempts` times, then dropped as `agent_crash` or
`episode_timeout`; a group that was alone on its runner then is dropped at once (see `_run_group`). A runner may die
`agent.max_restarts` times per `agent.restart_window_s`; past that it is given up.

Why one module of ~550 lines: the batch loop, the group retries and the books share one actor's state (the groups in
flight, the prompts dispatched); keeping them together is what keeps "consumed = trained + dropped" checkable in one
read. Prompts are read in `datasource.py`, groups are run by `runners.py` and `agents/`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch

from runtime.agents import SamplingParams
from runtime.datasource import interleave_order, read_images, read_prompts
from runtime.experience import concat
from runtime.messages import EndOfStream, EvalResult, RolloutBatch
from runtime.passk import mean_pass_at_k
from runtime.runners import EngineLost, GroupRequest, GroupResult

if TYPE_CHECKING:
    from schemas.plan import RlRuntime

logger = logging.getLogger(__name__)


class Generator:
    """`rl`: the plan's RL section, read where its fields are (data, sampling, generator, eval, agent, queue,
    schedule, model.path); nothing is renamed or defaulted here."""

    def __init__(self, rl: RlRuntime, runners: list, rollout_queue, rollout_slots, engine_lock):
        from transformers import AutoTokenizer

        self.rl = rl
        self.runners = runners
        self.queue, self.slots, self.lock = rollout_queue, rollout_slots, engine_lock
        self.sampling = SamplingParams.from_plan(rl.sampling)
        self.eval_sampling = SamplingParams.from_plan(rl.eval.sampling)
        self.tokenizer = AutoTokenizer.from_pretrained(rl.model.path)
        self.pad_id = self.tokenizer.pad_token_id
        data, ev = rl.data, rl.eval
        self.sources = [read_prompts(p, data.split, data.input_key, data.label_key, data.tools_key, data.max_samples)
                        for p in data.prompts]
        self.eval_rows = (read_prompts(ev.dataset, ev.split, data.input_key, data.label_key, data.tools_key,
                                       data.max_samples) if ev.dataset else [])
        # VLM: each row's images (as the dataset holds them; the runner loads them) and the directory relative
        # image paths resolve against.
        # Text prompts (`data.image_key` None): no image lists at all ([[]] per source would be truthy and index
        # out of range).
        self.images = [self._images(p, data.split) for p in data.prompts] if data.image_key else []
        self.eval_images = self._images(ev.dataset, ev.split) if ev.dataset else []
        self.inflight: dict[asyncio.Task, GroupRequest] = {}
        self.ready: list[GroupResult] = []        # passed the filters, not yet in a batch
        self.consumed = 0                         # prompts dispatched (each prompt is one group)
        self.batched = 0                          # prompts whose group went into a batch (trained unless the run stops)
        self.prompts_dropped: Counter = Counter()  # reason -> prompts
        self.window = _Window()                   # drop/filter statistics since the last batch
        self.runner_failures = 0
        self.runner_restarts = 0
        self.runners_down: set[int] = set()       # runners that died and are not back yet
        self.runners_dead: set[int] = set()       # runners Ray will not restart any more
        self.runner_load = [0] * len(runners)     # groups in flight per runner (dispatch favours the idlest)
        self.runners_alone: set[int] = set()      # runners running a suspect group alone
        self.runner_deaths: list[list[float]] = [[] for _ in runners]  # per runner: its deaths in the window
        self.load_at_death = [0] * len(runners)   # groups a runner had when it last died (1: the culprit is known)
        self.dropped_positions: dict[str, list[int]] = {}  # reason -> positions dropped since the last batch
        self._next_runner = 0
        self._task: asyncio.Task | None = None

    def _images(self, source: str, split: str) -> list[tuple[object, str]]:
        data = self.rl.data
        if data.image_key is None:
            return []
        base = str(Path(source.partition("@")[0]).parent)
        return [(refs, base) for refs in read_images(source, split, data.image_key, data.max_samples)]

    def _request(self, group_id: int, row, images, n: int, sampling) -> GroupRequest:
        prompt, label, tools = row
        refs, base = images if images is not None else (None, None)
        return GroupRequest(group_id, prompt, label, n, sampling, tools=tools, images=refs, image_dir=base)

    # ----------------------------------------------------------------------------------------------- main loop
    async def run(self, start_step: int, done: list[int], trained: int, dropped: dict[str, int]) -> dict[str, int]:
        """`done`: positions (in the seeded data order) already trained or dropped before a resume, with their
        counts: they are skipped, and every other position is sent, the ones in flight at the save first."""
        self._task = asyncio.current_task()
        ev, gen = self.rl.eval, self.rl.generator
        prompts = self._prompt_stream(skip=set(done))
        self.consumed, self.batched = len(done), trained
        self.prompts_dropped.update(dropped)
        next_eval = _next_eval_step(start_step, ev.every)
        eval_due_at_start = ev.at_start and start_step == 0 and bool(self.eval_rows)
        produced, reason = start_step, "total_steps"
        try:
            while produced < self.rl.schedule.total_steps:
                t0 = time.time()
                step = await self.slots.get_async()            # back-pressure: blocks while the queue is full
                slot_acquired_at = time.time()
                if self.eval_rows and (eval_due_at_start or (ev.every is not None and step >= next_eval)):
                    eval_due_at_start = False
                    next_eval = _next_eval_step(step, ev.every)
                    metrics = await self._locked(self._evaluate())
                    await self.queue.put_async(EvalResult(step=step, metrics=metrics))
                    continue
                if gen.rollout_replay_dir:
                    results, batch, exhausted = self._replayed(produced + 1)
                else:
                    results, exhausted = await self._locked(self._generate_batch(prompts))
                    trainer = self.rl.trainer
                    assert trainer is not None  # eval.only runs runtime/eval_only.py, not this loop
                    batch = concat([r.experience for r in results], self.pad_id,
                                   trainer.width_multiple) if results else None
                if not results:                                # nothing to train on: hand the slot back
                    await self.slots.put_async(step)
                    reason = "data_exhausted"
                    break
                self.batched += len(results)
                if gen.rollout_dump_dir:
                    self._dump(produced + 1, results, batch)
                metrics = self.window.flush(self)
                dropped, self.dropped_positions = self.dropped_positions, {}
                await self.queue.put_async(RolloutBatch(
                    experience=ray.put(batch), policy_version=step, metrics=metrics,
                    generation_s=time.time() - slot_acquired_at, vllm_idle_wait_s=slot_acquired_at - t0,
                    prompts_consumed=self.consumed, slot_acquired_at=slot_acquired_at,
                    prompt_positions=[r.group_id for r in results], dropped_positions=dropped))
                produced += 1
                if exhausted:
                    reason = "data_exhausted"
                    break
        except asyncio.CancelledError:
            reason = "stopped"
            raise
        except Exception:
            reason = "error"  # the exception reaches the driver through the run() ref
            raise
        finally:
            self._abandon_inflight()
            if reason != "stopped":
                await self.queue.put_async(EndOfStream(reason=reason, accounting=self.accounting()))
        return self.accounting()

    async def stop(self) -> dict[str, int]:
        """Cancel the run (SIGINT/SIGTERM on the driver); returns the prompt accounting at that point."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        return self.accounting()

    def accounting(self) -> dict[str, int]:
        out = {"prompts/consumed": self.consumed, "prompts/batched": self.batched}
        out.update({f"prompts/dropped/{k}": v for k, v in sorted(self.prompts_dropped.items())})
        return out

    async def _locked(self, coro):
        """Hold the engine lock around a generation phase unless partial rollout lets weight syncs interleave."""
        if self.rl.queue.partial_rollout:
            return await coro
        await self.lock.acquire.remote()
        try:
            return await coro
        finally:
            await self.lock.release.remote()

    # ----------------------------------------------------------------------------------------------- one batch
    async def _generate_batch(self, prompts: Iterator) -> tuple[list[GroupResult], bool]:
        gen, exhausted = self.rl.generator, False
        while len(self.ready) < gen.batch_size:
            while len(self.inflight) < gen.generate_batch_size and not exhausted:
                item = next(prompts, None)
                if item is None:
                    exhausted = True
                    break
                position, (row, images) = item
                self._dispatch(self._request(position, row, images, self.rl.sampling.n_samples_per_prompt,
                                             self.sampling))
                self.consumed += 1
            if not self.inflight:
                break
            done, _ = await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                req = self.inflight.pop(task)
                if task.exception() is not None:  # the run ends (every runner given up, ...): the books still close
                    self._drop_prompt("run_ended")
                    task.result()
                self._accept(task.result(), req.group_id)
        batch, self.ready = self.ready[:gen.batch_size], self.ready[gen.batch_size:]
        return batch, exhausted and not self.inflight and not self.ready

    def _dispatch(self, req: GroupRequest) -> None:
        self.inflight[asyncio.ensure_future(self._run_group(req))] = req

    async def _run_group(self, req: GroupRequest) -> GroupResult | str:
        """Send a group to a live runner, at most `max_prompt_attempts` times.

        A runner that dies under a group (its process crashed or was killed), or that does not answer it within
        `group_timeout_s` (an agent blocking its event loop; the runner is then restarted), makes every group it had
        a suspect: a suspect is re-sent *alone* to an idle runner, so that a prompt that crashes or hangs the agent
        is found out without taking other prompts with it. A group that fails alone (a suspect, or the only group
        its runner had) is dropped at once, quarantined: `agent_crash` (the process died) or `episode_timeout` (it
        stopped answering); so is any group on its last attempt."""
        agent = self.rl.agent
        suspect, reason = False, "agent_crash"
        for attempt in range(agent.max_prompt_attempts):
            index = await self._pick_runner(alone=suspect)
            self.runner_load[index] += 1
            alone = suspect
            try:
                return await self._send(req, index)
            except TimeoutError:
                logger.warning("group %d: runner %d did not answer in %.0f s (attempt %d of %d); runner restarted",
                               req.group_id, index, agent.group_timeout_s, attempt + 1,
                               agent.max_prompt_attempts)
                reason = "episode_timeout"
                self._runner_failed(index)
                alone = alone or self.load_at_death[index] == 1
                ray.kill(self.runners[index], no_restart=False)
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, EngineLost):
                    return "engine_lost"
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                logger.warning("group %d: runner %d failed (%s; attempt %d of %d)", req.group_id, index,
                               type(exc).__name__, attempt + 1, agent.max_prompt_attempts)
                reason = "agent_crash"
                self._runner_failed(index)
                alone = alone or self.load_at_death[index] == 1
            finally:
                self.runner_load[index] -= 1
                if suspect:  # only the suspect that reserved the runner frees it (a group that merely ran there
                    self.runners_alone.discard(index)  # would hand another suspect's reservation to new groups)
            if alone:
                print(f"group {req.group_id}: quarantined (dropped as {reason}): its runner {index} "
                      f"{'died' if reason == 'agent_crash' else 'stopped answering'} while running it alone",
                      flush=True)
                return reason
            suspect = True
        return reason

    async def _send(self, req: GroupRequest, index: int) -> GroupResult:
        """The group's call to runner `index`, bounded by `agent.group_timeout_s` (TimeoutError past it), with a
        line when it is late: past `agent.episode_timeout_s` every episode of it should have ended."""
        agent = self.rl.agent
        task = asyncio.ensure_future(_awaitable(self.runners[index].run_group.remote(req)))
        try:
            late_at = min(agent.episode_timeout_s, agent.group_timeout_s)
            done, _ = await asyncio.wait({task}, timeout=late_at)
            if not done:
                print(f"group {req.group_id} is late: runner {index} has not answered in {late_at:.0f} s "
                      f"(agent.episode_timeout_s); it is given up at {agent.group_timeout_s:.0f} s", flush=True)
                done, _ = await asyncio.wait({task}, timeout=agent.group_timeout_s - late_at)
            if not done:
                raise TimeoutError
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    def _runner_failed(self, index: int) -> None:
        self.runner_failures += 1
        if index in self.runners_down:
            return
        self.runners_down.add(index)
        self.load_at_death[index] = self.runner_load[index]  # no group of it has left yet: the first one is here
        agent, now = self.rl.agent, time.monotonic()
        deaths = [t for t in self.runner_deaths[index] if t > now - agent.restart_window_s] + [now]
        self.runner_deaths[index] = deaths
        if len(deaths) > agent.max_restarts:
            print(f"runner {index} died {len(deaths)} times within {agent.restart_window_s:.0f} s (at most "
                  f"{agent.max_restarts} restarts per window): given up", flush=True)
            self.runners_dead.add(index)
            ray.kill(self.runners[index], no_restart=True)
            return
        asyncio.ensure_future(self._watch_restart(index))

    async def _pick_runner(self, alone: bool = False) -> int:
        """The up runner with the fewest groups in flight (round-robin among equals), never one reserved for a
        suspect. For a suspect (`alone`), that runner is reserved (it gets no new groups) and returned once the
        groups it has finished. Waits while every runner is restarting or reserved."""
        n = len(self.runners)
        while True:
            if len(self.runners_dead) == n:
                raise RuntimeError("every agent runner was given up (each died more than agent.max_restarts times "
                                   "within agent.restart_window_s, or did not come back); see the runner logs")
            free = [i for i in range(n) if i not in self.runners_down and i not in self.runners_alone]
            if not free:
                await asyncio.sleep(0.2)
                continue
            index = min(free, key=lambda i: (self.runner_load[i], (i - self._next_runner) % n))
            self._next_runner = index + 1
            if not alone:
                return index
            self.runners_alone.add(index)
            while self.runner_load[index] > 0 and index not in self.runners_down:
                await asyncio.sleep(0.1)
            if index not in self.runners_down:
                return index
            self.runners_alone.discard(index)

    async def _watch_restart(self, index: int) -> None:
        """A dead runner is skipped until Ray has restarted it and it answers again; after two minutes without an
        answer (Ray is out of restarts for it) it is given up for good."""
        give_up_at = time.time() + 120
        while True:
            try:
                await self.runners[index].pid.remote()
                self.runners_down.discard(index)
                self.runner_restarts += 1
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if time.time() > give_up_at:
                    self.runners_dead.add(index)
                    return
                await asyncio.sleep(0.5)

    def _accept(self, result: GroupResult | str, position: int) -> None:
        """Filters of §2.N: a group with no survivors is dropped; with dynamic filtering, incomplete groups and
        groups whose mean score is not strictly inside (lo, hi) are dropped too."""
        if isinstance(result, str):  # an engine lost under it: not done (a resume sends it again)
            self._drop_prompt(result, None if result == "engine_lost" else position)
            return
        self.window.add(result)
        n, band = self.rl.sampling.n_samples_per_prompt, self.rl.generator.dynamic_filtering
        if result.experience is None:
            self._drop_prompt("all_rollouts_dropped", position)
        elif band and len(result.scores) < n:
            self._drop_prompt("incomplete_group", position)
        elif band and not band[0] < sum(result.scores) / n < band[1]:
            self._drop_prompt("dynamic_filter", position)
        else:
            self.ready.append(result)
            self.window.groups_passed += 1

    def _drop_prompt(self, reason: str, position: int | None = None) -> None:
        """`position` None: the prompt is not done (the run ended under it; a resume sends it again)."""
        self.prompts_dropped[reason] += 1
        self.window.prompts_dropped[reason] += 1
        if position is not None:
            self.dropped_positions.setdefault(reason, []).append(position)

    def _abandon_inflight(self) -> None:
        for task in self.inflight:
            task.cancel()
        for _ in range(len(self.inflight) + len(self.ready)):
            self._drop_prompt("run_ended")
        self.inflight.clear()
        self.ready.clear()

    # ----------------------------------------------------------------------------------------------- dump, replay
    def _dump(self, step: int, results: list[GroupResult], batch) -> None:
        """Molt's `rollout_dump_dir`: the batch that step `step` trains, with its prompts' positions (atomic)."""
        path = Path(self.rl.generator.rollout_dump_dir) / f"rollout_step{step}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"experience": batch, "positions": [r.group_id for r in results],
                    "scores": [r.scores for r in results]}, tmp)
        tmp.replace(path)

    def _replayed(self, step: int) -> tuple[list[GroupResult], object, bool]:
        """Molt's `rollout_replay_dir`: the dumped batch of step `step` instead of generating one; none left ends
        the stream (`data_exhausted`). Its prompts count as consumed and batched, like generated ones."""
        path = Path(self.rl.generator.rollout_replay_dir) / f"rollout_step{step}.pt"
        if not path.is_file():
            return [], None, True
        saved = torch.load(path, weights_only=False)
        results = [GroupResult(pos, None, [], scores) for pos, scores in zip(saved["positions"], saved["scores"],
                                                                              strict=True)]
        self.consumed += len(results)
        return results, saved["experience"], False

    # ----------------------------------------------------------------------------------------------- prompts
    def _prompt_stream(self, skip: set[int]) -> Iterator[tuple[int, tuple[tuple, object]]]:
        """(position, ((prompt, label, tools), images)): rows as the dataset holds them with their images (`(refs,
        directory)`, or None without `data.image_key`), episode after episode, each in a seeded shuffled order;
        `position` counts from 0 over the whole stream.

        The order depends only on the seed, so skipping the positions a resumed run had done restores its place.
        """
        position = -1
        gen, data = self.rl.generator, self.rl.data
        if data.probs:  # Molt's blend: interleaved once (all_exhausted, seeded), shuffled per episode
            lengths = [len(rows) for rows in self.sources]
            every = interleave_order(lengths, data.probs, gen.seed)[:data.max_samples]
        else:
            every = [(s, i) for s, rows in enumerate(self.sources) for i in range(len(rows))][:data.max_samples]
        for episode in range(gen.episodes):
            order = list(every)
            random.Random(gen.seed + episode).shuffle(order)
            for s, i in order:
                position += 1
                if position in skip:
                    continue
                yield position, (self.sources[s][i], self.images[s][i] if self.images and self.images[s] else None)

    # ----------------------------------------------------------------------------------------------- eval
    async def evaluate(self, per_prompt: bool = False):
        """An eval round outside the run (the driver's final one, after the last weight sync; an eval-only run's).
        With `per_prompt`: (metrics, one record per eval prompt: its label and its samples' scores and rewards)."""
        return await self._evaluate(per_prompt)

    async def _evaluate(self, per_prompt: bool = False):
        """eval/* metrics, pass@k among them: a prompt's n is the samples asked for (a dropped rollout counts as
        failed), its c the surviving samples with a score > 0 (`runtime/passk.py`)."""
        ev = self.rl.eval
        n = ev.sampling.n_samples_per_prompt
        t0 = time.time()
        reqs = [self._request(-1 - i, row, self.eval_images[i] if self.eval_images else None, n, self.eval_sampling)
                for i, row in enumerate(self.eval_rows)]
        outcomes = await asyncio.gather(*(self._run_group(q) for q in reqs))
        results = [r for r in outcomes if not isinstance(r, str)]
        correct = [sum(s > 0 for s in r.scores) if not isinstance(r, str) else 0 for r in outcomes]
        pass_k = mean_pass_at_k(correct, n, ev.pass_k)
        rewards = [x for r in results for x in r.rewards]
        scores = [x for r in results for x in r.scores]
        exps = [r.experience for r in results if r.experience is not None]
        lengths = torch.cat([e.response_length for e in exps]).float() if exps else torch.zeros(1)
        truncated = torch.cat([e.truncated for e in exps]).float() if exps else torch.zeros(1)
        metrics = {
            "eval/reward_mean": sum(rewards) / max(len(rewards), 1),
            "eval/pass1": sum(s > 0 for s in scores) / max(len(scores), 1),
            "eval/response_length_mean": float(lengths.mean()),
            "eval/truncated_rate": float(truncated.mean()),
            "eval/num_samples": float(len(rewards)),
            **{f"eval/pass@{k}": v for k, v in pass_k.items()},
            "timing/eval": time.time() - t0,
        }
        if not per_prompt:
            return metrics
        records = [{"prompt": p, "label": label, "n": n, "correct": c,
                    "scores": [] if isinstance(r, str) else r.scores, "rewards": [] if isinstance(r, str) else r.rewards,
                    "lost": r if isinstance(r, str) else None}
                   for (p, label, _), r, c in zip(self.eval_rows, outcomes, correct, strict=True)]
        return metrics, records


class _Window:
    """Drop and filter counts since the last batch: they become the batch's rollout/* metrics."""

    def __init__(self):
        self.rollouts_dropped: Counter = Counter()
        self.cuts: Counter = Counter()
        self.prompts_dropped: Counter = Counter()
        self.groups_seen = 0
        self.groups_passed = 0   # passed the filters in this window (a batch may also take groups of earlier ones)
        self.scores: list[float] = []
        self.all_pass = self.all_fail = 0
        self.info: dict[str, float] = {}
        self.info_count = 0

    def add(self, r: GroupResult) -> None:
        self.groups_seen += 1
        self.rollouts_dropped.update(r.dropped)
        self.cuts.update(r.cuts)
        self.scores.extend(r.scores)
        self.all_pass += bool(r.scores) and all(s > 0 for s in r.scores)
        self.all_fail += bool(r.scores) and all(s <= 0 for s in r.scores)
        for k, v in r.info.items():
            self.info[k] = self.info.get(k, 0.0) + v
        self.info_count += len(r.scores)

    def flush(self, gen: Generator) -> dict[str, float]:
        groups = max(self.groups_seen, 1)
        m: dict[str, float] = {f"rollout/dropped/{k}": float(v) for k, v in self.rollouts_dropped.items()}
        m["rollout/dropped/total"] = float(sum(self.rollouts_dropped.values()))
        m.update({f"rollout/cut/{k}": float(v) for k, v in self.cuts.items()})
        m.update({f"prompts/dropped/{k}": float(v) for k, v in gen.prompts_dropped.items()})
        m["rollout/pre_filter_mean_score"] = sum(self.scores) / max(len(self.scores), 1)
        m["rollout/group_all_pass_rate"] = self.all_pass / groups
        m["rollout/group_all_fail_rate"] = self.all_fail / groups
        m["rollout/dynamic_filtering_pass_rate"] = self.groups_passed / groups
        m["rollout/runner_failures"] = float(gen.runner_failures)
        m["rollout/runner_restarts"] = float(gen.runner_restarts)
        m["prompts/consumed"] = float(gen.consumed)
        m.update({f"rollout/info/{k}": v / max(self.info_count, 1) for k, v in self.info.items()})
        self.__init__()
        return m


def _next_eval_step(step: int, every: int | None) -> int:
    return (step // every + 1) * every if every is not None else 1 << 62


async def _awaitable(ref):
    return await ref
