"""Issue 32.1 and 32.2, in-process with real agents and the demo model's real tokenizer (no Ray): what an agent hands
back is cut before it is tokenized, and an `Env.step` that blocks in `time.sleep` is given up at its bound."""

from __future__ import annotations

import asyncio
import textwrap
import time
from pathlib import Path

from agents_fakes import ScriptedEngine

from runtime.agents import SamplingParams
from runtime.runners import AgentRunnerActor, GroupRequest

MODEL = Path(__file__).resolve().parents[2] / "recipes" / "data" / "demo_math" / "model"
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, logprobs=True)


def runner_for(tmp_path: Path, body: str, *, max_length: int = 96, step_timeout_s: float = 60.0,
               episode_timeout_s: float = 120.0) -> AgentRunnerActor:
    from transformers import AutoTokenizer

    agent = tmp_path / "agent.py"
    agent.write_text("import asyncio, time\nfrom runtime.agents import Env, Result, StepEnvRunner\n\n"
                     + textwrap.dedent(body) + "\nAgentRunner = StepEnvRunner(AgentEnv)\n")
    engine = ScriptedEngine(["3<|im_end|>"])
    runner = AgentRunnerActor(str(agent), str(MODEL), engine, max_length, {}, apply_chat_template=True,
                              step_timeout_s=step_timeout_s, episode_timeout_s=episode_timeout_s)
    engine.tokenizer = AutoTokenizer.from_pretrained(MODEL)
    return runner


def run_group(runner: AgentRunnerActor, n: int):
    return asyncio.run(runner.run_group(GroupRequest(3, "1+2=", "3", n, SAMPLING)))


def test_a_10_mb_observation_is_cut_to_the_context_before_it_is_tokenized(tmp_path):
    """32.1: every rollout's 10 MB tool output used to be tokenized whole (gigabytes of runner memory per group);
    now only what can fit is tokenized, the rollout is kept, cut to max_length and counted as cut."""
    runner = runner_for(tmp_path, """
        class AgentEnv(Env):
            async def step(self, state):
                if state["turn"] == 0:
                    return Result(reward=0.0, observation="tool says: " + "x y " * 2_500_000, terminated=False,
                                  info={"big": "z" * 1_000_000, "calls": 1})
                return Result(reward=1.0)
        """)
    seen: list[int] = []
    real_encode = runner.tokenizer.encode
    runner.tokenizer.encode = lambda text, **kw: (seen.append(len(text)), real_encode(text, **kw))[1]
    t0 = time.monotonic()
    result = run_group(runner, 4)
    assert time.monotonic() - t0 < 10
    assert max(seen) < 2_000, seen  # characters handed to the tokenizer at once, not 10 MB
    assert result.experience is not None and result.experience.batch_size == 4
    assert int(result.experience.attention_mask.sum(-1).max()) <= 96
    assert result.experience.truncated.tolist() == [True] * 4
    assert result.cuts == {"observation": 4, "info": 4}  # the rollout/cut/* metrics
    assert result.info == {"calls": 4.0}


def test_a_step_blocking_in_time_sleep_is_given_up_at_the_step_timeout(tmp_path):
    """32.2: `time.sleep` in `Env.step` blocked the runner's event loop, so no asyncio timeout could fire (only the
    generator's group bound, 31 minutes by default, ended it). Now the step runs where it can be abandoned: the
    group answers at the step bound with the blocked rollouts dropped as step_timeout, the others trained."""
    runner = runner_for(tmp_path, """
        class AgentEnv(Env):
            calls = 0

            async def step(self, state):
                AgentEnv.calls += 1
                if AgentEnv.calls % 2:
                    time.sleep(6)
                return Result(reward=1.0)
        """, step_timeout_s=0.5, episode_timeout_s=1.0)
    t0 = time.monotonic()
    result = run_group(runner, 4)
    took = time.monotonic() - t0
    assert took < 3, took  # not 4 x 6 s of blocked event loop
    assert result.dropped == {"step_timeout": 2} and len(result.rewards) == 2


def test_a_reset_blocking_in_time_sleep_is_given_up_at_the_episode_timeout(tmp_path):
    """32.2: the episode bound holds for a blocking reset too (and its close does not wait on the stuck thread)."""
    runner = runner_for(tmp_path, """
        class AgentEnv(Env):
            async def reset(self, state):
                time.sleep(6)
                return state

            async def step(self, state):
                return Result(reward=1.0)
        """, step_timeout_s=0.5, episode_timeout_s=1.0)
    t0 = time.monotonic()
    result = run_group(runner, 2)
    assert time.monotonic() - t0 < 3
    assert result.dropped == {"episode_timeout": 2}


def test_episodes_spawn_processes_concurrently_under_rays_uvloop_policy(tmp_path):
    """Ray's workers install uvloop's event-loop policy. Each Env thread then got a uvloop loop, and uvloop loops in
    several threads refuse to spawn at once ("Racing with another loop to spawn a process": the tool demo's sandbox
    calls dropped as agent_error, then a runner that stopped answering for the 660 s group bound). Sixteen
    episodes that each start subprocesses at once, on a uvloop main loop as in a Ray actor: all kept."""
    import uvloop

    uvloop.install()
    try:
        runner = runner_for(tmp_path, """
            class AgentEnv(Env):
                async def step(self, state):
                    for _ in range(3):
                        proc = await asyncio.create_subprocess_exec("true")
                        assert await asyncio.wait_for(proc.wait(), 30) == 0
                    return Result(reward=1.0)
            """)
        loop = uvloop.new_event_loop()
        try:
            result = loop.run_until_complete(runner.run_group(GroupRequest(3, "1+2=", "3", 16, SAMPLING)))
        finally:
            loop.close()
    finally:
        asyncio.set_event_loop_policy(None)
    assert result.dropped == {} and len(result.rewards) == 16, (result.dropped, result.errors)
