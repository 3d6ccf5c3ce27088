"""Demo agent: single-digit addition, one turn, reward 1 for the exact sum.

The prompt is "a+b=" (chat-templated by the dataset); the label is the sum as text. The model's turn ends with
<|im_end|>, which is stripped before comparing. `info["answered_number"]` tracks the format on its own, so the
plot can show the model keeps answering with numbers while the accuracy rises.
"""

from runtime.agents import Env, Result, StepEnvRunner


class AdditionEnv(Env):
    async def step(self, state: dict) -> Result:
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        correct = answer == str(state["label"]).strip()
        return Result(reward=1.0 if correct else 0.0, terminated=True,
                      info={"answered_number": float(answer.isdigit())})


AgentRunner = StepEnvRunner(AdditionEnv)
