"""VLM demo agent: the image shows a digit a, the text asks "+b="; reward 1 for the exact sum a + b, 0.1 for a wrong
number, 0 otherwise (as recipes/agents/demo_math.py). One turn."""

from runtime.agents import Env, Result, StepEnvRunner


class ImageSumEnv(Env):
    async def step(self, state: dict) -> Result:
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        correct = answer == str(state["label"]).strip()
        reward = 1.0 if correct else 0.1 if answer.isdigit() else 0.0
        return Result(reward=reward, score=float(correct), terminated=True,
                      info={"answered_number": float(answer.isdigit())})


AgentRunner = StepEnvRunner(ImageSumEnv)
