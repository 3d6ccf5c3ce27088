"""Algorithm section: KL, IS correction, the Molt 0.2.1 off-policy settings, the agent and the old-logprob pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from molt_compile.derive.values import Builder

if TYPE_CHECKING:
    from schemas.recipe import RlRecipe

DISTILL_AGENT_PATH = "builtin:distill"
"""Agent used by on_policy_distill when the recipe names none: single-turn, reward 0 (Molt B2)."""


def kl_ref_of(r: RlRecipe) -> str:
    """`algo.kl.ref` resolved (Molt 0.2.1 X2, X3): as set, else `model` under on_policy_distill, else `rollout`."""
    if r.algo.estimator == "on_policy_distill":
        return "model"
    return r.algo.kl.ref or "rollout"


def is_band(isc: Any) -> tuple[float | None, float]:
    """(low, high) of the IS band; a single value HIGH is (None, HIGH), i.e. [-inf, HIGH] (Molt 0.2.1 X1).
    Only valid for one or two values (V5 is rule IS001)."""
    t = isc.threshold
    values = [t] if isinstance(t, int | float) else list(t)
    if len(values) == 1:
        return None, float(values[0])
    return float(values[0]), float(values[-1])


def derive_molt021_rollout(b: Builder, r: RlRecipe, is_on: bool) -> None:
    """Molt 0.2.1's derivations X1, X2/X3, X4, X5, X6 (train_rl_ray.py:1049-1201, 96-150)."""
    ro, algo = r.rollout, r.algo
    low, high = is_band(algo.is_correction)
    b.add(
        "algo.is_correction.band",
        [low, high],
        "one threshold value HIGH: [-inf, HIGH] (X1)" if low is None else "algo.is_correction.threshold",
        ("algo.is_correction.threshold",),
        forced=low is None,
    )
    ref_kind = kl_ref_of(r)
    if r.algo.estimator == "on_policy_distill":
        why = "on_policy_distill forces kl.ref model: the teacher (X2)"
    elif algo.kl.ref:
        why = "algo.kl.ref"
    else:
        why = "algo.kl.ref unset: the rollout policy (Molt 0.2.1 default, X3)"
    b.add(
        "algo.kl.ref",
        ref_kind,
        why,
        ("algo.kl.ref", "algo.estimator"),
        forced=algo.kl.ref is not None and algo.kl.ref != ref_kind,
    )
    coef = algo.kl.coef if "coef" in algo.kl.model_fields_set or r.algo.estimator != "on_policy_distill" else 1.0
    to_rollout = coef > 0 and ref_kind == "rollout"
    b.add(
        "algo.kl.to_rollout",
        to_rollout,
        "kl.coef > 0 and kl.ref rollout: the KL reference is the engine's sampled-token log-probs (B29)"
        if to_rollout
        else "no KL against the rollout policy",
        ("algo.kl.coef", "algo.kl.ref"),
    )
    k = algo.score_centering_top_k
    b.add(
        "algo.score_centering",
        k >= 2,
        f"score_centering_top_k {k}" + ("" if k >= 2 else ": off"),
        ("algo.score_centering_top_k",),
    )
    b.add(
        "rollout.top_logprobs",
        k if k >= 2 else 0,
        "score centering: the engine returns the top-k log-probs of every generated token (§3.4)"
        if k >= 2
        else "no top-k log-probs",
        ("algo.score_centering_top_k",),
    )
    need = is_on or k >= 2 or to_rollout
    why = " or ".join(
        w
        for w, on in (("IS correction", is_on), ("score centering", k >= 2), ("KL to the rollout policy", to_rollout))
        if on
    )
    b.add(
        "rollout.logprobs",
        need,
        f"{why} reads the engine's log-probs (X6)"
        if need
        else "no IS, score centering or KL to the rollout: no log-probs requested (B14, X6)",
        ("algo.is_correction.level", "algo.score_centering_top_k", "algo.kl.coef"),
    )
    b.add(
        "rollout.logprobs_mode",
        "processed_logprobs" if need else "raw_logprobs",
        f"{why} needs the log-probs of the processed (tempered) distribution (X6)"
        if need
        else "vLLM's raw logprobs (B14)",
        ("algo.is_correction.level", "algo.score_centering_top_k"),
    )
    gen = ro.generate_batch_size or ro.batch_size
    forced_partial = gen > ro.batch_size and not r.train.async_.partial_rollout
    b.add(
        "train.partial_rollout",
        r.train.async_.partial_rollout or forced_partial,
        f"generate_batch_size {gen} > rollout.batch_size {ro.batch_size}: Molt 0.2.1 turns partial rollout on (X4); "
        "the off-policy rules read this, the plan keeps the recipe's engine-lock setting"
        if forced_partial
        else "train.async.partial_rollout",
        ("train.async.partial_rollout", "rollout.generate_batch_size"),
        forced=forced_partial,
    )
    forced_prefix = r.train.routing_replay and not ro.prefix_caching
    b.add(
        "rollout.prefix_caching",
        ro.prefix_caching or forced_prefix,
        "routing_replay forces prefix caching on (vLLM's routed-experts capture needs it, X5)"
        if forced_prefix
        else "rollout.prefix_caching",
        ("rollout.prefix_caching", "train.routing_replay"),
        forced=forced_prefix,
    )
    lora = r.actor.lora
    b.add(
        "actor.lora",
        lora.dim > 0,
        f"actor.lora.dim {lora.dim}" + ("" if lora.dim > 0 else ": full fine-tuning"),
        ("actor.lora.dim",),
    )


