"""A chat agent for the rule tests: ChatAgentRunner needs data.apply_chat_template (L1)."""
from runtime.agents import ChatAgent, ChatAgentRunner, Result


class Solver(ChatAgent):
    async def run(self, ctx):
        return Result(reward=0.0)


AgentRunner = ChatAgentRunner(Solver)
