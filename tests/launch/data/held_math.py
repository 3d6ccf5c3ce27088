"""Test agent: the demo's addition env, whose steps wait while the hold file exists.

The requeue test creates the file once the run has trained two steps: generation stops within a batch or two, so
the time-limit signal lands before the run's last step however fast the machine trains (a tiny step takes 0.2 s; on
one CI machine the whole run ended before the signal got through). The batch being generated then never finishes,
and the generator holds the engine lock all along: the step the signal interrupts must checkpoint without its weight
sync (which waits for that lock). The test removes the file once the run has checkpointed, and the requeued job
generates freely.
"""

import asyncio
from pathlib import Path

from runtime.agents import Env, Result, StepEnvRunner

HOLD = Path("/tmp/molt-requeue-test.hold")  # the simulated Slurm nodes share this machine's /tmp


class HeldAdditionEnv(Env):
    async def step(self, state: dict) -> Result:
        while HOLD.exists():
            await asyncio.sleep(0.1)
        answer = state["action_text"].replace("<|im_end|>", "").strip()
        correct = answer == str(state["label"]).strip()
        return Result(reward=1.0 if correct else 0.1 if answer.isdigit() else 0.0, score=float(correct),
                      terminated=True)


AgentRunner = StepEnvRunner(HeldAdditionEnv)
