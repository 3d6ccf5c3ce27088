"""Test agent: the demo's addition env with injected faults.

- `Env.step` raises when the model answers "3" (a rollout-level fault: that rollout is dropped as agent_error, its
  group survives) and on every rollout of the prompt "2+2=" (label "4", one of the 9 facts: the whole group is
  lost, all_rollouts_dropped);
- every step sleeps 2 s, so generation is slower than training: the generator never waits for a slot and always
  has groups in flight on every runner when the test kills one.
"""

import asyncio

from runtime.agents import Env, Result, StepEnvRunner


class FaultyAdditionEnv(Env):
    async def step(self, state: dict) -> Result:
        await asyncio.sleep(2.0)
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        if answer == "3" or str(state["label"]) == "4":
            raise RuntimeError(f"injected fault (answer {answer!r})")
        return Result(reward=float(answer == str(state["label"])), terminated=True)


AgentRunner = StepEnvRunner(FaultyAdditionEnv)
