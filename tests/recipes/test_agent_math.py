"""The math agent and the shared grader: answer extraction, math-verify equivalence, the timeout worker."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

AGENTS = Path(__file__).resolve().parents[2] / "recipes" / "agents"
sys.path.append(str(AGENTS))
from grading import Grader, extract_answer, grade_answer, normalize_scientific  # noqa: E402

from runtime.agents import GenerateOutput, SamplingParams, StepEnvRunner, load_agent_runner  # noqa: E402


@pytest.mark.parametrize(("response", "label", "correct"), [
    # boxed and <answer> forms
    (r"6 times 7 is \boxed{42}", "42", True),
    ("<answer>42</answer>", "42", True),
    (r"\fbox{42}", 42, True),
    # fractions, decimals, scientific notation, LaTeX
    (r"\boxed{\frac{1}{2}}", "0.5", True),
    ("<answer>1/2</answer>", r"\frac{1}{2}", True),
    (r"\boxed{0.75}", "3/4", True),
    ("<answer>6.02e23</answer>", r"6.02\times10^{23}", True),
    (r"\boxed{1.5 \times 10^{3}}", "1500", True),
    ("<answer>1E-3</answer>", 0.001, True),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt 3}{2}", True),
    (r"\boxed{x = 3}", "3", True),
    (r"\boxed{2.0}", "2", True),
    # the last answer counts
    (r"first \boxed{2}, corrected: \boxed{3}", "3", True),
    (r"\boxed{3} then <answer>2</answer>", "3", False),
    # wrong answers
    (r"\boxed{41}", "42", False),
    (r"\boxed{0.333}", "1/3", False),
    ("<answer>6.02e22</answer>", "6.02e23", False),
    # no answer form, or a broken one, scores 0 even when the number appears
    ("the answer is 42", "42", False),
    (r"\boxed{42", "42", False),
    ("<answer></answer>", "42", False),
    # a list label means any of its items
    (r"\boxed{5}", ["4", "5"], True),
    # a dataset reward_model dict is unwrapped (geo3k / verl layout); no ground truth means nothing matches
    (r"\boxed{3}", {"ground_truth": "3", "style": "rule"}, True),
    (r"\boxed{3}", {"style": "rule"}, False),
])
def test_grade_answer(response, label, correct):
    assert grade_answer(response, label) is correct


def test_extract_answer_nested_braces_and_tags():
    assert extract_answer(r"so \boxed{\frac{a}{b}} done") == r"\frac{a}{b}"
    assert extract_answer(r"<answer> \boxed{8} </answer>") == "8"
    assert extract_answer("nothing here") is None


def test_normalize_scientific_leaves_identifiers_alone():
    assert normalize_scientific("6.02e23 and 1E-3 and x2e3 and e5") == r"6.02\times10^{23} and 1\times10^{-3} and x2e3 and e5"


def test_grader_worker_times_out_and_recovers():
    async def main():
        grader = Grader(timeout_s=1.0)
        slow = await grader.grade(r"\boxed{9^{9^{9^{9}}}}", "5")  # sympy would spin for a long time on this
        ok = await grader.grade(r"\boxed{5}", "5")  # a fresh worker answers the next case
        none = await grader.grade("no answer", "5")
        return slow, ok, none

    slow, ok, none = asyncio.run(main())
    assert slow.timed_out and not slow.correct
    assert ok.correct and not ok.timed_out
    assert not none.has_answer and not none.correct


# --------------------------------------------------------------------------------------------------- the agent file
class OneReplyEngine:
    """Replies with fixed text (tokenized with the real tiny tokenizer); implements the generate protocol."""

    def __init__(self, tokenizer, text):
        self.tokenizer, self.text = tokenizer, text

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, session_id, logprobs):
        ids = self.tokenizer.encode(self.text, add_special_tokens=False)[:max_tokens]
        return GenerateOutput(ids, [-0.5] * len(ids) if logprobs else [], "stop")


@pytest.fixture(scope="module")
def tokenizer():
    from runtime.tiny_model import build_tokenizer, default_corpus

    return build_tokenizer(default_corpus())


@pytest.mark.parametrize(("reply", "reward"), [(r"It is \boxed{\frac{3}{4}}<|im_end|>", 1.0),
                                               (r"It is \boxed{0.7}<|im_end|>", 0.0),
                                               ("It is 0.75<|im_end|>", 0.0)])
def test_math_agent_episode(tokenizer, reply, reward):
    runner = load_agent_runner(AGENTS / "math.py")
    assert isinstance(runner, StepEnvRunner) and runner.env_cls.__name__ == "MathEnv"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3/4 as a decimal?"}],
                                           tokenize=False, add_generation_prompt=True)
    traj = asyncio.run(runner.execute(prompt, "0.75", sampling=SamplingParams(max_tokens=64), max_length=512,
                                      tokenizer=tokenizer, client=OneReplyEngine(tokenizer, reply)))
    assert traj.reward == reward and traj.turns == 1 and not traj.truncated
    assert traj.info["has_answer"] == float("boxed" in reply)
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) == prompt + reply
