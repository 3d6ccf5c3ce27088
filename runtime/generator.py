"""The generator: prompts -> groups -> agent runners -> filters -> Experience -> `rollout_queue`.

It runs as one async Ray actor next to the trainer loop (`reference/molt_rules.md` §4.2):

1. take a slot from `rollout_slots` (blocks while `queue.size` batches are produced and not yet trained: this is
   the back-pressure; the time blocked is `timing/vllm_idle_wait`);
2. run an eval round if one is due, send `EvalResult`, and go back to 1 (the trainer returns that slot);
3. produce one batch: keep `generate_batch_size` prompt groups in flight on the runners, take finished groups as
   they come, drop the ones the filters reject (§2.N, counted per reason), backfill with new prompts, stop as soon as
   `batch_size` groups passed. Unfinished and surplus groups persist into the next batch: generation never drains.
   Without `partial_rollout` the engine lock is held while producing, so a weight sync waits for the batch;
4. put a `RolloutBatch` (the Experience itself goes to the object store) and go back to 1.

It ends with `EndOfStream` after `total_steps` batches or when the episodes run out of prompts.

Every dispatched prompt is accounted for: put into a batch (`prompts/batched`; the trainer loop turns that into
trained or `run_ended`), or dropped with a reason (`prompts/dropped/<reason>`), including the groups still in
flight when the run ends (`run_ended`). A group whose runner died is re-sent, up to the runner
restart budget, then dropped as `runner_lost`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from runtime.agents import SamplingParams
from runtime.datasource import read_images, read_prompts
from runtime.experience import concat
from runtime.messages import EndOfStream, EvalResult, RolloutBatch
from runtime.passk import mean_pass_at_k
from runtime.runners import GroupRequest, GroupResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GeneratorSpec:
    """The generator's slice of the plan (copied by runtime/loop.py; nothing is defaulted here)."""

    prompt_paths: tuple[str, ...]            # any format runtime/datasource.py reads
    split: str                               # split of a source that is a dataset dict
    prompt_probs: tuple[float, ...] | None
    input_key: str
    label_key: str | None
    tools_key: str | None                    # column of per-row tool schemas (rendered by the chat template)
    image_key: str | None                    # image column of a VLM run (None: text prompts)
    max_samples: int
    tokenizer_path: str
    n_samples_per_prompt: int
    sampling: SamplingParams
    batch_size: int                          # prompt groups per training step
    generate_batch_size: int                 # prompt groups kept in flight
    episodes: int
    total_steps: int
    dynamic_filtering: tuple[float, float] | None
    partial_rollout: bool
    seed: int
    max_dispatch_attempts: int               # a group is sent at most this many times (runner restarts)
    eval_path: str | None
    eval_split: str
    eval_every: int                          # -1: never
    eval_at_start: bool
    eval_n_samples: int
    eval_sampling: SamplingParams | None
    eval_pass_k: tuple[int, ...]             # the k of each reported eval/pass@k


