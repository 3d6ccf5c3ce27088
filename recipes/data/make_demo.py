"""Build the demo's offline assets: the toy-math prompt sets and a warm-started tiny Qwen3.

    python recipes/data/make_demo.py            # writes recipes/data/demo_math/{train,eval}.jsonl, model/, teacher/

The task is addition of two digits 0-2 ("1+2=" -> "3"; 9 facts, sums 0-4 are single tokens), rewarded 1 for the
exact sum (see recipes/agents/demo_math.py). Small on purpose: a ~0.3 M-parameter model learns it by RL in a
few dozen steps on two CPU cores. A randomly initialised model
never emits a number, so RL would have no signal; a few seconds of supervised warm-start on a *different* format
mix teaches it to answer with digits and end the turn, leaving the sums themselves mostly wrong. The demo's RL
run then has to learn the facts, which is what makes the reward rise.

Deterministic: the same seed gives byte-identical files (seeded data, tokenizer, init and warm-start).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "demo_math"
SEED = 0
MAX_OPERAND = 2
WARM_START_STEPS = 30   # supervised steps; chosen so the sampled accuracy starts low (see the module docstring)
TEACHER_STEPS = 200     # further supervised steps from the student: a teacher that knows most sums (distillation)


def task_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def corpus() -> list[str]:
    """Tokenizer training text: every prompt and answer, so digits and '+'/'=' are single tokens."""
    lines = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    return lines * 5 + [str(i) for i in range(100)]


def examples(rng: random.Random, tok) -> list[tuple[list[int], list[int]]]:
    """One warm-start step: 32 chat-templated prompts, the loss on the answer tokens (digits, then <|im_end|>)."""
    out = []
    for r in task_rows(rng, 32):
        prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((p_ids + a_ids, [0] * len(p_ids) + [1] * len(a_ids)))
    return out


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    from runtime.tiny_model import build_tiny_model, warm_start

    HERE.mkdir(parents=True, exist_ok=True)
    write_jsonl(HERE / "train.jsonl", task_rows(random.Random(SEED), 4096))
    write_jsonl(HERE / "eval.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)}  # every fact once
                                      for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)])
    model_dir = build_tiny_model(HERE / "model", seed=SEED, corpus=corpus(), vocab_size=300)
    warm_start(model_dir, examples, WARM_START_STEPS, SEED)
    build_teacher(model_dir, HERE / "teacher")
    print(f"demo data, warm-started model and teacher written to {HERE}")


def build_teacher(student_dir: Path, out: Path) -> Path:
    """The distillation demo's teacher (recipes/demo_math_distill.yaml): the student trained on the sums for longer,
    so it differs from the policy and answers most of them."""
    import shutil

    from runtime.tiny_model import warm_start

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(student_dir, out)
    warm_start(out, examples, TEACHER_STEPS, SEED + 1)
    return out


if __name__ == "__main__":
    main()
