"""Demo agent: addition of two digits, one turn; reward 1 for the exact sum, 0.1 for a wrong number, 0 otherwise.

The prompt is "a+b=" (chat-templated by the dataset); the label is the sum as text. The model's turn ends with
<|im_end|>, which is stripped before comparing. The small reward for any number keeps the answer format while the
sums are learned: without it, pushing down wrong digits can collapse a tiny policy onto empty answers, which then
all score 0 and give no signal. `info["answered_number"]` tracks the format on its own.
"""

from runtime.agents import Env, Result, StepEnvRunner


class AdditionEnv(Env):
    async def step(self, state: dict) -> Result:
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        correct = answer == str(state["label"]).strip()
        reward = 1.0 if correct else 0.1 if answer.isdigit() else 0.0
        return Result(reward=reward, score=float(correct), terminated=True,
                      info={"answered_number": float(answer.isdigit())})


AgentRunner = StepEnvRunner(AdditionEnv)