class Generator:
    def __init__(self, spec: GeneratorSpec, runners: list, rollout_queue, rollout_slots, engine_lock):
        from transformers import AutoTokenizer

        self.spec = spec
        self.runners = runners
        self.queue, self.slots, self.lock = rollout_queue, rollout_slots, engine_lock
        self.tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        self.pad_id = self.tokenizer.pad_token_id
        self.sources = [read_prompts(p, spec.split, spec.input_key, spec.label_key, spec.tools_key, spec.max_samples)
                        for p in spec.prompt_paths]
        self.eval_rows = (read_prompts(spec.eval_path, spec.eval_split, spec.input_key, spec.label_key,
                                       spec.tools_key, spec.max_samples) if spec.eval_path else [])
        # VLM: each row's images (as the dataset holds them; the runner loads them) and the directory relative
        # image paths resolve against.
        # Text prompts: no image lists at all ([[]] per source would be truthy and index out of range).
        self.images = [self._images(p, spec.split) for p in spec.prompt_paths] if spec.image_key else []
        self.eval_images = self._images(spec.eval_path, spec.eval_split) if spec.eval_path else []
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
        self._next_runner = 0
        self._task: asyncio.Task | None = None

    def _images(self, source: str, split: str) -> list[tuple[object, str]]:
        if self.spec.image_key is None:
            return []
        base = str(Path(source.partition("@")[0]).parent)
        return [(refs, base) for refs in read_images(source, split, self.spec.image_key, self.spec.max_samples)]

    def _request(self, group_id: int, row, images, n: int, sampling) -> GroupRequest:
        prompt, label, tools = row
        refs, base = images if images is not None else (None, None)
        return GroupRequest(group_id, prompt, label, n, sampling, tools=tools, images=refs, image_dir=base)

    # ----------------------------------------------------------------------------------------------- main loop
    async def run(self, start_step: int, resume_consumed: int) -> dict[str, int]:
        self._task = asyncio.current_task()
        spec = self.spec
        prompts = self._prompt_stream(skip=resume_consumed)
        self.consumed = resume_consumed
        next_eval = _next_eval_step(start_step, spec.eval_every)
        eval_due_at_start = spec.eval_at_start and start_step == 0 and bool(self.eval_rows)
        produced, reason = start_step, "total_steps"
        try:
            while produced < spec.total_steps:
                t0 = time.time()
                step = await self.slots.get_async()            # back-pressure: blocks while the queue is full
                slot_acquired_at = time.time()
                if self.eval_rows and (eval_due_at_start or (spec.eval_every > 0 and step >= next_eval)):
                    eval_due_at_start = False
                    next_eval = _next_eval_step(step, spec.eval_every)
                    metrics = await self._locked(self._evaluate())
                    await self.queue.put_async(EvalResult(step=step, metrics=metrics))
                    continue
                results, exhausted = await self._locked(self._generate_batch(prompts))
                if not results:                                # nothing to train on: hand the slot back
                    await self.slots.put_async(step)
                    reason = "data_exhausted"
                    break
                self.batched += len(results)
                batch = concat([r.experience for r in results], self.pad_id)
                metrics = self.window.flush(self)
                await self.queue.put_async(RolloutBatch(
                    experience=ray.put(batch), policy_version=step, metrics=metrics,
                    generation_s=time.time() - slot_acquired_at, vllm_idle_wait_s=slot_acquired_at - t0,
                    prompts_consumed=self.consumed, slot_acquired_at=slot_acquired_at))
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
        if self.spec.partial_rollout:
            return await coro
        await self.lock.acquire.remote()
        try:
            return await coro
        finally:
            await self.lock.release.remote()

    # ----------------------------------------------------------------------------------------------- one batch
    async def _generate_batch(self, prompts: Iterator) -> tuple[list[GroupResult], bool]:
        spec, exhausted = self.spec, False
        while len(self.ready) < spec.batch_size:
            while len(self.inflight) < spec.generate_batch_size and not exhausted:
                item = next(prompts, None)
                if item is None:
                    exhausted = True
                    break
                row, images = item
                self._dispatch(self._request(self.consumed, row, images, spec.n_samples_per_prompt, spec.sampling))
                self.consumed += 1
            if not self.inflight:
                break
            done, _ = await asyncio.wait(self.inflight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self.inflight.pop(task)
                self._accept(task.result())
        batch, self.ready = self.ready[:spec.batch_size], self.ready[spec.batch_size:]
        return batch, exhausted and not self.inflight and not self.ready

    def _dispatch(self, req: GroupRequest) -> None:
        self.inflight[asyncio.ensure_future(self._run_group(req))] = req

    async def _run_group(self, req: GroupRequest) -> GroupResult | str:
        """Send a group to a live runner; if the runner dies under it, re-send it elsewhere within the budget."""
        for attempt in range(self.spec.max_dispatch_attempts):
            index = await self._pick_runner()
            try:
                return await self.runners[index].run_group.remote(req)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.runner_failures += 1
                logger.warning("group %d: runner %d failed (%s); re-dispatching (attempt %d)", req.group_id, index,
                               type(exc).__name__, attempt + 2)
                if index not in self.runners_down:
                    self.runners_down.add(index)
                    asyncio.ensure_future(self._watch_restart(index))
        return "runner_lost"

    async def _pick_runner(self) -> int:
        """Round-robin over the runners that are up; wait while all are restarting."""
        while True:
            if len(self.runners_dead) == len(self.runners):
                raise RuntimeError(f"every agent runner died more than max_restarts={self.spec.max_dispatch_attempts - 1}"
                                   " times; see the runner logs")
            for _ in range(len(self.runners)):
                index = self._next_runner % len(self.runners)
                self._next_runner += 1
                if index not in self.runners_down:
                    return index
            await asyncio.sleep(0.2)

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

    def _accept(self, result: GroupResult | str) -> None:
        """Filters of §2.N: a group with no survivors is dropped; with dynamic filtering, incomplete groups and
        groups whose mean score is not strictly inside (lo, hi) are dropped too."""
        if isinstance(result, str):
            self._drop_prompt(result)
            return
        self.window.add(result)
        n = self.spec.n_samples_per_prompt
        if result.experience is None:
            self._drop_prompt("all_rollouts_dropped")
        elif self.spec.dynamic_filtering and len(result.scores) < n:
            self._drop_prompt("incomplete_group")
        elif self.spec.dynamic_filtering and not (
                self.spec.dynamic_filtering[0] < sum(result.scores) / n < self.spec.dynamic_filtering[1]):
            self._drop_prompt("dynamic_filter")
        else:
            self.ready.append(result)
            self.window.groups_passed += 1

    def _drop_prompt(self, reason: str) -> None:
        self.prompts_dropped[reason] += 1
        self.window.prompts_dropped[reason] += 1

    def _abandon_inflight(self) -> None:
        for task in self.inflight:
            task.cancel()
        for _ in range(len(self.inflight) + len(self.ready)):
            self._drop_prompt("run_ended")
        self.inflight.clear()
        self.ready.clear()

    # ----------------------------------------------------------------------------------------------- prompts
    def _prompt_stream(self, skip: int) -> Iterator[tuple[object, object, list | None]]:
        """(prompt, label, tools) rows as the dataset holds them, episode after episode, each in a seeded shuffled order.

        The order depends only on the seed, so skipping the first `skip` items restores a resumed run's position.
        """
        spec = self.spec
        for episode in range(spec.episodes):
            rng = random.Random(spec.seed + episode)
            if spec.prompt_probs:
                order = _blend(self.sources, spec.prompt_probs, rng, spec.max_samples)
            else:
                order = [(s, i) for s, rows in enumerate(self.sources) for i in range(len(rows))][:spec.max_samples]
                rng.shuffle(order)
            for s, i in order:
                if skip > 0:
                    skip -= 1
                    continue
                yield self.sources[s][i], (self.images[s][i] if self.images and self.images[s] else None)

    # ----------------------------------------------------------------------------------------------- eval
    async def evaluate(self, per_prompt: bool = False):
        """An eval round outside the run (the driver's final one, after the last weight sync; an eval-only run's).
        With `per_prompt`: (metrics, one record per eval prompt: its label and its samples' scores and rewards)."""
        return await self._evaluate(per_prompt)

    async def _evaluate(self, per_prompt: bool = False):
        """eval/* metrics, pass@k among them: a prompt's n is the samples asked for (a dropped rollout counts as
        failed), its c the surviving samples with a score > 0 (`runtime/passk.py`)."""
        spec = self.spec
        t0 = time.time()
        reqs = [self._request(-1 - i, row, self.eval_images[i] if self.eval_images else None, spec.eval_n_samples,
                              spec.eval_sampling) for i, row in enumerate(self.eval_rows)]
        outcomes = await asyncio.gather(*(self._run_group(q) for q in reqs))
        results = [r for r in outcomes if not isinstance(r, str)]
        correct = [sum(s > 0 for s in r.scores) if not isinstance(r, str) else 0 for r in outcomes]
        pass_k = mean_pass_at_k(correct, spec.eval_n_samples, spec.eval_pass_k)
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
        records = [{"prompt": p, "label": label, "n": spec.eval_n_samples, "correct": c,
                    "scores": [] if isinstance(r, str) else r.scores, "rewards": [] if isinstance(r, str) else r.rewards,
                    "lost": r if isinstance(r, str) else None}
                   for (p, label, _), r, c in zip(self.eval_rows, outcomes, correct, strict=True)]
        return metrics, records


class _Window:
    """Drop and filter counts since the last batch: they become the batch's rollout/* metrics."""

    def __init__(self):
        self.rollouts_dropped: Counter = Counter()
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


def _next_eval_step(step: int, every: int) -> int:
    return (step // every + 1) * every if every > 0 else 1 << 62


def _blend(sources, probs, rng: random.Random, limit: int) -> list[tuple[int, int]]:
    """Interleave sources with the given probabilities until one runs out (or `limit` prompts)."""
    cursors = [rng.sample(range(len(rows)), len(rows)) for rows in sources]
    out = []
    while len(out) < limit:
        s = rng.choices(range(len(sources)), weights=probs)[0]
        if not cursors[s]:
            break
        out.append((s, cursors[s].pop()))
    return out


@ray.remote(num_cpus=0)
class EngineLock:
    """Generation and weight sync must not overlap (unless partial rollout says they may), so that every sample
    of a batch is generated with one version of the weights. An asyncio lock in its own zero-CPU actor is shared by
    the generator (held while producing a batch) and the trainer loop (held while pushing weights)."""

    def __init__(self):
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        await self._lock.acquire()

    def release(self) -> None:
        self._lock.release()
