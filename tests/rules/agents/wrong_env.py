"""StepEnvRunner is given a class that is not an Env."""
from runtime.agents import Result, StepEnvRunner


class NotAnEnv:
    async def step(self, state):
        return Result(reward=0.0)


AgentRunner = StepEnvRunner(NotAnEnv)
