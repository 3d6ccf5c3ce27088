"""Agent runner actors: each loads the recipe's agent file and runs whole prompt groups concurrently.

A runner turns one `GroupRequest` (a prompt, its label, n) into one `GroupResult`: n episodes run at once with
`asyncio.gather` against the engine router, each finished trajectory is checked (the per-rollout drop reasons of
`reference/molt_rules.md` §2.N), and the survivors become one token-first `Experience` right here, so the generator
only concatenates tensors. An exception inside one episode (an `Env.step` that raises) drops that rollout with reason
`agent_error`; its group survives.

Runners are Ray actors with `max_restarts` from the plan: a killed runner comes back, and the generator re-sends the
groups it had in flight (see `runtime/generator.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.agents import GenerateClient, GenerationAborted, SamplingParams, load_agent_runner
from runtime.experience import Experience, from_token_lists

logger = logging.getLogger(__name__)

ROLLOUT_DROP_REASONS = ("agent_error", "aborted", "empty_tokens", "no_action_tokens", "logprob_misalign")


@dataclass(frozen=True)
class GroupRequest:
    group_id: int                  # unique per dispatched prompt (also the prompt's index in consumption order)
    prompt: Any                    # rendered prompt text (or chat messages for runners that render themselves)
    label: Any
    n: int                         # rollouts in the group
    sampling: SamplingParams
    attempt: int = 0               # re-dispatches after a runner died


@dataclass
class GroupResult:
    group_id: int
    experience: Experience | None  # survivors only; None when every rollout was dropped
    rewards: list[float]           # survivors' rewards (summed over steps)
    scores: list[float]            # survivors' scores
    dropped: Counter = field(default_factory=Counter)  # rollout drop reason -> count
    info: dict[str, float] = field(default_factory=dict)   # sums of the numeric Result.info values over survivors
    errors: list[str] = field(default_factory=list)        # one line per agent_error, for the log


class AgentRunnerActor:
    def __init__(self, agent_path: str, tokenizer_path: str, client: GenerateClient, max_length: int,
                 agent_env: dict[str, str]):
        os.environ.update(agent_env)  # before the agent module's top-level code reads them
        from transformers import AutoTokenizer

        self.runner = load_agent_runner(agent_path)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.client = client
        self.max_length = max_length
        self.pad_id = self.tokenizer.pad_token_id

    def pid(self) -> int:
        return os.getpid()

    async def run_group(self, req: GroupRequest) -> GroupResult:
        episodes = [self.runner.execute(req.prompt, req.label, sampling=req.sampling, max_length=self.max_length,
                                        tokenizer=self.tokenizer, client=self.client) for _ in range(req.n)]
        outcomes = await asyncio.gather(*episodes, return_exceptions=True)
        kept, dropped, errors = [], Counter(), []
        for out in outcomes:
            reason = _drop_reason(out)
            if reason is None:
                kept.append(out)
                continue
            dropped[reason] += 1
            if reason == "agent_error":
                errors.append(f"{type(out).__name__}: {out}")
                logger.warning("group %d: rollout dropped (agent_error): %r", req.group_id, out)
        return _group_result(req, kept, dropped, errors, self.pad_id)


def _drop_reason(out) -> str | None:
    if isinstance(out, GenerationAborted):
        return "aborted"
    if isinstance(out, BaseException):
        return "agent_error"
    if not out.token_ids:
        return "empty_tokens"
    if out.num_action_tokens == 0:
        return "no_action_tokens"
    if out.rollout_log_probs is not None and len(out.rollout_log_probs) != len(out.token_ids):
        return "logprob_misalign"
    return None


def _group_result(req: GroupRequest, kept: list, dropped: Counter, errors: list[str], pad_id: int) -> GroupResult:
    if not kept:
        return GroupResult(req.group_id, None, [], [], dropped, {}, errors)
    exp = from_token_lists([t.token_ids for t in kept], [t.action_ranges for t in kept],
                           [t.rollout_log_probs or [] for t in kept], pad_id)
    rewards = [float(t.reward) for t in kept]
    scores = [float(t.score) for t in kept]
    exp.rewards = torch.tensor(rewards, dtype=torch.float32)
    exp.scores = torch.tensor(scores, dtype=torch.float32)
    exp.truncated = torch.tensor([bool(t.truncated) for t in kept])
    exp.group_ids = torch.full((len(kept),), req.group_id, dtype=torch.long)
    exp.rollout_ids = req.group_id * req.n + torch.arange(len(kept))
    info: dict[str, float] = {}
    for t in kept:
        for k, v in (t.info or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                info[k] = info.get(k, 0.0) + float(v)
    return GroupResult(req.group_id, exp, rewards, scores, dropped, info, errors)
