"""Typed messages on the two channels between the generator and the trainer loop.

`rollout_queue` (generator -> trainer) carries `Message`; the consumer dispatches with `match`, never on strings.
`rollout_slots` (trainer -> generator) carries plain ints: the trainer's latest step, handed back with each slot.
`RunResult` is what a run (`runtime.loop.run`, or its eval-only form `runtime.eval_only`) hands its caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ray import ObjectRef


@dataclass(frozen=True)
class RolloutBatch:
    """One training step's worth of finished rollouts."""

    experience: ObjectRef          # runtime.experience.Experience in the object store (heavy tensors stay out of the queue)
    policy_version: int            # trainer step whose weights the batch's *first* request was generated with
    metrics: dict[str, float]      # rollout/* and prompts/* statistics of this batch (documented in runtime/metrics.py)
    generation_s: float            # wall time the generator spent producing this batch
    vllm_idle_wait_s: float        # time the generator waited for a slot before it (rollout capacity idle)
    prompts_consumed: int          # prompts dispatched since the start of the run (resume state)
    slot_acquired_at: float        # time.time() when the generator took the slot for this batch (timeline)
    prompt_positions: list[int] = field(default_factory=list)   # the batch's prompts (positions in the data order)
    dropped_positions: dict[str, list[int]] = field(default_factory=dict)  # reason -> prompts dropped since the last batch


@dataclass(frozen=True)
class EvalResult:
    step: int                      # trainer step the eval ran at
    metrics: dict[str, float]      # eval/* keys


@dataclass(frozen=True)
class EndOfStream:
    reason: str                    # "data_exhausted" | "total_steps" | "error"
    accounting: dict[str, int] = field(default_factory=dict)   # prompts/consumed, prompts/trained, prompts/dropped/<reason>


Message = RolloutBatch | EvalResult | EndOfStream


@dataclass
class RunResult:
    status: str                     # "finished" | "stopped" | "requeue" (checkpointed on SIGUSR1)
    step: int
    accounting: dict[str, int]
    last_checkpoint: str | None
    metrics_path: Path
    plot_path: Path | None = None
    timeline: list[dict] = field(default_factory=list)   # per batch: slot taken, dequeued, policy version
    books_at_start: dict[str, int] = field(default_factory=dict)  # a resumed launch's prompts trained, dropped
