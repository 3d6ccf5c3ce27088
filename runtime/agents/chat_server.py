"""Loopback OpenAI/Anthropic-compatible server that records the exact token trace of each chat session.

A `ChatAgent` talks to the policy with a stock SDK client; this server renders each request with the model's chat
template, generates through the engine client, and keeps the tokens *exactly as generated* (token-in/token-out), so
the trainer sees what the engine produced, never a re-tokenization of text.

    POST /s/{session}/v1/chat/completions   OpenAI wire
    POST /s/{session}/v1/messages           Anthropic wire (`system` becomes the first message; tool_result and
                                            tool_use blocks are unwrapped to text)
    GET  /health

Per session the server keeps segments (one training sample each):
- a turn whose rendered conversation *extends* the decoded token stream so far (the usual case: same history plus
  new messages) appends only the template delta as observation tokens and continues the segment;
- otherwise (first turn, the agent compacted or edited history, or the template re-renders history differently,
  e.g. dropping earlier <think> blocks) a new segment starts from the full rendering.
Generation is clamped to the session's remaining context; logprobs are always requested. A retry with the same
request body returns the cached reply and is not recorded twice. Turns of one session are serialised.

The server runs uvicorn in a thread of its own with its own event loop, so an agent that blocks (a sync SDK client
inside `run`) cannot deadlock it; the engine client must therefore be usable from that loop (Ray actor handles and
in-process engines are).
"""


import asyncio
import json
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.agents.base import EngineError, Tokenizer, absorb_routing, tokenize
from runtime.agents.types import UNKNOWN_VERSION, GenerateClient, GenerateOutput, SamplingParams, turn_keywords

MODEL_NAME = "policy"
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class Segment:
    """One stretch of token-in/token-out history: prompt + actions + observations."""

    token_ids: list[int]
    rollout_log_probs: list[float]  # aligned with token_ids, 0.0 off the actions
    action_ranges: list[tuple[int, int]] = field(default_factory=list)
    text: str = ""  # decode(token_ids), what the next rendering must extend to continue this segment
    routed_experts: Any = None  # (<= T, L, k) int16 routing of token_ids (R3), -1 where none; or None
    top_logprobs: list | None = None  # score centering: per action range, the engine's (top ids, top log-probs)
    policy_versions: list[int] = field(default_factory=list)  # aligned with token_ids, -1 off the actions


@dataclass
class Session:
    session_id: str
    sampling: SamplingParams
    max_length: int
    tokenizer: Tokenizer
    client: GenerateClient
    tools: list | None = None
    segments: list[Segment] = field(default_factory=list)
    truncated: bool = False
    aborted: bool = False
    engine_error: str | None = None  # the engine raised on a turn: the runner drops the rollout as engine_error
    turns: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    last_request: str | None = None
    last_reply: Any = None
    lock: asyncio.Lock | None = None  # created in the server loop


