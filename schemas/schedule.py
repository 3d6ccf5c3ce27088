"""The values that follow from a dataset's row count, derived by one function at compile time or at the job's start.

The step count of a run and the length of its LR schedule come from the number of training rows (Molt B11, B10,
M6). When the compiler can count them (a local file, `schemas/datafiles.py` reads its header), `molt_compile/derive/`
calls `rl_schedule` / `sft_schedule` and the plan carries the values. When it cannot (a path that exists only on the
cluster, a hub dataset), the recipe compiles with DATA010, the values are None and the plan's data section carries
`count_at_start` (the inputs): the job counts the rows at its start with `count_rows` and `at_job_start` fills in the
same values from the same functions, and prints them. Nothing else is derived at run time.

Importable without torch, ray, vllm or transformers (the compiler imports it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from schemas.datafiles import source_facts
from schemas.plan import Plan, RlCountInputs, SftCountInputs

Value = tuple[str, Any, str, tuple[str, ...]]
"""One derived value: (name, value, reason, the keys it was computed from) — `derive`'s `DerivedValue` fields."""

CountOther = Callable[[str, str, int], int]
"""Rows of a source the header reader cannot count (a hub name): `(source, split, limit) -> rows`; the runtime's."""


def count_rows(
    sources: list[str],
    max_samples: int,
    probs: Any,
    split: str,
    root: str | None = None,
    count_other: CountOther | None = None,
    seed: int | None = None,
) -> tuple[int | None, str]:
    """Rows of resolved dataset sources after the per-source and blend `max_samples` caps, with a reason.

    Counts local json/jsonl/parquet/arrow files and save_to_disk / DatasetDict directories from their headers
    (`schemas/datafiles.py`: no datasets/pyarrow import); a relative source is joined to `root` (the job root). A
    source it cannot count (a hub name, a path not visible here) is counted by `count_other` when given (the job's
    start passes one that loads it), else the result is None with the reason. Sources interleaved by `probs` (SFT
    `data.dataset_probs`, RL `data.prompt_probs`) are counted as `interleaved_rows` draws them with `seed`; without a
    seed the result is None.
    """
    if probs and seed is None:
        return None, "interleaved with probabilities: the length depends on sampling"
    total = 0
    parts, counts = [], []
    for src in sources:
        path_str = src.split("@", 1)[0]
        local = os.path.join(root, path_str) if root and not os.path.isabs(path_str) else path_str
        facts = source_facts(local, split)
        n = facts.rows
        if n is None and count_other is not None:
            n = count_other(src, split, max_samples)
        if n is None:
            return None, f"{path_str}: {facts.how}"
        capped = min(n, max_samples)
        parts.append(f"{path_str} {n}" + (f" (capped {capped})" if capped != n else ""))
        total += capped
        counts.append(n)
    if not sources:
        return None, "no dataset source"
    how = "counted: " + " + ".join(parts)
    if probs:
        mixed, why = interleaved_rows([min(n, max_samples) for n in counts], probs, seed or 0)
        if mixed is None:
            return None, why
        total = mixed
        how = f"{why} of {', '.join(parts)}"
    blended = min(total, max_samples)
    cap = f", capped at max_samples {max_samples}" if blended != total else ""
    return blended, how + cap


def probs_problem(n_sources: int, probs: list[float]) -> str | None:
    """Why `probs` cannot interleave `n_sources` sources under all_exhausted (datasets and numpy refuse them at
    load), or None: one probability per source, each > 0 (a never-drawn source is never exhausted), summing to 1
    (numpy's `choice` checks it to about 1.5e-8; 1e-8 here)."""
    if len(probs) != n_sources:
        return f"{len(probs)} probabilities for {n_sources} source(s)"
    if any(p <= 0 for p in probs):
        return "a probability is not > 0 (under all_exhausted every source must be drawn through)"
    if abs(math.fsum(probs) - 1.0) > 1e-8:
        return f"the probabilities sum to {math.fsum(probs):g}, not 1"
    return None


