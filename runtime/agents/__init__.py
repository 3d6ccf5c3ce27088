"""Public agent API. User agents import from here only:

    from runtime.agents import Env, Result, StepEnvRunner, ChatAgent, ChatAgentRunner, ChatContext
"""

from runtime.agents.types import GenerateClient, GenerateOutput, SamplingParams

__all__ = ["GenerateClient", "GenerateOutput", "SamplingParams"]
