"""Schedule section (RL): dataset counts, trainer and optimizer steps, LR schedule, eval and checkpoint cadences."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from molt_compile.derive.roles import default_critic
from molt_compile.derive.values import Builder
from molt_compile.paths import resolve_sources
from schemas.plan import RlCountInputs
from schemas.schedule import count_rows, probs_problem, rl_schedule

if TYPE_CHECKING:
    from molt_compile.source import SourceMap
    from schemas.recipe import RlRecipe, SftRecipe

DEFERRED = "counted at job start (DATA010)"
"""Reason of a value that follows from rows the compiler could not count."""


_RL_COUNTED = (
    "train.steps_per_episode",
    "train.total_steps",
    "train.optimizer_steps",
    "actor.scheduler_steps",
    "actor.warmup_steps",
)


_CRITIC_COUNTED = ("critic.scheduler_steps", "critic.warmup_steps")


def job_root(source: SourceMap | None) -> str | None:
    return source.job_root if source is not None else None


def derive_rl_schedule(b: Builder, r: RlRecipe, source: SourceMap | None) -> None:
    ro, t, d = r.rollout, r.train, r.data
    sources = resolve_sources(d.prompts, "data.prompts", source)
    count, why = count_rows(
        sources,
        d.max_samples,
        d.prompt_probs,
        d.split,
        job_root(source),
        seed=t.seed if d.prompt_probs else None,  # the interleave's seed (the generator's, train.seed)
    )
    keys = ("data.prompts", "data.max_samples", "data.prompt_probs") + (("train.seed",) if d.prompt_probs else ())
    b.add("data.prompt_count", count, why, keys)
    critic = (r.critic if r.critic is not None else default_critic()) if b.v("critic.exists") else None
    inputs = RlCountInputs(
        rollout_batch_size=ro.batch_size,
        n_samples_per_prompt=ro.n_samples_per_prompt,
        train_batch_size=t.batch_size,
        episodes=t.episodes,
        max_epochs=t.max_epochs,
        force_on_policy=t.force_on_policy,
        dynamic_filtering=bool(r.algo.dynamic_filtering),
        freezing_steps=r.actor.freezing_steps if critic is not None else 0,
        actor_warmup_ratio=r.actor.optimizer.warmup_ratio,
        critic_warmup_ratio=critic.optimizer.warmup_ratio if critic is not None else None,
    )
    per_step: tuple[Any, str, tuple[str, ...]]
    if t.force_on_policy:
        per_step = (1, "force_on_policy: one optimizer step per rollout batch (G10)", ("train.force_on_policy",))
    else:
        sps = b.v("rollout.samples_per_step")
        per_step = (
            sps // t.batch_size * t.max_epochs,
            f"samples {sps} // train.batch_size {t.batch_size} × max_epochs {t.max_epochs}; a partial window is "
            "dropped (G8)",
            ("rollout.samples_per_step", "train.batch_size", "train.max_epochs"),
        )
    if count is not None:
        values = rl_schedule(count, inputs)
    else:
        names = _RL_COUNTED + (_CRITIC_COUNTED if critic is not None else ())
        values = [(name, None, DEFERRED, ("data.prompt_count",)) for name in names]
        if not d.prompt_probs or probs_problem(len(sources), d.prompt_probs) is None:  # else DATA001/DATA012
            b.add(
                "data.count_at_start",
                inputs.model_dump(),
                "the job counts the prompts at start and derives the values marked DATA010 with schemas/schedule.py",
                ("data.prompts",),
            )
    for name, value, why, keys in values:
        b.add(name, value, why, keys)
        if name == "train.optimizer_steps":
            b.add("train.optimizer_steps_per_step", *per_step)


def derive_rl_eval_ckpt(b: Builder, r: RlRecipe) -> None:
    e, ro = r.eval, r.rollout
    enabled = e.dataset is not None
    b.add("eval.enabled", enabled, "eval.dataset set" if enabled else "no eval.dataset", ("eval.dataset",))
    if e.every == -1 or not enabled:
        b.add("eval.every", None, "eval.every -1: never (B12)" if enabled else "no eval", ("eval.every",))
    else:
        b.add("eval.every", e.every, f"every {e.every} steps", ("eval.every",))
    for key in ("batch_size", "n_samples_per_prompt", "temperature", "top_p", "max_new_tokens"):
        own = getattr(e, key)
        if own is not None:
            b.add(f"eval.{key}", own, "set in the recipe", (f"eval.{key}",))
        else:
            b.add(
                f"eval.{key}",
                getattr(ro, key),
                f"eval.{key} unset: rollout.{key} (B13)",
                (f"eval.{key}", f"rollout.{key}"),
            )
    derive_ckpt(b, r)


def derive_ckpt(b: Builder, r: RlRecipe | SftRecipe) -> None:
    c = r.ckpt
    b.add(
        "ckpt.every",
        None if c.every == -1 else c.every,
        "ckpt.every -1: never (B12)" if c.every == -1 else f"every {c.every} steps",
        ("ckpt.every",),
    )
    if c.dcp_keep is None:
        b.add("ckpt.dcp_keep", c.keep, "ckpt.dcp_keep unset: ckpt.keep (B7)", ("ckpt.dcp_keep", "ckpt.keep"))
    else:
        b.add("ckpt.dcp_keep", c.dcp_keep, "set in the recipe", ("ckpt.dcp_keep",))
