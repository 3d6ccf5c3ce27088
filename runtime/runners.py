"""Agent runner actors: each loads the recipe's agent file and runs whole prompt groups concurrently.

A runner turns one `GroupRequest` (a prompt, its label, n) into one `GroupResult`: n episodes run at once with
`asyncio.gather` against the engine router, each finished trajectory is checked (the per-rollout drop reasons of
`reference/molt_rules.md` §2.N), and the survivors become one token-first `Experience` right here, so the generator
only concatenates tensors. An exception inside one episode (an `Env.step` that raises) drops that rollout with reason
`agent_error`; its group survives. A request the engine raised on (alive: `agents.EngineError`) drops its rollout
as `engine_error`. An episode past `agent.episode_timeout_s` is dropped as `episode_timeout`, one
whose `Env.step` ran past `agent.step_timeout_s` as `step_timeout` (runtime/agents/base.py).

Runners are Ray actors that Ray restarts without limit: a killed runner comes back, the generator re-sends the
groups it had in flight and gives a runner up past `agent.max_restarts` deaths per `agent.restart_window_s` (see
`runtime/generator.py`). An `Env` runs on its own thread (`runtime/agents/bounds.py`), so a blocking step is given up
at `agent.step_timeout_s`; what a step hands back is cut to what fits before it is tokenized (`rollout/cut/*`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from runtime import vlm
from runtime.agents import EngineError, GenerateClient, GenerationAborted, SamplingParams, load_agent_runner
from runtime.agents.base import StepTimeout
from runtime.agents.bounds import TooManyImages
from runtime.experience import Experience, from_token_lists

logger = logging.getLogger(__name__)

class EngineLost(RuntimeError):
    """An engine call of the group failed because the engine actor died: the generator leaves the prompt undone (a
    resumed run sends it again) and the driver's supervisor ends the run, naming the engine."""


@dataclass(frozen=True)
class GroupRequest:
    group_id: int                  # unique per dispatched prompt (also the prompt's index in consumption order)
    prompt: Any                    # the dataset's prompt: text or chat messages (the runner renders it if needed)
    label: Any
    n: int                         # rollouts in the group
    sampling: SamplingParams
    attempt: int = 0               # re-dispatches after a runner died
    tools: list | None = None      # the row's tool schemas (`data.tools_key`), or None
    images: list | None = None     # the row's images (`data.image_key`: PIL, paths, bytes), or None
    image_dir: str | None = None   # the dataset file's directory: relative image paths resolve against it


@dataclass
class GroupResult:
    group_id: int
    experience: Experience | None  # survivors only; None when every rollout was dropped
    rewards: list[float]           # survivors' rewards (summed over steps)
    scores: list[float]            # survivors' scores
    dropped: Counter = field(default_factory=Counter)  # rollout drop reason -> count
    info: dict[str, float] = field(default_factory=dict)   # sums of the numeric Result.info values over survivors
    errors: list[str] = field(default_factory=list)        # one line per agent_error or engine_error, for the log
    cuts: Counter = field(default_factory=Counter)  # what the runner cut from the agents' outputs (rollout/cut/*)


def render(tokenizer, prompt, apply_chat_template: bool, tools: list | None = None):
    """The text a step runner starts from: the chat template applied to the prompt (a string is one user turn),
    with the row's tools when it has some (the template decides how the model sees them)."""
    if not apply_chat_template:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)


