"""Chat agents: the agent owns the loop and talks to the policy through a stock OpenAI or Anthropic client.

    class MyAgent(ChatAgent):
        async def run(self, ctx: ChatContext) -> Result:
            client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key)
            reply = await client.chat.completions.create(model=ctx.model_name, messages=ctx.messages)
            return Result(reward=grade(reply.choices[0].message.content, ctx.label))

    AgentRunner = ChatAgentRunner(MyAgent)

`ChatAgentRunner` starts one loopback server per runner (lazily), opens a session per episode, runs the agent, and
turns the session's recorded token trace into trajectories (`chat_server.py`). The dataset does not pre-render the
chat template for chat agents (`PRERENDER_PROMPT = False`): the server renders the messages exactly once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from runtime.agents.base import EngineError, GenerationAborted, Result, Runner, Tokenizer, Trajectory, scalar
from runtime.agents.chat_server import MODEL_NAME, ChatServer
from runtime.agents.types import GenerateClient, SamplingParams


@dataclass(frozen=True)
class ChatContext:
    messages: list[dict]  # the dataset row as OpenAI-wire messages
    tools: list | None  # the row's tools, or None
    prompt: str  # text of the last user turn
    label: Any  # ground truth
    images: list | None
    base_url: str  # http://127.0.0.1:<port>/s/<session>/v1  (OpenAI clients)
    session_url: str  # http://127.0.0.1:<port>/s/<session>    (Anthropic clients)
    model_name: str
    api_key: str
    session_id: str
    sampling_params: SamplingParams
    max_length: int  # the context budget of the whole session


class ChatAgent(ABC):
    """A fresh instance runs each episode."""

    @abstractmethod
    async def run(self, ctx: ChatContext) -> Result: ...


class ChatAgentRunner(Runner):
    PRERENDER_PROMPT = False

    def __init__(self, agent_cls: type[ChatAgent]):
        if not (isinstance(agent_cls, type) and issubclass(agent_cls, ChatAgent)):
            raise TypeError(f"ChatAgentRunner needs a subclass of runtime.agents.ChatAgent, got {agent_cls!r}")
        self.agent_cls = agent_cls
        self._server: ChatServer | None = None

    @property
    def server(self) -> ChatServer:
        if self._server is None:
            server = ChatServer()
            server.start()
            self._server = server
        return self._server

    def close(self) -> None:
        """Stop the loopback server (a later `execute` starts a new one)."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    async def execute(
        self,
        prompt: Any,
        label: Any,
        *,
        sampling: SamplingParams,
        max_length: int,
        tokenizer: Tokenizer,
        client: GenerateClient,
        tools: list | None = None,
        images: list | None = None,
        processor: Any = None,
    ) -> Trajectory | list[Trajectory]:
        """One episode. Returns one trajectory per recorded segment (usually one); all share the session's
        `rollout_id` and carry the episode's reward, so the group estimators count the rollout once."""
        if images:
            raise NotImplementedError("ChatAgentRunner: image prompts are not supported yet (step agents are)")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        server = self.server
        session = server.open_session(sampling, max_length, tokenizer, client, tools)
        try:
            ctx = ChatContext(
                messages=messages, tools=tools, prompt=_last_user_text(messages), label=label, images=None,
                base_url=f"{server.url}/s/{session.session_id}/v1", session_url=f"{server.url}/s/{session.session_id}",
                model_name=MODEL_NAME, api_key="EMPTY", session_id=session.session_id, sampling_params=sampling,
                max_length=max_length)
            result = await self.agent_cls().run(ctx)
        except Exception:
            if session.engine_error is not None:  # the agent failed on the engine's 502: not the agent's fault
                raise EngineError(session.engine_error) from None
            raise
        finally:
            session = server.close_session(session.session_id)
        if not isinstance(result, Result):
            raise TypeError(f"{self.agent_cls.__name__}.run must return a runtime.agents.Result, "
                            f"got {type(result).__name__}")
        if session.aborted:
            raise GenerationAborted(f"the engine aborted a turn of chat session {session.session_id}")
        reward = scalar(result.reward, f"{self.agent_cls.__name__}.run reward")
        score = reward if result.score is None else scalar(result.score, f"{self.agent_cls.__name__}.run score")
        segments = session.segments or []
        trajectories = [
            Trajectory(prompt=prompt, label=label,
                       observation_text=tokenizer.decode(seg.token_ids, skip_special_tokens=False),
                       token_ids=seg.token_ids, action_ranges=seg.action_ranges,
                       rollout_log_probs=seg.rollout_log_probs if sampling.logprobs else None,
                       reward=reward, score=score, truncated=session.truncated or result.truncated,
                       info=dict(result.info or {}), turns=len(seg.action_ranges),
                       finish_reasons=list(session.finish_reasons), images=result.images,
                       rollout_id=session.session_id, routed_experts=seg.routed_experts,
                       top_logprobs=seg.top_logprobs,
                       policy_versions=seg.policy_versions)
            for seg in segments
        ]
        if not trajectories:  # the agent never called the model: an empty sample the generator drops with a reason
            return Trajectory(prompt=prompt, label=label, observation_text="", token_ids=[], reward=reward,
                              score=score, info=dict(result.info or {}), rollout_id=session.session_id)
        return trajectories[0] if len(trajectories) == 1 else trajectories


def _last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict))
    return ""