def interleaved_rows(lengths: list[int], probs: list[float], seed: int) -> tuple[int | None, str]:
    """Rows of `datasets.interleave_datasets(sources, probabilities=probs, seed=seed,
    stopping_strategy="all_exhausted")` over sources of `lengths` (Molt's blend, molt_rules.md §1.1
    `--data.prompt_probs`; SFT's `dataset_probs` goes through the same function), with a reason.

    datasets (5.x) draws a source per row from `numpy.random.default_rng(seed).choice(n, size=1000, p=probs)` blocks
    and stops at the draw where the last source is drawn for its `length`-th time (sources wrap around until then):
    the count is that draw's position + 1. numpy is imported here only (a runtime test compares the count with
    datasets' own on several mixes); without numpy the job counts at start."""
    problem = probs_problem(len(lengths), probs)
    if problem or 0 in lengths:
        return None, f"interleaved with probabilities: {problem or 'a source has no rows'}"
    try:
        import numpy as np
    except ImportError:
        return None, "interleaved with probabilities: numpy (which draws the mix) is not installed here"
    rng = np.random.default_rng(seed)
    draws, counts = [], np.zeros(len(lengths), dtype=np.int64)
    try:
        while not (counts >= lengths).all():
            block = rng.choice(len(lengths), size=1000, p=probs)
            draws.append(block)
            counts += np.bincount(block, minlength=len(lengths))
    except ValueError as exc:  # numpy's own check of the probabilities (they must sum to 1)
        return None, f"interleaved with probabilities {probs}: {exc}"
    drawn = np.concatenate(draws)
    last = max(int(np.flatnonzero(drawn == s)[n - 1]) for s, n in enumerate(lengths))
    return last + 1, f"interleaved (all_exhausted, seed {seed}, probabilities {list(probs)}): {last + 1} rows"


def _ceil_times(steps: int, ratio: float) -> int:
    """ceil(steps × ratio) in float arithmetic, as Molt computes it (ceil(120 × 0.1) is 12); exactly when the step
    count has no float (past 2**1024: a recipe's huge epoch count must be a number, not an OverflowError)."""
    try:
        return math.ceil(steps * ratio)
    except OverflowError:
        return math.ceil(Fraction(steps) * Fraction(ratio))


def _warmup(role: str, steps: int, ratio: float) -> Value:
    return (
        f"{role}.warmup_steps",
        _ceil_times(steps, ratio),
        f"ceil({steps} × warmup_ratio {ratio})",
        (f"{role}.scheduler_steps", f"{role}.optimizer.warmup_ratio"),
    )


def rl_schedule(count: int, x: RlCountInputs) -> list[Value]:
    """RL: trainer steps per episode and in all, optimizer steps, and the actor's (and critic's) LR schedule."""
    spe = count // x.rollout_batch_size
    refill = "; fewer when dynamic filtering drops groups (backfilled with new prompts)" if x.dynamic_filtering else ""
    if x.force_on_policy:
        opt = spe * x.episodes * x.max_epochs
        opt_why = (
            f"force_on_policy: {count} // batch {x.rollout_batch_size} × episodes {x.episodes} × max_epochs "
            f"{x.max_epochs} (B11)"
        )
    else:
        opt = count * x.n_samples_per_prompt // x.train_batch_size * x.episodes * x.max_epochs
        opt_why = (
            f"{count} prompts × n {x.n_samples_per_prompt} // train.batch_size {x.train_batch_size} × episodes "
            f"{x.episodes} × max_epochs {x.max_epochs} (B11)"
        )
    freeze = x.freezing_steps
    actor_steps = max(1, opt - freeze)
    out: list[Value] = [
        (
            "train.steps_per_episode",
            spe,
            f"{count} prompts // rollout.batch_size {x.rollout_batch_size} (B11){refill}",
            ("data.prompt_count", "rollout.batch_size", "algo.dynamic_filtering"),
        ),
        (
            "train.total_steps",
            spe * x.episodes,
            f"{spe} steps × episodes {x.episodes}",
            ("train.steps_per_episode", "train.episodes"),
        ),
        (
            "train.optimizer_steps",
            opt,
            opt_why,
            (
                "data.prompt_count",
                "rollout.n_samples_per_prompt",
                "train.batch_size",
                "train.episodes",
                "train.max_epochs",
            ),
        ),
        (
            "actor.scheduler_steps",
            actor_steps,
            f"max(1, optimizer steps {opt} - freezing_steps {freeze}) (B10)"
            if freeze
            else f"max(1, optimizer steps {opt}) (B10)",
            ("train.optimizer_steps", "actor.freezing_steps"),
        ),
        _warmup("actor", actor_steps, x.actor_warmup_ratio),
    ]
    if x.critic_warmup_ratio is not None:
        out.append(
            (
                "critic.scheduler_steps",
                opt,
                "the critic schedules over every optimizer step (B10)",
                ("train.optimizer_steps",),
            )
        )
        out.append(_warmup("critic", opt, x.critic_warmup_ratio))
    return out


def sft_schedule(count: int, x: SftCountInputs) -> list[Value]:
    """SFT: optimizer steps per epoch and in all, the LR schedule, and a per-epoch eval cadence (eval.every -1)."""
    spe = count // x.batch_size
    total = spe * x.max_epochs
    out: list[Value] = [
        (
            "train.steps_per_epoch",
            spe,
            f"{count} samples // batch_size {x.batch_size} (M6)",
            ("data.sample_count", "train.batch_size"),
        ),
        (
            "train.total_steps",
            total,
            f"{spe} steps × max_epochs {x.max_epochs}",
            ("train.steps_per_epoch", "train.max_epochs"),
        ),
        ("actor.scheduler_steps", max(1, total), "every optimizer step", ("train.total_steps",)),
        _warmup("actor", max(1, total), x.warmup_ratio),
    ]
    if x.eval_every_epoch:
        out.append(
            ("eval.every", spe, "SFT eval.every -1: once per epoch (B12)", ("eval.every", "train.steps_per_epoch"))
        )
    return out