class AgentRunnerActor:
    def __init__(self, agent_path: str, tokenizer_path: str, client: GenerateClient, max_length: int,
                 agent_env: dict[str, str], apply_chat_template: bool, max_images_per_prompt: int = 0, *,
                 step_timeout_s: float, episode_timeout_s: float):
        os.environ.update(agent_env)  # before the agent module's top-level code reads them
        # Ray's workers install uvloop's policy, so each Env thread's loop would be a uvloop loop; uvloop loops in
        # several threads race on spawning processes ("Racing with another loop to spawn a process", then a
        # runner that stopped answering). asyncio's own loops reap children from any thread. The actor's running
        # loop is not touched.
        asyncio.set_event_loop_policy(asyncio.DefaultEventLoopPolicy())
        from transformers import AutoTokenizer

        self.runner = load_agent_runner(agent_path)
        self.runner.step_timeout_s = step_timeout_s  # step runners bound each Env.step with it
        self.runner.max_images = max_images_per_prompt  # and the images an episode may gather
        self.episode_timeout_s = episode_timeout_s
        # A VLM run (max_images_per_prompt > 0) renders and encodes prompts with the model's processor.
        self.max_images = max_images_per_prompt
        self.processor = vlm.load_processor(tokenizer_path) if max_images_per_prompt > 0 else None
        self.tokenizer = (self.processor.tokenizer if self.processor is not None
                          else AutoTokenizer.from_pretrained(tokenizer_path))
        self.client = client
        self.max_length = max_length
        self.apply_chat_template = apply_chat_template
        self.pad_id = self.tokenizer.pad_token_id

    def pid(self) -> int:
        return os.getpid()

    async def run_group(self, req: GroupRequest) -> GroupResult:
        # Step runners get the rendered text; chat runners (PRERENDER_PROMPT False) get the dataset's messages and
        # their loopback server renders them once, like an OpenAI-compatible endpoint would.
        vision = {}
        if self.processor is not None:
            refs = vlm.as_image_list(req.images)
            if len(refs) > self.max_images:  # data.max_images_per_prompt: vLLM would reject the request
                return GroupResult(req.group_id, None, [], [], Counter(too_many_images=req.n), {}, [])
            base = Path(req.image_dir) if req.image_dir else None
            images = [vlm.load_image(r, base) for r in refs]
            vision = {"images": images, "processor": self.processor}
            prompt = (vlm.render(self.processor, req.prompt, len(images), req.tools)
                      if self.runner.PRERENDER_PROMPT else req.prompt)
        else:
            prompt = (render(self.tokenizer, req.prompt, self.apply_chat_template, req.tools)
                      if self.runner.PRERENDER_PROMPT else req.prompt)
        episodes = [asyncio.wait_for(
            self.runner.execute(prompt, req.label, sampling=req.sampling, max_length=self.max_length,
                                tokenizer=self.tokenizer, client=self.client, tools=req.tools, **vision),
            self.episode_timeout_s) for _ in range(req.n)]
        outcomes = await asyncio.gather(*episodes, return_exceptions=True)
        lost = next((o for o in outcomes if isinstance(o, ray.exceptions.RayActorError)), None)
        if lost is not None:  # an engine died under the group: not the prompt's fault, it must not count as done
            raise EngineLost(f"group {req.group_id}: an engine died under it ({type(lost).__name__})")
        kept, dropped, errors = [], Counter(), []
        cuts = sum((t.cuts for out in outcomes if not isinstance(out, BaseException)
                    for t in (out if isinstance(out, list) else [out])), Counter())
        image_token = self.processor.image_token_id if self.processor is not None else None
        for out in outcomes:
            reason = _drop_reason(out)
            if reason is None and image_token is not None and _generated_image_token(out, image_token):
                reason = "image_token_generated"
            if reason is None:
                kept.append(out if isinstance(out, list) else [out])
                continue
            dropped[reason] += 1
            if reason in ("agent_error", "engine_error"):
                errors.append(f"{type(out).__name__}: {out}")
                logger.warning("group %d: rollout dropped (%s): %r", req.group_id, reason, out)
        result = _group_result(req, kept, dropped, errors, self.pad_id)
        result.cuts.update(cuts)
        return result