class ChatServer:
    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 30.0) -> None:
        import uvicorn

        config = uvicorn.Config(_build_app(self), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="chat-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the loopback chat server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ sessions
    def open_session(self, sampling: SamplingParams, max_length: int, tokenizer: Tokenizer, client: GenerateClient,
                     tools: list | None = None) -> Session:
        session = Session(uuid.uuid4().hex, sampling, max_length, tokenizer, client, tools)
        with self._sessions_lock:
            self._sessions[session.session_id] = session
        return session

    def close_session(self, session_id: str) -> Session:
        with self._sessions_lock:
            return self._sessions.pop(session_id)

    def get(self, session_id: str) -> Session | None:
        with self._sessions_lock:
            return self._sessions.get(session_id)


class ChatError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------------------------------- one turn
@dataclass(frozen=True)
class TurnReply:
    text: str  # decoded completion, special tokens removed
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # engine vocabulary: stop | length
    prompt_tokens: int


def _params(session: Session, body: dict) -> tuple[int | None, float, float, int]:
    """The request's (max_tokens, temperature, top_p, min_tokens) over the session's; max_tokens None: no cap.
    `min_tokens` is vLLM's extra parameter (`extra_body` in the openai SDK)."""
    s = session.sampling
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or s.max_tokens
    temperature = body.get("temperature", s.temperature)
    top_p = body.get("top_p", s.top_p)
    min_tokens = body.get("min_tokens", s.min_tokens)
    return (None if max_tokens is None else int(max_tokens), float(s.temperature if temperature is None else temperature),
            float(s.top_p if top_p is None else top_p), int(s.min_tokens if min_tokens is None else min_tokens))


async def run_turn(session: Session, messages: list[dict], body: dict, cache_key: str,
                   make_reply) -> Any:
    """Render, generate, record. `make_reply(TurnReply)` builds the wire response, cached for an identical retry."""
    if not messages:
        raise ChatError(400, "messages must not be empty")
    if session.lock is None:
        session.lock = asyncio.Lock()
    async with session.lock:
        if cache_key == session.last_request:
            return session.last_reply
        tok = session.tokenizer
        loop = asyncio.get_running_loop()
        rendered = await loop.run_in_executor(None, lambda: tok.apply_chat_template(
            messages, tools=session.tools, add_generation_prompt=True, tokenize=False))
        segment = session.segments[-1] if session.segments else None
        if segment is not None and rendered.startswith(segment.text):
            delta_ids = await tokenize(tok, rendered[len(segment.text):])
            prompt_ids = segment.token_ids + delta_ids
        else:
            segment, delta_ids = None, []
            prompt_ids = await tokenize(tok, rendered)

        max_tokens, temperature, top_p, min_tokens = _params(session, body)
        remaining = session.max_length - len(prompt_ids)
        if remaining <= 0:
            session.truncated = True
            reply = make_reply(TurnReply("", [], [], "length", len(prompt_ids)))
        else:
            cap = remaining if max_tokens is None else min(max_tokens, remaining)
            extra = turn_keywords(session.sampling.top_logprobs, min_tokens, cap)
            try:
                out: GenerateOutput = await session.client.generate(
                    prompt_ids, max_tokens=cap, temperature=temperature, top_p=top_p, session_id=session.session_id,
                    logprobs=True, **extra)
            except EngineError as exc:  # the agent sees a 502 (SDKs retry it); if it gives up, the runner names it
                session.engine_error = str(exc)
                raise ChatError(502, str(exc)) from None
            session.engine_error = None  # a retried turn went through
            if out.finish_reason == "abort":
                session.aborted = True
                raise ChatError(503, "generation aborted by the engine")
            if len(out.logprobs) != len(out.token_ids):
                raise ChatError(500, f"engine returned {len(out.logprobs)} logprobs for {len(out.token_ids)} tokens")
            _record(session, segment, prompt_ids, delta_ids, out)
            text = tok.decode(list(out.token_ids), skip_special_tokens=True)
            reply = make_reply(TurnReply(text, list(out.token_ids), list(out.logprobs), out.finish_reason,
                                         len(prompt_ids)))
        session.last_request, session.last_reply = cache_key, reply
        return reply


def _record(session: Session, segment: Segment | None, prompt_ids: list[int], delta_ids: list[int],
            out: GenerateOutput) -> None:
    if segment is None:
        segment = Segment(token_ids=list(prompt_ids), rollout_log_probs=[0.0] * len(prompt_ids),
                          top_logprobs=[] if session.sampling.top_logprobs else None,
                          policy_versions=[UNKNOWN_VERSION] * len(prompt_ids))
        session.segments.append(segment)
    else:
        segment.token_ids.extend(delta_ids)
        segment.rollout_log_probs.extend([0.0] * len(delta_ids))
        segment.policy_versions.extend([UNKNOWN_VERSION] * len(delta_ids))
    start = len(segment.token_ids)
    segment.token_ids.extend(out.token_ids)
    segment.rollout_log_probs.extend(float(lp) for lp in out.logprobs)
    segment.policy_versions.extend(out.policy_versions or [UNKNOWN_VERSION] * len(out.token_ids))
    segment.action_ranges.append((start, len(segment.token_ids)))
    if segment.top_logprobs is not None:  # one (n, k) pair per action range; runners drop a misaligned rollout
        if out.top_ids is not None and len(out.top_ids) == len(out.token_ids):
            segment.top_logprobs.append((out.top_ids, out.top_logprobs))
    segment.routed_experts = absorb_routing(segment.routed_experts, out.routed_experts, len(segment.token_ids))
    segment.text = session.tokenizer.decode(segment.token_ids, skip_special_tokens=False)
    session.turns += 1
    session.finish_reasons.append(out.finish_reason)
    session.truncated = session.truncated or out.finish_reason == "length"


# --------------------------------------------------------------------------------------------------- wire formats
def _text_of(content: Any) -> str:
    """Plain text of an OpenAI or Anthropic content field (string or list of blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text", ""))
        elif kind == "tool_result":
            parts.append(_text_of(block.get("content")))
    return "".join(parts)


def _tool_calls(text: str) -> list[dict]:
    """Hermes/Qwen-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a completion."""
    calls = []
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append({"name": call["name"], "arguments": call.get("arguments") or {}})
    return calls


def openai_messages(body: dict) -> list[dict]:
    out = []
    for m in body.get("messages") or []:
        out.append({"role": m.get("role", "user"), "content": _text_of(m.get("content"))})
    return out


def anthropic_messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text_of(system)})
    for m in body.get("messages") or []:
        content = m.get("content")
        if isinstance(content, list) and m.get("role") == "assistant":
            # our replies carry the tool call both as text and as tool_use blocks; the text is the token trace
            content = [b for b in content if b.get("type") == "text"]
        out.append({"role": m.get("role", "user"), "content": _text_of(content)})
    return out


def openai_reply(reply: TurnReply, tools_requested: bool) -> dict:
    calls = _tool_calls(reply.text) if tools_requested else []
    finish = "tool_calls" if calls else ("length" if reply.finish_reason == "length" else "stop")
    message: dict = {"role": "assistant", "content": reply.text}
    if calls:
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for c in calls]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
                     "logprobs": {"content": [{"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                                              for t, lp in zip(reply.token_ids, reply.logprobs, strict=True)]}}],
        "usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(reply.token_ids),
                  "total_tokens": reply.prompt_tokens + len(reply.token_ids)},
    }


def anthropic_reply(reply: TurnReply, tools_requested: bool) -> dict:
    calls = _tool_calls(reply.text) if tools_requested else []
    content: list[dict] = [{"type": "text", "text": reply.text}]
    content += [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:12]}", "name": c["name"],
                 "input": c["arguments"]} for c in calls]
    stop = "tool_use" if calls else ("max_tokens" if reply.finish_reason == "length" else "end_turn")
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": MODEL_NAME,
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": len(reply.token_ids)}}


def _anthropic_tools(tools: list | None) -> list | None:
    """Anthropic tool specs in the OpenAI function shape chat templates expect."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                              "parameters": t.get("input_schema", {})}} for t in tools]


def _build_app(server: ChatServer):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()

    def error(status: int, message: str, wire: str):
        if wire == "anthropic":
            return JSONResponse({"type": "error", "error": {"type": "invalid_request_error", "message": message}},
                                status_code=status)
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                            status_code=status)

    async def handle(session_id: str, request: Request, wire: str):
        session = server.get(session_id)
        if session is None:
            return error(400, f"unknown session {session_id!r}", wire)
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the request body is not JSON", wire)
        if wire == "openai":
            messages, tools = openai_messages(body), body.get("tools")
            make = lambda r: openai_reply(r, bool(tools))  # noqa: E731
        else:
            messages, tools = anthropic_messages(body), _anthropic_tools(body.get("tools"))
            make = lambda r: anthropic_reply(r, bool(tools))  # noqa: E731
        if tools and session.tools is None:
            session.tools = tools
        try:
            reply = await run_turn(session, messages, body, json.dumps(body, sort_keys=True), make)
        except ChatError as exc:
            return error(exc.status, str(exc), wire)
        return JSONResponse(reply)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": MODEL_NAME}

    @app.post("/s/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request):
        return await handle(session_id, request, "openai")

    @app.post("/s/{session_id}/v1/messages")
    async def messages(session_id: str, request: Request):
        return await handle(session_id, request, "anthropic")

    return app
