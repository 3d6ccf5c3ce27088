"""Test agent: the demo's addition env, misbehaving on marked prompts (issue 13's agent faults).

- "crash ..." prompts kill the runner's process (`os._exit`), every time they are tried;
- "hang ..." prompts never return from `Env.step` (an await that never ends: `agent.step_timeout_s` ends it);
- "block ..." prompts block in `time.sleep` (the env's own thread: `agent.step_timeout_s` gives the step up and
  abandons the thread, issue 32.2);
- "flood ..." prompts answer with a 10 MB observation (issue 32.1: the runner cuts it before tokenizing);
- every other step sleeps `STEP_SLEEP_S` seconds (agent.env; 0.5 by default), so that generation is slower than
  training and the faults play out mid-run.
"""

import asyncio
import os
import time

from runtime.agents import Env, Result, StepEnvRunner


class MisbehavingEnv(Env):
    async def step(self, state: dict) -> Result:
        text = state["observation_text"]
        if "crash " in text:
            os._exit(3)
        if "hang " in text:
            await asyncio.sleep(3600)
        if "block " in text:
            time.sleep(3600)
        if "flood " in text:
            return Result(reward=0.0, observation="x " * 5_000_000, terminated=True)
        await asyncio.sleep(float(os.environ.get("STEP_SLEEP_S", "0.5")))
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        return Result(reward=float(answer == str(state["label"])), terminated=True)


AgentRunner = StepEnvRunner(MisbehavingEnv)
