"""Hand-written fakes for the agent-runner tests: a byte tokenizer and a scripted engine.

The engine implements `GenerateClient` honestly: it honours `max_tokens` (finish_reason "length" when it cuts),
returns one logprob per generated token when asked and none otherwise, and records every call so tests can check what
the runner sent. Real engines (vLLM, HF) are tested in tests/runtime/test_engines*.py.
"""

from __future__ import annotations

from runtime.agents import GenerateOutput


class ByteTokenizer:
    """Lossless UTF-8 byte tokenizer: one token per byte, no special tokens."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def fake_logprob(position: int, token_id: int) -> float:
    """A distinct, deterministic logprob per (absolute position, token) so misalignment shows up in tests."""
    return -((token_id % 13) + 1) / 10 - position / 1000


class ScriptedEngine:
    """Replies with the next scripted text of the session; `calls` records (prompt_ids, kwargs) per call."""

    def __init__(self, replies: list[str], tokenizer: ByteTokenizer | None = None, *, finish_reason: str = "stop",
                 drop_logprob: bool = False):
        self.replies = replies
        self.tokenizer = tokenizer or ByteTokenizer()
        self.finish_reason = finish_reason
        self.drop_logprob = drop_logprob  # misbehave: return one logprob fewer than tokens
        self.calls: list[tuple[list[int], dict]] = []
        self._turn_of_session: dict[str, int] = {}

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, session_id, logprobs,
                       min_tokens=0) -> GenerateOutput:
        self.calls.append((list(prompt_ids), dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                                  session_id=session_id, logprobs=logprobs, min_tokens=min_tokens)))
        turn = self._turn_of_session.get(session_id, 0)
        self._turn_of_session[session_id] = turn + 1
        ids = self.tokenizer.encode(self.replies[min(turn, len(self.replies) - 1)])
        finish = self.finish_reason
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        lps = [fake_logprob(len(prompt_ids) + i, t) for i, t in enumerate(ids)] if logprobs else []
        if self.drop_logprob and lps:
            lps = lps[:-1]
        return GenerateOutput(token_ids=ids, logprobs=lps, finish_reason=finish)
