"""Single-turn math agent: the model answers once; reward 1 when its final answer equals the label, else 0.

The final answer is the last `\\boxed{...}` or `<answer>...</answer>` in the generation, compared with the label by
math-verify (fractions, decimals, scientific notation, LaTeX; see `grading.py`). Used by the qwen3-4b math recipes
(`agent: {path: agents/math.py, max_turns: 1}`); the dataset's prompt is already chat-templated.

Environment: MOLT_GRADE_TIMEOUT_S (default 10) caps the time one grading may take; a timeout scores 0 and is counted
in `info["grade_timeout"]`.
"""

from grading import GRADER

from runtime.agents import Env, Result, StepEnvRunner


class MathEnv(Env):
    async def step(self, state: dict) -> Result:
        grade = await GRADER.grade(state["action_text"], state["label"])
        return Result(
            reward=1.0 if grade.correct else 0.0,
            terminated=True,
            info={"has_answer": float(grade.has_answer), "grade_timeout": float(grade.timed_out)},
        )


AgentRunner = StepEnvRunner(MathEnv)
