"""The generation protocol between agent runners and rollout engines.

One place defines it so that both sides import the same records: the engines (vLLM, HF) and the router implement
`GenerateClient`; `StepEnvRunner` and the chat server call it. Token ids in, token ids and per-token logprobs out —
this module knows nothing about text, chat templates or tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from schemas.plan import SamplingPlan

FinishReason = Literal["stop", "length", "abort"]
"""Why generation ended: "stop" (EOS or a stop token), "length" (hit `max_tokens`), "abort" (the engine cancelled the
request, e.g. paused for a weight sync without partial rollout)."""


UNKNOWN_VERSION = -1
"""The policy version of a token no engine sampled (prompt, feedback, padding) or whose engine did not say."""


@dataclass(frozen=True)
class GenerateOutput:
    """What one `generate` call returns.

    `logprobs[i]` is log π_rollout(token_ids[i] | prefix) under the sampling distribution the engine used (temperature
    applied, no top-p renormalisation since the compiler forces top_p=1 with IS on). When the request asked for no
    logprobs the list is empty.
    """

    token_ids: list[int]  # (A,) generated ids, EOS included when the engine stopped on it
    logprobs: list[float] = field(default_factory=list)  # (A,) or () when logprobs=False
    finish_reason: FinishReason = "stop"
    # (P + A - 1, L, k) int16 numpy array: the experts each prompt and generated token (all but the last, which no
    # forward saw) was routed to in each of the L MoE layers; None unless the engines record routing (R3).
    routed_experts: Any = None
    # Score centering (`top_logprobs` = k > 0): (A, k) int64 / float32 numpy arrays, row i = the k most likely ids
    # of the distribution token_ids[i] was sampled from and their log-probs (same `logprobs_mode`); else None.
    top_ids: Any = None
    top_logprobs: Any = None
    # (A,) the weights version (`RolloutEngine.weights_version`: the trainer step that produced them, 0 = the
    # checkpoint the engine started from) that sampled each generated token. With partial rollout a request in flight
    # across a weight sync has old-version tokens first and new-version ones after; empty: the client does not say.
    policy_versions: list[int] = field(default_factory=list)


@runtime_checkable
class GenerateClient(Protocol):
    """A rollout engine, or the router in front of several, as the agent runners see it.

    `session_id` keeps every turn of one episode on the same engine (prefix-cache affinity); engines may ignore it.
    """

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        session_id: str,
        logprobs: bool,
        top_logprobs: int = 0,
        min_tokens: int = 0,
    ) -> GenerateOutput: ...


def turn_keywords(top_logprobs: int, min_tokens: int, cap: int) -> dict[str, int]:
    """The optional keywords of one turn's `GenerateClient.generate` call, only those set (a client written without
    them never sees them): score centering's k, and the minimum cut to the turn's cap (a turn cut short by the
    context keeps its cap; vLLM refuses min_tokens > max_tokens)."""
    extra = {"top_logprobs": top_logprobs} if top_logprobs else {}
    if min_tokens:
        extra["min_tokens"] = min(min_tokens, cap)
    return extra


@dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings the runners pass to `GenerateClient.generate` (from the plan's `sampling` block).

    `max_tokens` is the per-turn cap (`sampling.max_new_tokens`); the runner clamps it to the remaining context.
    None (no cap, Molt's default): a turn may use whatever context is left.
    """

    max_tokens: int | None
    min_tokens: int = 0  # tokens before an EOS may be sampled (`sampling.min_new_tokens`); cut to the turn's cap
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: bool = True
    top_logprobs: int = 0  # k of score centering: the engine also returns each generated token's top-k (0: none)

    @classmethod
    def from_plan(cls, s: SamplingPlan) -> SamplingParams:
        """From a plan's `SamplingPlan` (`rl.sampling`, `rl.eval.sampling`), field for field."""
        return cls(max_tokens=s.max_new_tokens, min_tokens=s.min_new_tokens, temperature=s.temperature, top_p=s.top_p,
                   logprobs=s.logprobs, top_logprobs=s.top_logprobs)