class DataNotCounted(ValueError):
    """The job cannot derive its schedule at start: its training rows cannot be counted, or they give 0 steps (the
    message names the source, or the key, and why)."""


def _zero_steps(key: str, batch: int, count: int) -> str:
    # BATCH009's check, which the compiler could not run without the count
    return f"{key} {batch} is larger than the dataset ({count} rows after max_samples): 0 steps (BATCH009)"


def at_job_start(plan: Plan, count_other: CountOther | None = None) -> tuple[Plan, list[str]]:
    """The plan with the values its compiler deferred (DATA010) filled in from the rows the job sees now, and the
    lines that say what was derived; the plan unchanged (and no lines) when the compiler counted the rows.

    Paths are read as the runtime reads them (relative to the working directory, the job root)."""
    if plan.kind == "rl" and plan.rl is not None and plan.rl.data.count_at_start is not None:
        rl = plan.rl
        d = rl.data
        rl_inputs = d.count_at_start
        assert rl_inputs is not None  # checked above
        seed = rl.generator.seed if d.probs else None  # the generator blends with its seed
        count, why = count_rows(d.prompts, d.max_samples, d.probs, d.split, count_other=count_other, seed=seed)
        if count is None:
            raise DataNotCounted(f"data.prompts: the job cannot count its prompts at start: {why}")
        values = rl_schedule(count, rl_inputs)
        v = {name: value for name, value, _, _ in values}
        if rl.trainer is not None and v["train.total_steps"] == 0:
            raise DataNotCounted(_zero_steps("rollout.batch_size", rl_inputs.rollout_batch_size, count))
        update: dict[str, Any] = {
            "data": d.model_copy(update={"prompt_count": count}),
            "schedule": rl.schedule.model_copy(
                update={"steps_per_episode": v["train.steps_per_episode"], "total_steps": v["train.total_steps"]}
            ),
        }
        if rl.trainer is not None:
            update["trainer"] = rl.trainer.model_copy(
                update={"optimizer": _optimizer(rl.trainer.optimizer, v, "actor")}
            )
        if rl.critic is not None and "critic.scheduler_steps" in v:
            update["critic"] = rl.critic.model_copy(update={"optimizer": _optimizer(rl.critic.optimizer, v, "critic")})
        plan = plan.model_copy(update={"rl": rl.model_copy(update=update)})
        return plan, _lines("data.prompt_count", count, why, values)
    if plan.kind == "sft" and plan.sft is not None and plan.sft.data.count_at_start is not None:
        sft = plan.sft
        sd = sft.data
        sft_inputs = sd.count_at_start
        assert sft_inputs is not None  # checked above
        count, why = count_rows(
            sd.dataset,
            sd.max_samples,
            sd.probs,
            sd.split,
            count_other=count_other,
            seed=sft.trainer.seed if sd.probs else None,
        )
        if count is None:
            raise DataNotCounted(f"data.dataset: the job cannot count its rows at start: {why}")
        values = sft_schedule(count, sft_inputs)
        v = {name: value for name, value, _, _ in values}
        if v["train.total_steps"] == 0:
            raise DataNotCounted(_zero_steps("train.batch_size", sft_inputs.batch_size, count))
        schedule = {"steps_per_epoch": v["train.steps_per_epoch"], "total_steps": v["train.total_steps"]}
        if "eval.every" in v:
            schedule["eval_every"] = v["eval.every"]
        update = {
            "data": sd.model_copy(update={"sample_count": count}),
            "schedule": sft.schedule.model_copy(update=schedule),
            "trainer": sft.trainer.model_copy(update={"optimizer": _optimizer(sft.trainer.optimizer, v, "actor")}),
        }
        plan = plan.model_copy(update={"sft": sft.model_copy(update=update)})
        return plan, _lines("data.sample_count", count, why, values)
    return plan, []


def _optimizer(opt: Any, v: dict[str, Any], role: str) -> Any:
    return opt.model_copy(
        update={"warmup_steps": v[f"{role}.warmup_steps"], "total_steps": v[f"{role}.scheduler_steps"]}
    )


def _lines(count_name: str, count: int, why: str, values: list[Value]) -> list[str]:
    width = max(len(name) for name, _, _, _ in values)
    return [
        f"derived at job start (the compiler could not count the data, DATA010): {count_name} = {count} ({why})"
    ] + [f"  {name:<{width}} = {value}  ({reason})" for name, value, reason, _ in values]