def _drop_reason(out) -> str | None:
    """Why an episode cannot be trained on, or None. A chat episode may come as several step-samples (a list); one
    bad sample drops the whole rollout, so that its reward is never counted from a partial trace."""
    if isinstance(out, GenerationAborted):
        return "aborted"
    if isinstance(out, EngineError):
        return "engine_error"
    if isinstance(out, StepTimeout):
        return "step_timeout"
    if isinstance(out, TimeoutError):  # asyncio.wait_for around the episode
        return "episode_timeout"
    if isinstance(out, vlm.VlmTruncation):
        return "vlm_truncation"
    if isinstance(out, TooManyImages):
        return "too_many_images"
    if isinstance(out, BaseException):
        return "agent_error"
    for sample in out if isinstance(out, list) else [out]:
        if not sample.token_ids:
            return "empty_tokens"
        if sample.num_action_tokens == 0:
            return "no_action_tokens"
        if sample.rollout_log_probs is not None and len(sample.rollout_log_probs) != len(sample.token_ids):
            return "logprob_misalign"
        if sample.top_logprobs is not None and len(sample.top_logprobs) != len(sample.action_ranges):
            return "logprob_misalign"
        if sample.policy_versions is not None and len(sample.policy_versions) != len(sample.token_ids):
            return "logprob_misalign"  # the version column is aligned like the logprob one
    return None if out else "empty_tokens"


def _generated_image_token(out, image_token: int) -> bool:
    """The policy sampled an image placeholder: no image stands behind it, so the trainer's vision forward would
    misalign every later image of the row (tokens > features). The rollout is dropped."""
    return any(image_token in sample.token_ids[start:end]
               for sample in (out if isinstance(out, list) else [out]) for start, end in sample.action_ranges)


def _group_result(req: GroupRequest, kept: list[list], dropped: Counter, errors: list[str],
                  pad_id: int) -> GroupResult:
    """`kept`: per surviving rollout, its samples (one for step runners, one per segment for chat runners)."""
    if not kept:
        return GroupResult(req.group_id, None, [], [], dropped, {}, errors)
    samples = [t for rollout in kept for t in rollout]
    exp = from_token_lists([t.token_ids for t in samples], [t.action_ranges for t in samples],
                           [t.rollout_log_probs or [] for t in samples], pad_id,
                           mm_inputs=[t.mm_inputs for t in samples], routed_experts=_routing(samples),
                           top_logprobs=_top_logprobs(samples),
                           policy_versions=[t.policy_versions or [] for t in samples])
    exp.rewards = torch.tensor([float(t.reward) for t in samples], dtype=torch.float32)
    exp.scores = torch.tensor([float(t.score) for t in samples], dtype=torch.float32)
    exp.truncated = torch.tensor([bool(t.truncated) for t in samples])
    exp.group_ids = torch.full((len(samples),), req.group_id, dtype=torch.long)
    # Samples of one rollout share its id: the group estimators merge them back into one reward (algo/reward.py).
    exp.rollout_ids = torch.tensor([req.group_id * req.n + i for i, rollout in enumerate(kept) for _ in rollout],
                                   dtype=torch.long)
    rewards = [float(rollout[0].reward) for rollout in kept]  # per rollout: the episode's reward, counted once
    scores = [float(rollout[0].score) for rollout in kept]
    info: dict[str, float] = {}
    for rollout in kept:
        for k, v in (rollout[0].info or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                info[k] = info.get(k, 0.0) + float(v)
    return GroupResult(req.group_id, exp, rewards, scores, dropped, info, errors)


def _top_logprobs(samples: list) -> list | None:
    """Each sample's per-action-range top-k (score centering), or None when the run asks for none."""
    if all(t.top_logprobs is None for t in samples):
        return None
    return [t.top_logprobs or [] for t in samples]


def _routing(samples: list) -> list | None:
    """Each sample's (T, L, k) routing (R3); a sample no engine call routed gets -1 rows; None if none has any."""
    rows = [t.routing_rows() for t in samples]
    shaped = next((r for r in rows if r is not None), None)
    if shaped is None:
        return None
    return [r if r is not None else np.full((len(t.token_ids), *shaped.shape[1:]), -1, np.int16)
            for r, t in zip(rows, samples, strict=True)]
