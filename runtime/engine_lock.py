"""The engine lock and the turns taken under it: generation (the generator, runtime/generator.py), the weight sync
and its probe, and, under `train.async.colocated_gpus: alternate`, the whole training step.

On a GPU the trainer shares with an engine (`rollout.placement: colocate`) the two processes time-slice the GPU
whenever both have work; `alternate` gives the training step the GPU alone. Measured on one H100
(tests/gpu/bench_loop.py, 2026-12-05): a step trained in 1.46-1.63 s alone against 2.22-2.32 s beside the
generation, and the loop made 0.90-0.95x the tokens per second of `overlap`; with every response 256 tokens long
(`rollout.min_new_tokens`), 1.15-1.20 s against 2.26-2.27 s, and 1.05-1.07x `overlap`'s tokens per second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch

from runtime.supervisor import Supervisor
from runtime.weight_sync_driver import WeightSyncLink
from schemas.plan import QueuePlan


@ray.remote(num_cpus=0)
class EngineLock:
    """Generation and weight sync must not overlap (unless partial rollout says they may): no request runs while
    weights are being loaded. An asyncio lock in its own zero-CPU actor is shared by the generator (held while
    producing a batch) and the trainer loop (held while pushing weights). It does not make a batch single-version:
    surplus groups in flight at the end of a batch are carried into the next one, across the sync (Molt 0.2.1
    drains them instead, D12/X4); each token's version is in `Experience.policy_versions`."""

    def __init__(self):
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        await self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def held(self) -> bool:
        """The supervisor's ping."""
        return self._lock.locked()


@contextmanager
def trainer_turn(queue: QueuePlan, engines: list, lock, sup: Supervisor, timings: dict[str, float]) -> Iterator[Any]:
    """One training step's hold on the engines. Under `colocated_gpus: alternate` it takes the engine lock (a batch
    or eval round being generated finishes first: `timing/engine_lock_wait`) and pauses the engines, so that the
    groups carried between batches (D12) stop too, and yields None: the step's weight sync must not take the lock
    again, and resumes the engines before its probe. The engines are resumed (again: a no-op after a sync) and the
    lock released when the step ends, a step that synced nothing (a frozen actor) included. Under `overlap` it
    yields `lock` and holds nothing: the engines generate beside the step."""
    if queue.colocated_gpus == "overlap":
        yield lock
        return
    with sup.phase("engine_lock_wait", "generator (holds the engine lock)", "train.async.colocated_gpus", timings):
        held = sup.wait_unless_stopped(lock.acquire.remote())
    if not held:  # a stop came first: the step trains beside the generation, and its sync is skipped
        yield None
        return
    try:
        with sup.phase("engine_pause", "rollout engines", "rollout.engine", timings):
            sup.get([e.pause.remote() for e in engines])
        yield None
        sup.get([e.resume.remote() for e in engines])
    finally:
        ray.get(lock.release.remote(), timeout=sup.bounds.stop_timeout_s)


def sync_weights(link: WeightSyncLink, trainer, engines, lock, probe_ids: list[int], version: int,
                 sup: Supervisor, timings: dict[str, float]) -> dict[str, float]:
    """Stream the weights to every engine (paused around the update, `runtime.weight_sync`); then the probe, still
    under the engine lock: released first, the generator starts its next batch at once and the probe's engine call
    waits behind it (1.5 s a step on one H200, issue 29); the hf engine's score then takes its next forward pass
    (0.62 s a step waiting behind every generation chunk before, 0.11 s after). Timed phases: `weight_sync_total`
    (lock wait, pause, `timing/weight_sync`, resume), `weight_sync_lock_wait`, `probe` (the engines and the trainer
    at once).

    `lock` is None before the generator exists (resume), when nothing can be generating, and inside an `alternate`
    `trainer_turn`, which holds it already.

    A stop (a signal; Slurm's time-limit warning under `launch.slurm.requeue`) skips the sync, also one waiting for
    the lock: no engine generates again, and the checkpoint the stop saves needs only the trainer. Waiting would
    outlast the stop bound whenever the batch being generated takes longer (slow agents), and lose the checkpoint.
    """
    if sup.stop.requested:
        return _skipped(version)
    locked = False
    try:
        with sup.phase("weight_sync_total", "trainer rank 0 and the engines", "rollout.engine", timings):
            if lock is not None:
                with sup.phase("weight_sync_lock_wait", "generator (holds the engine lock)",
                               "agent.episode_timeout_s", timings):
                    if not sup.wait_unless_stopped(lock.acquire.remote()):
                        return _skipped(version)
                locked = True
            sup.get([e.pause.remote() for e in engines])
            stats = link.sync(version)
            sup.get([e.resume.remote() for e in engines])
        with sup.phase("probe", "trainer rank 0 and the engines", "rollout.engine", timings):
            engine_refs = [e.score.remote(probe_ids) for e in engines]
            trainer_lp = torch.tensor(trainer.probe_logprobs(probe_ids))
            engine_lp = [torch.tensor(lp) for lp in sup.get(engine_refs)]
    finally:
        if locked:
            ray.get(lock.release.remote(), timeout=sup.bounds.stop_timeout_s)
    diffs = torch.stack([(lp - trainer_lp).abs() for lp in engine_lp])
    return {**stats, "weight_sync/logprob_diff_max": float(diffs.max()),
            "weight_sync/logprob_diff_mean": float(diffs.mean())}


def _skipped(version: int) -> dict[str, float]:
    print(f"step {version}: a stop came before the weight sync; the engines keep version {version - 1} (none "
          "generates again)", flush=True)
    return {}
