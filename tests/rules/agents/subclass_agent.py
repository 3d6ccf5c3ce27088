"""A runner defined as a subclass chain: class Base(StepEnvRunner), class AgentRunner(Base)."""
from runtime.agents import Env, Result, StepEnvRunner


class EchoEnv(Env):
    async def step(self, state):
        return Result(reward=0.0)


class Base(StepEnvRunner):
    def __init__(self):
        super().__init__(EchoEnv)


class AgentRunner(Base):
    pass
