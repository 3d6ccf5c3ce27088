from runtime.agents import Env, StepEnvRunner

class EchoEnv(Env)
    pass

AgentRunner = StepEnvRunner(EchoEnv)
