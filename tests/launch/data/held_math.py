"""Test agent: the demo's addition env, whose steps take 3 s while the hold file exists.

The requeue test creates the file once the run has trained two steps, so each later batch takes 3 s to generate and
the time-limit signal lands long before the run's last step however fast the machine trains (a tiny step takes
0.2 s; on one CI machine the whole run ended before the signal got through). The steps are slow, not stopped: a
generation phase holds the engine lock, and the step the signal interrupts must still sync its weights. The test
removes the file once the run has checkpointed, and the requeued job runs at full speed.
"""

import asyncio
from pathlib import Path

from runtime.agents import Env, Result, StepEnvRunner

HOLD = Path("/tmp/molt-requeue-test.hold")  # the simulated Slurm nodes share this machine's /tmp


class HeldAdditionEnv(Env):
    async def step(self, state: dict) -> Result:
        if HOLD.exists():
            await asyncio.sleep(3.0)
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        correct = answer == str(state["label"]).strip()
        return Result(reward=1.0 if correct else 0.1 if answer.isdigit() else 0.0, score=float(correct),
                      terminated=True)


AgentRunner = StepEnvRunner(HeldAdditionEnv)
