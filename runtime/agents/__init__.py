"""Public agent API. User agents import from here only:

    from runtime.agents import Env, Result, StepEnvRunner, ChatAgent, ChatAgentRunner, ChatContext

`Env` + `StepEnvRunner`: the framework drives the generation loop, token-first (`base.py`).
`ChatAgent` + `ChatAgentRunner`: the agent drives an OpenAI/Anthropic-compatible loopback server that records the
exact token trace (`chat_agent.py`, `chat_server.py`).
"""

from runtime.agents.base import (
    AgentLoadError,
    EngineError,
    Env,
    GenerationAborted,
    Result,
    Runner,
    StepEnvRunner,
    Trajectory,
    load_agent_runner,
)
from runtime.agents.chat_agent import ChatAgent, ChatAgentRunner, ChatContext
from runtime.agents.types import GenerateClient, GenerateOutput, SamplingParams

__all__ = [
    "AgentLoadError",
    "ChatAgent",
    "ChatAgentRunner",
    "ChatContext",
    "EngineError",
    "Env",
    "GenerateClient",
    "GenerateOutput",
    "GenerationAborted",
    "Result",
    "Runner",
    "SamplingParams",
    "StepEnvRunner",
    "Trajectory",
    "load_agent_runner",
]
