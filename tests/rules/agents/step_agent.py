"""A step agent for the rule tests: StepEnvRunner over an Env subclass (the usual form)."""
from runtime.agents import Env, Result, StepEnvRunner


class EchoEnv(Env):
    async def step(self, state):
        return Result(reward=float(state["action_text"].strip() == state["label"]))


AgentRunner = StepEnvRunner(EchoEnv)
