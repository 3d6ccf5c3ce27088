"""Partial rollout in the engine tests: one prompt group generated across a weight sync, through the real chain
(engine actor -> router -> step runner -> Trajectory -> Experience), and the checks both engines must pass.

The generation is made to straddle the sync deliberately: the group's long requests are submitted first, then a
one-token request; when that one has come back the long ones have sampled at least their first token (they were
admitted no later than it), and with hundreds of tokens still to go the pause lands mid-generation.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import ray
import torch

from runtime.agents import SamplingParams
from runtime.engines.router import Router
from runtime.experience import Experience, partial_rollout_metrics
from runtime.runners import AgentRunnerActor, GroupRequest

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "recipes" / "agents" / "demo_math.py"
ROLLOUTS = 4
MAX_TOKENS = 400


class _Counting:
    """The router, counting the `generate` calls sent through it (each is submitted to the engine by then)."""

    def __init__(self, inner):
        self.inner, self.sent = inner, 0

    async def generate(self, *args, **kwargs):
        self.sent += 1
        return await self.inner.generate(*args, **kwargs)


def generate_across_a_sync(engine, sender, model_dir, new_state: dict) -> tuple[Experience, int, int]:
    """A group of ROLLOUTS long samples; the engine is paused, gets `new_state` as the next version and resumes
    while they are in flight. Returns (the group's Experience, the version before, the version after)."""
    old = ray.get(engine.weights_version.remote())
    new = old + 1
    client = _Counting(Router([engine], "consistent_hash"))
    runner = AgentRunnerActor(str(AGENT), str(model_dir), client, 512, {},
                              apply_chat_template=True, step_timeout_s=60.0, episode_timeout_s=300.0)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, logprobs=True)

    async def main():
        group = asyncio.ensure_future(runner.run_group(GroupRequest(0, "1+2=", "3", ROLLOUTS, sampling)))
        while client.sent < ROLLOUTS:  # the group's requests are on their way to the engine
            await asyncio.sleep(0.005)
        await engine.generate.remote([5, 6, 7], max_tokens=1, temperature=1.0, top_p=1.0, session_id="starter",
                                     logprobs=True)
        await engine.pause.remote()
        await asyncio.to_thread(sender.push, new_state, new)
        await engine.resume.remote()
        return await group

    result = asyncio.run(main())
    assert result.experience is not None and result.experience.batch_size == ROLLOUTS, result
    return result.experience, old, new


def teacher_forced(model, exp: Experience, row: int) -> torch.Tensor:
    """(T-1,) log p(sequences[row, t+1] | ...) under `model` at temperature 1 (what the engine sampled from)."""
    n = int(exp.attention_mask[row].sum())
    ids = exp.sequences[row, :n]
    with torch.inference_mode():
        logits = model(input_ids=ids.unsqueeze(0)).logits[0, :-1].float()
    out = torch.zeros(exp.sequences.shape[1] - 1)
    out[: n - 1] = torch.log_softmax(logits, -1).gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)
    return out


def check_versions_and_metrics(exp: Experience, old: int, new: int, old_model, tol: float) -> list[int]:
    """Every sample's tokens are old-version first, new-version after; at least one sample has both; its
    old-version tokens' rollout log-probs are the old weights'; the metrics count exactly those tokens. Returns the
    rows that crossed the sync."""
    mask = exp.action_mask
    assert exp.policy_versions is not None and exp.policy_versions.shape == mask.shape
    assert bool((exp.policy_versions[~mask] == -1).all())
    crossed = []
    for row in range(exp.batch_size):
        v = exp.policy_versions[row][mask[row]].tolist()
        assert set(v) <= {old, new} and v == sorted(v), v  # one sync: a prefix of old, a suffix of new
        if old in v and new in v:
            crossed.append(row)
    assert crossed, "no sample straddled the sync; lengthen the generation"
    old_tokens = new_tokens = 0
    for row in crossed:
        before = mask[row] & (exp.policy_versions[row] == old)
        after = mask[row] & (exp.policy_versions[row] == new)
        old_tokens += int(before.sum())
        new_tokens += int(after.sum())
        diff = (exp.rollout_log_probs[row] - teacher_forced(old_model, exp, row)).abs()
        assert float(diff[before].max()) < tol  # the engine's log-probs are those of the version that sampled
        assert float(diff[after].mean()) > 10 * tol  # ... and after the sync they are no longer the old weights'
    metrics = partial_rollout_metrics(exp, trained_version=new)
    total = int(mask.sum())
    assert metrics["rollout/partial_samples_frac"] == pytest.approx(len(crossed) / exp.batch_size)
    assert metrics["rollout/partial_tokens_frac"] == pytest.approx(old_tokens / total)
    assert metrics["rollout/policy_version_min"] == old and metrics["rollout/policy_version_max"] == new
    assert metrics[f"rollout/tokens_at_lag/{new - old}"] == float(int((mask & (exp.policy_versions == old)).sum()))
    assert metrics["rollout/tokens_at_lag/0"] == float(int((mask & (exp.policy_versions == new)).sum()))
    return crossed
