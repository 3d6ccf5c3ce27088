"""The agent-runner actor's group logic, in-process (no Ray): prompts rendered only for step runners, chat
episodes that come back as several step-samples, drops per rollout."""

from __future__ import annotations

import asyncio
from pathlib import Path

from agents_fakes import ScriptedEngine

from runtime.agents import EngineError, SamplingParams
from runtime.runners import AgentRunnerActor, GroupRequest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "recipes" / "data" / "demo_math" / "model"
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, logprobs=True)


def actor(agent: Path, engine, max_length: int = 64) -> AgentRunnerActor:
    from transformers import AutoTokenizer

    runner = AgentRunnerActor(str(agent), str(MODEL), engine, max_length, {}, apply_chat_template=True,
                              step_timeout_s=60.0, episode_timeout_s=120.0)
    engine.tokenizer = AutoTokenizer.from_pretrained(MODEL)  # the engine replies in the model's own tokens
    return runner


def run(actor: AgentRunnerActor, prompt, label, n: int):
    return asyncio.run(actor.run_group(GroupRequest(7, prompt, label, n, SAMPLING)))


def test_step_runner_gets_the_rendered_prompt():
    engine = ScriptedEngine(["3<|im_end|>"])
    runner = actor(ROOT / "recipes" / "agents" / "demo_math.py", engine)
    result = run(runner, "1+2=", "3", 2)
    rendered = runner.tokenizer.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False,
                                                    add_generation_prompt=True)
    assert engine.calls[0][0] == runner.tokenizer.encode(rendered, add_special_tokens=False)
    assert result.rewards == [1.0, 1.0] and result.experience.batch_size == 2
    assert result.experience.rollout_ids.tolist() == [14, 15]


def test_chat_episode_segments_are_samples_of_one_rollout():
    engine = ScriptedEngine(["3<|im_end|>", "ok<|im_end|>"])
    runner = actor(Path(__file__).parent / "agents" / "chat_two_segments.py", engine)
    result = run(runner, [{"role": "user", "content": "1+2="}], "3", 3)
    exp = result.experience
    assert exp.batch_size == 6  # 3 rollouts x 2 segments
    assert exp.rollout_ids.tolist() == [21, 21, 22, 22, 23, 23] and exp.group_ids.tolist() == [7] * 6
    assert exp.rewards.tolist() == [1.0] * 6  # every sample carries its episode's reward ...
    assert result.rewards == [1.0, 1.0, 1.0]  # ... counted once per rollout in the group's statistics
    assert result.info == {"calls": 6.0}
    # the chat server rendered the raw messages itself: the first call starts with the chat template
    assert runner.tokenizer.decode(engine.calls[0][0]).startswith("<|im_start|>user\n1+2=")


def test_a_failing_chat_episode_drops_only_its_rollout():
    engine = ScriptedEngine(["boom<|im_end|>"])
    runner = actor(Path(__file__).parent / "agents" / "chat_two_segments.py", engine)
    result = run(runner, [{"role": "user", "content": "1+2="}], "3", 2)
    assert result.experience is None and result.dropped == {"agent_error": 2}
    assert all("agent failed on purpose" in e for e in result.errors)


class FailingEngine(ScriptedEngine):
    """An engine that raises on every request while alive, as the router reports it (runtime.engines.router)."""

    async def generate(self, prompt_ids, **kwargs):
        await super().generate(prompt_ids, **kwargs)
        raise EngineError("rollout engine 0 failed the request: ValueError: prompt of 900 tokens")


def test_an_engine_that_raises_drops_rollouts_as_engine_error_not_the_agents():
    """Step runner: the engine's error reaches the runner directly; chat runner: the agent gets a 502 from the
    loopback server and raises (its SDK's error), and the runner still names the engine. Both groups survive."""
    step = run(actor(ROOT / "recipes" / "agents" / "demo_math.py", FailingEngine(["3<|im_end|>"])), "1+2=", "3", 2)
    assert step.experience is None and step.dropped == {"engine_error": 2}
    assert all("rollout engine 0 failed the request: ValueError" in e for e in step.errors)
    chat = run(actor(Path(__file__).parent / "agents" / "chat_two_segments.py", FailingEngine(["3<|im_end|>"])),
               [{"role": "user", "content": "1+2="}], "3", 2)
    assert chat.experience is None and chat.dropped == {"engine_error": 2}
    assert all("rollout engine 0 failed the request" in e for e in chat.errors)


def test_episodes_without_action_tokens_are_dropped_with_a_reason():
    engine = ScriptedEngine([""])  # an engine that generates nothing (an immediate end-of-turn is one token)
    runner = actor(ROOT / "recipes" / "agents" / "demo_math.py", engine)
    result = run(runner, "1+2=", "3", 2)
    assert result.experience is None and result.dropped == {"no_action_tokens": 2}


TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}}}]


def test_a_rows_tools_reach_a_chat_agent_and_its_tool_calls_come_back():
    engine = ScriptedEngine(['<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call><|im_end|>'])
    runner = actor(Path(__file__).parent / "agents" / "chat_sees_tools.py", engine, max_length=256)
    sampling = SamplingParams(max_tokens=128, temperature=1.0, top_p=1.0, logprobs=True)  # room for the whole call
    result = asyncio.run(runner.run_group(GroupRequest(3, [{"role": "user", "content": "run it"}], None, 2, sampling,
                                                       tools=TOOLS)))
    assert result.rewards == [1.0, 1.0]


def test_step_runner_renders_the_rows_tools_with_the_chat_template():
    from runtime.runners import render

    class Template:
        """Records what the chat template was given (the tiny model's template does not print tools)."""

        def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
            return f"{messages}|{tools}"

    assert render(Template(), "hi", True, TOOLS) == f"{[{'role': 'user', 'content': 'hi'}]}|{TOOLS}"
    assert render(Template(), "hi", False, TOOLS) == "hi"  # no template: the text as the dataset holds it


def test_generator_reads_tools_from_the_tools_key(tmp_path):
    from runtime.datasource import read_prompts

    data = tmp_path / "rows.jsonl"
    data.write_text('{"q": "a", "y": 1, "t": [{"name": "x"}]}\n{"q": "b", "y": 2}\n')
    assert read_prompts(str(data), "train", "q", "y", "t", 10) == [("a", 1, [{"name": "x"}]), ("b", 2, None)]
    assert read_prompts(str(data), "train", "q", "y", None, 10) == [("a", 1, None), ("b", 2, None)]


class DeadEngine:
    """An engine client whose engine actor died: every call fails as Ray reports it."""

    async def generate(self, prompt_ids, **kwargs):
        import ray

        raise ray.exceptions.ActorDiedError()


def test_a_dead_engine_fails_the_group_instead_of_dropping_its_prompt():
    """Issue 13.6: with the engine dead, every rollout used to be dropped (agent_error, all_rollouts_dropped): the
    prompt counted as done and a resumed run skipped it. Now the group fails with EngineLost (left undone)."""
    import pytest

    from runtime.runners import EngineLost

    runner = actor(ROOT / "recipes" / "agents" / "demo_math.py", ScriptedEngine(["3<|im_end|>"]))
    runner.client = DeadEngine()
    with pytest.raises(EngineLost):
        run(runner, "1+2=", "3", 2)
