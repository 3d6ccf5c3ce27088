"""A minimal single-turn agent for the compiler's test recipes (checked statically by the rules, never run here)."""

from runtime.agents import Env, Result, StepEnvRunner


class SumEnv(Env):
    async def step(self, state: dict) -> Result:
        return Result(reward=float(state["action_text"].strip() == state["label"]), done=True)


AgentRunner = StepEnvRunner(SumEnv)
