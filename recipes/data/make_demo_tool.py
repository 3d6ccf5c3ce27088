"""Build the multi-turn tool demo's offline assets: the prompt sets and a warm-started tiny Qwen3.

    python recipes/data/make_demo_tool.py       # writes recipes/data/demo_tool/{train,eval}.jsonl and model/

The task is a product of two digits 2-9 ("7*8=" -> "56"), run by the geo3k agent (`recipes/agents/geo3k.py`): the
model may call its sandboxed Python tool with a fenced ```python block, reads the tool's output in the next turn,
and commits `\\boxed{...}`, graded by math-verify. A ~0.3 M-parameter model cannot learn 64 products in a demo's
minutes, but it can copy: the operands into `print(a*b)`, then the tool's output into the box. So the way to the
reward is to use the tool, and that is what RL has to discover.

The warm-start (supervised, a few seconds) teaches both formats on the exact token stream the runtime builds
(prompt, action, tool response as `geo3k.tool_observation` renders it, action), with the tool used in only
TOOL_RATE of the examples; the other examples answer at once with a wrong guess. The warm-started model therefore
calls the tool about that often and, when it does, copies well; RL then raises the tool-call rate and the reward.

Deterministic: the same seed gives byte-identical files (seeded data, tokenizer, init and warm-start).
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1]
HERE = RECIPES / "data" / "demo_tool"
SEED = 0
OPERANDS = range(2, 10)
TOOL_RATE = 0.35        # share of warm-start examples that call the tool (the rest guess)
WARM_START_STEPS = 400  # enough to copy reliably (see `measure`); format, not arithmetic
END_OF_TURN = "<|im_end|>"


def facts() -> list[tuple[int, int]]:
    return [(a, b) for a in OPERANDS for b in OPERANDS]


def task_rows(rng: random.Random, n: int) -> list[dict]:
    return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in (rng.choice(facts()) for _ in range(n))]


def tool_call(prompt: str) -> str:
    return f"```python\nprint({prompt.rstrip('=')})\n```"


def boxed(value: str) -> str:
    return f"\\boxed{{{value}}}"


def _geo3k():
    """The agent module, for the exact text of a tool response (one source of truth for the format)."""
    sys.path.append(str(RECIPES / "agents"))  # appended: an agent file named math.py must not shadow the stdlib
    import geo3k

    return geo3k


def corpus() -> list[str]:
    """Tokenizer training text: every prompt, tool call, tool response and answer, so each number is one token."""
    geo3k = _geo3k()
    lines = []
    for a, b in facts():
        call = tool_call(f"{a}*{b}=") + END_OF_TURN
        lines += [f"{a}*{b}=", call, geo3k.tool_observation(call, str(a * b)), boxed(str(a * b))]
    return lines * 5 + [str(i) for i in range(100)]


def episode_segments(row: dict, use_tool: bool, guess: str) -> list[tuple[str, bool]]:
    """(text, is_action) pieces of one episode after the chat-templated prompt, as the runner concatenates them."""
    if not use_tool:
        return [(boxed(guess) + END_OF_TURN, True)]
    call = tool_call(row["prompt"]) + END_OF_TURN
    return [(call, True), (_geo3k().tool_observation(call, row["answer"]), False),
            (boxed(row["answer"]) + END_OF_TURN, True)]


def examples(rng: random.Random, tok) -> list[tuple[list[int], list[int]]]:
    """One warm-start step: 32 mixed episodes (tool call + copied answer, or an immediate wrong guess), the loss on
    the action tokens only."""
    products = sorted({a * b for a, b in facts()})
    out = []
    for row in task_rows(rng, 32):
        ids = _encode(tok, _prompt(tok, row))
        mask = [0] * len(ids)
        guess = str(rng.choice([p for p in products if str(p) != row["answer"]]))
        for text, is_action in episode_segments(row, rng.random() < TOOL_RATE, guess):
            piece = _encode(tok, text)
            ids += piece
            mask += [int(is_action)] * len(piece)
        out.append((ids, mask))
    return out


def _prompt(tok, row: dict) -> str:
    return tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                   add_generation_prompt=True)


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def measure(model_dir: Path, samples_per_fact: int = 4, seed: int = 1) -> dict[str, float]:
    """Sampled (temperature 1) behaviour of the model on every fact, the tool run in the agent's own sandbox:
    tool-call rate, accuracy after a tool call, overall accuracy. For choosing TOOL_RATE/WARM_START_STEPS only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    geo3k = _geo3k()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = tok.convert_tokens_to_ids(END_OF_TURN)

    def turn(ids: list[int]) -> str:
        out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0,
                             eos_token_id=eos, pad_token_id=tok.pad_token_id)
        return tok.decode(out[0, len(ids):], skip_special_tokens=False)

    calls = correct = correct_after_call = 0
    n = 0
    for a, b in facts():
        row = {"prompt": f"{a}*{b}=", "answer": str(a * b)}
        for _ in range(samples_per_fact):
            n += 1
            ids = _encode(tok, _prompt(tok, row))
            first = turn(ids)
            code = geo3k.extract_tool_code(first)
            final = first
            if code is not None and geo3k.extract_answer(first) is None:
                calls += 1
                result = asyncio.run(geo3k.run_python(code, geo3k.Settings.from_env().limits))  # the agent's sandbox
                output = result.observation()
                ids += _encode(tok, first) + _encode(tok, geo3k.tool_observation(first, output))
                final = turn(ids)
                correct_after_call += int(geo3k.extract_answer(final) == row["answer"])
            correct += int(geo3k.extract_answer(final) == row["answer"])
    return {"tool_call_rate": calls / n, "accuracy_after_call": correct_after_call / max(calls, 1),
            "accuracy": correct / n}


def main() -> None:
    from make_demo import write_jsonl

    from runtime.tiny_model import build_tiny_model, warm_start

    HERE.mkdir(parents=True, exist_ok=True)
    write_jsonl(HERE / "train.jsonl", task_rows(random.Random(SEED), 4096))
    write_jsonl(HERE / "eval.jsonl", [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in facts()])  # each once
    model_dir = build_tiny_model(HERE / "model", seed=SEED, corpus=corpus(), vocab_size=400)
    warm_start(model_dir, examples, WARM_START_STEPS, SEED)
    print(f"demo data and warm-started model written to {HERE}")
    if "--measure" in sys.argv:
        print(measure(model_dir))


if __name__ == "__main__":
    main()
