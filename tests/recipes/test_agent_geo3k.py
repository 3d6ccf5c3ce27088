"""The geo3k multi-turn agent: tool-call parsing, tool output fed back, turn limit, final-answer grading."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

AGENTS = Path(__file__).resolve().parents[2] / "recipes" / "agents"
sys.path.append(str(AGENTS))

from runtime.agents import GenerateOutput, SamplingParams, load_agent_runner  # noqa: E402


@pytest.fixture(scope="module")
def geo3k():
    runner = load_agent_runner(AGENTS / "geo3k.py")
    return runner, sys.modules[runner.env_cls.__module__]


@pytest.fixture(scope="module")
def tokenizer():
    from runtime.tiny_model import build_tokenizer, default_corpus

    return build_tokenizer(default_corpus())


class ScriptedEngine:
    """Replies with the session's next scripted text; records the prompts it was given (decoded)."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, replies, []

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, session_id, logprobs):
        self.prompts.append(self.tokenizer.decode(prompt_ids, skip_special_tokens=False))
        text = self.replies[min(len(self.prompts) - 1, len(self.replies) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]
        return GenerateOutput(ids, [-0.25] * len(ids) if logprobs else [], "stop")


def episode(geo3k, tokenizer, replies, label="42"):
    runner, _ = geo3k
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Side a=6, b=7; area of the rectangle?"}],
                                           tokenize=False, add_generation_prompt=True)
    engine = ScriptedEngine(tokenizer, replies)
    traj = asyncio.run(runner.execute(prompt, label, sampling=SamplingParams(max_tokens=200), max_length=2048,
                                      tokenizer=tokenizer, client=engine))
    return traj, engine


# --------------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("text", "code"), [
    ("Let me compute.\n```python\nprint(6*7)\n```", "print(6*7)\n"),
    ("```py\nx = 1\n```", "x = 1\n"),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(2)"}}</tool_call>', "print(2)"),
    ("<tool_call>\n<function=python>\n<parameter=code>\nprint(3)\n</parameter>\n</function>\n</tool_call>", "print(3)"),
    ("```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "print(2)\n"),  # the last call counts
    ("<tool_call>not json</tool_call>", ""),  # a malformed call is a call with no code
    ("no tool here ```\nprint(1)\n```", None),  # an unlabelled fence is not a tool call
])
def test_extract_tool_code(geo3k, text, code):
    assert geo3k[1].extract_tool_code(text) == code


# --------------------------------------------------------------------------------------------------- episodes
def test_tool_output_is_fed_back_and_answer_graded(geo3k, tokenizer):
    traj, engine = episode(geo3k, tokenizer, ["```python\nprint(6 * 7)\n```<|im_end|>", r"So \boxed{42}<|im_end|>"])
    assert traj.reward == 1.0 and traj.turns == 2 and not traj.truncated
    assert len(traj.action_ranges) == 2
    # the second prompt is the first prompt + the action + the tool response turn, and nothing else
    expected_obs = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert engine.prompts[1] == engine.prompts[0] + "```python\nprint(6 * 7)\n```<|im_end|>" + expected_obs
    assert traj.info["tool_calls"] == 1.0 and traj.info["tool_failures"] == 0.0 and traj.info["correct"] == 1.0
    # the observation tokens carry no rollout logprob; the actions carry the engine's
    start, end = traj.action_ranges[0]
    assert set(traj.rollout_log_probs[start:end]) == {-0.25}
    assert set(traj.rollout_log_probs[end:traj.action_ranges[1][0]]) == {0.0}


def test_wrong_final_answer_scores_zero(geo3k, tokenizer):
    traj, _ = episode(geo3k, tokenizer, [r"<answer>41</answer><|im_end|>"])
    assert traj.reward == 0.0 and traj.turns == 1 and traj.info["has_answer"] == 1.0


def test_no_tool_and_no_answer_ends_with_zero(geo3k, tokenizer):
    traj, _ = episode(geo3k, tokenizer, ["I am not sure.<|im_end|>"])
    assert traj.reward == 0.0 and traj.turns == 1 and not traj.truncated and traj.info["has_answer"] == 0.0


def test_answer_in_the_same_turn_as_a_tool_call_ends_the_episode(geo3k, tokenizer):
    traj, _ = episode(geo3k, tokenizer, ["```python\nprint(1)\n```\n\\boxed{42}<|im_end|>"])
    assert traj.reward == 1.0 and traj.turns == 1 and traj.info["tool_calls"] == 0.0


def test_turn_limit_truncates(geo3k, tokenizer, monkeypatch):
    monkeypatch.setenv("MAX_AGENT_TURNS", "2")
    traj, engine = episode(geo3k, tokenizer, ["```python\nprint('again')\n```<|im_end|>"])
    assert traj.turns == 2 and traj.truncated and traj.reward == 0.0
    assert traj.info["tool_calls"] == 1.0  # the pending call at the limit is not run
    assert "<tool_response>\nagain\n</tool_response>" in engine.prompts[1]


def test_failing_tool_is_reported_to_the_model(geo3k, tokenizer, monkeypatch):
    monkeypatch.setenv("PYTHON_EXECUTOR_TIMEOUT", "3")
    traj, engine = episode(geo3k, tokenizer, ["```python\nwhile True:\n    pass\n```<|im_end|>",
                                              "```python\nimport socket\nsocket.create_connection(('1.1.1.1', 80), 2)\n```",
                                              r"\boxed{42}"])
    assert traj.reward == 1.0 and traj.turns == 3
    assert traj.info["tool_failures"] == 2.0
    assert "[timed out: the code was stopped]\n</tool_response>" in engine.prompts[1]
    assert "Network is unreachable" in engine.prompts[2] and "[exit code 1]" in engine.prompts[2]
    # the second action had no <|im_end|>: the env closed the turn itself
    assert "```<|im_end|>\n<|im_start|>user\n<tool_response>" in engine.prompts[2]


def test_empty_tool_call(geo3k, tokenizer):
    traj, engine = episode(geo3k, tokenizer, ["<tool_call>{}</tool_call><|im_end|>", r"\boxed{1}"])
    assert "error: empty tool call" in engine.prompts[1] and traj.info["tool_failures"] == 1.0