def derive_algo(b: Builder, r: RlRecipe) -> None:
    kl = r.algo.kl
    distill = r.algo.estimator == "on_policy_distill"
    if distill:
        coef_set = "coef" in kl.model_fields_set
        b.add(
            "algo.kl.coef",
            kl.coef if coef_set else 1.0,
            "set in the recipe" if coef_set else "on_policy_distill: coef defaults to 1.0 (B2)",
            ("algo.kl.coef", "algo.estimator"),
        )
        b.add(
            "algo.kl.estimator",
            "k1",
            "on_policy_distill forces k1 (B2)",
            ("algo.kl.estimator", "algo.estimator"),
            forced=kl.estimator != "k1",
        )
        b.add(
            "algo.kl.use_loss",
            False,
            "on_policy_distill folds the KL into the reward (B2)",
            ("algo.kl.use_loss", "algo.estimator"),
            forced=kl.use_loss,
        )
    else:
        b.add("algo.kl.coef", kl.coef, "algo.kl.coef", ("algo.kl.coef",))
        b.add("algo.kl.estimator", kl.estimator, "algo.kl.estimator", ("algo.kl.estimator",))
        b.add("algo.kl.use_loss", kl.use_loss, "algo.kl.use_loss", ("algo.kl.use_loss",))
    b.add(
        "algo.kl.adaptive",
        bool(kl.target),
        "kl.target set: adaptive controller (C9)" if kl.target else "kl.target unset: fixed coefficient",
        ("algo.kl.target",),
    )
    _old_logprob_pass(b, r)
    if r.agent is not None:
        b.add("agent.path", r.agent.path, "agent.path (relative to the recipe file)", ("agent.path",))
        b.add("agent.max_turns", r.agent.max_turns, "exported to runners as MAX_AGENT_TURNS", ("agent.max_turns",))
    elif distill:
        b.add(
            "agent.path",
            DISTILL_AGENT_PATH,
            "on_policy_distill without an agent: the built-in single-turn, reward-0 distill agent (B2)",
            ("agent", "algo.estimator"),
        )
        b.add("agent.max_turns", 1, "built-in distill agent is single-turn", ("algo.estimator",))
    else:
        b.add("agent.path", None, "no `agent:` section (required unless on_policy_distill, A3)", ("agent",))
        b.add("agent.max_turns", 1, "no agent", ("agent",))


def _old_logprob_pass(b: Builder, r: RlRecipe) -> None:
    """B28: when the training forward sees the weights π_old was sampled against (force_on_policy, or one epoch
    whose rollout batch is exactly one train batch: one optimizer step, taken after every forward) and KL is off,
    the training forward's detached log-probs are π_old (ratio 1) and the no-grad pass before the step is skipped."""
    coef, ref = b.v("algo.kl.coef"), b.v("ref.exists")
    t, sps = r.train, b.v("rollout.samples_per_step")
    one_step = not t.force_on_policy and t.max_epochs == 1 and sps == t.batch_size
    inputs = (
        "train.force_on_policy",
        "train.max_epochs",
        "train.batch_size",
        "rollout.samples_per_step",
        "algo.kl.coef",
        "ref",
    )
    if t.force_on_policy:
        when = "force_on_policy"
    elif one_step:
        when = (
            f"one optimizer step per rollout batch (max_epochs 1, samples {sps} = train.batch_size "
            f"{t.batch_size}), taken after every forward of the batch"
        )
    else:
        b.add(
            "actor.old_logprob_pass",
            True,
            f"π_old: a no-grad forward before the step (samples {sps} vs train.batch_size {t.batch_size} × "
            f"max_epochs {t.max_epochs}: the policy moves within the batch)",
            inputs,
        )
        return
    if coef != 0 or ref:
        why = f"algo.kl.coef {coef} > 0" if coef != 0 else "a reference model (`ref:`) whose KL is taken against π_old"
        b.add("actor.old_logprob_pass", True, f"{when}, but {why}: π_old is computed before the step (B28)", inputs)
    else:
        b.add(
            "actor.old_logprob_pass",
            False,
            f"{when} with algo.kl.coef 0: the training forward's detached log-probs are π_old, the PPO "
            "ratio is 1; IS against the rollout log-probs still applies (B28)",
            inputs,
        )
