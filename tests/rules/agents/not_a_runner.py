"""AgentRunner is a plain class, not a Runner."""


class AgentRunner:
    def run(self, prompt):
        return 0.0
