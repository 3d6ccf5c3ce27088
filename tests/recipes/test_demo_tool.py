"""The multi-turn tool demo's offline assets agree with the agent that runs them.

The warm-start (recipes/data/make_demo_tool.py) writes the token stream it believes the runtime builds; if the geo3k
agent's tool-response format or the runner's tokenization drifted, the committed model would be trained on a format
it never sees in RL. These tests run the real StepEnvRunner + geo3k agent + sandbox on the warm-start's own texts.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
sys.path.append(str(RECIPES / "agents"))
sys.path.append(str(RECIPES / "data"))

import make_demo_tool as demo  # noqa: E402

from runtime.agents import GenerateOutput, SamplingParams, load_agent_runner  # noqa: E402

DATA = RECIPES / "data" / "demo_tool"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DATA / "model")


def test_prompt_sets_cover_the_facts_with_true_products():
    evals = [json.loads(line) for line in (DATA / "eval.jsonl").read_text().splitlines()]
    assert sorted((r["prompt"], r["answer"]) for r in evals) == sorted(
        (f"{a}*{b}=", str(a * b)) for a in range(2, 10) for b in range(2, 10))
    train = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()]
    assert len(train) == 4096
    for row in train:
        a, b = row["prompt"].rstrip("=").split("*")
        assert row["answer"] == str(int(a) * int(b)) and 2 <= int(a) <= 9 and 2 <= int(b) <= 9


def test_every_product_and_operand_is_one_token(tokenizer):
    """Copying a number is then copying one token, which is what a 2-layer model can learn in seconds."""
    for value in {a * b for a, b in demo.facts()} | set(demo.OPERANDS):
        assert len(tokenizer.encode(str(value), add_special_tokens=False)) == 1, value


class ReplayEngine:
    """Replies with the warm-start's action texts, in order."""

    def __init__(self, tokenizer, actions):
        self.tokenizer, self.actions, self.calls = tokenizer, actions, 0

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, session_id, logprobs):
        ids = self.tokenizer.encode(self.actions[self.calls], add_special_tokens=False)
        self.calls += 1
        return GenerateOutput(ids, [-0.5] * len(ids) if logprobs else [], "stop")


@pytest.mark.parametrize("use_tool", [True, False])
def test_the_runtime_builds_the_warm_starts_token_stream(tokenizer, use_tool):
    row = {"prompt": "7*8=", "answer": "56"}
    segments = demo.episode_segments(row, use_tool, guess="54")
    runner = load_agent_runner(RECIPES / "agents" / "geo3k.py")
    prompt = demo._prompt(tokenizer, row)
    engine = ReplayEngine(tokenizer, [text for text, is_action in segments if is_action])
    traj = asyncio.run(runner.execute(prompt, row["answer"], sampling=SamplingParams(max_tokens=16, logprobs=True),
                                      max_length=96, tokenizer=tokenizer, client=engine))

    expected, mask = demo._encode(tokenizer, prompt), []
    mask = [False] * len(expected)
    for text, is_action in segments:
        piece = demo._encode(tokenizer, text)
        expected += piece
        mask += [is_action] * len(piece)
    assert traj.token_ids == expected  # the tool really ran in the sandbox and printed 56
    assert traj.action_mask() == mask
    assert traj.turns == (2 if use_tool else 1)
    assert traj.reward == (1.0 if use_tool else 0.0)
    assert traj.info["tool_calls"] == float(use_tool) and traj.info["tool_failures"] == 0.0
