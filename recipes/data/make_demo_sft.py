"""Build the SFT demo's offline assets: a toy "spell the number" chat dataset and a random tiny Qwen3.

    python recipes/data/make_demo_sft.py        # writes recipes/data/demo_sft/{train,eval}.jsonl and model/

The task maps a number 0-99 to its English words ("spell 47" -> "forty seven"). The replies are a function of
the prompt, so the reply-token loss of the randomly initialised ~0.3 M-parameter model falls from ~ln(vocab) to
well under 1 within a few dozen optimizer steps on two CPU cores.

Both row shapes Molt's SFT dataset reads appear: a plain string prompt, and chat messages (a system turn and a
user turn); the reply is always the `response` string. A few rows have an empty response: the runtime drops and
counts them (Molt: rows with no assistant turn are dropped).

Deterministic: the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "demo_sft"
SEED = 0
TRAIN_ROWS = 1032        # 1024 trainable rows: 32 full steps of 32 rows per epoch
EMPTY_REPLY_ROWS = 8
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
SYSTEM = "Answer in words."


def spell(n: int) -> str:
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] + ("" if ones == 0 else " " + ONES[ones])


def row(n: int, as_messages: bool, reply: bool = True) -> dict:
    prompt: str | list[dict] = f"spell {n}"
    if as_messages:
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"spell {n}"}]
    return {"prompt": prompt, "response": spell(n) if reply else ""}


def corpus() -> list[str]:
    """Tokenizer training text: every prompt and reply, so number words become single tokens."""
    lines = [f"spell {n}\n{spell(n)}" for n in range(100)]
    return (lines + [SYSTEM, "user", "assistant", "system"]) * 5


def main() -> None:
    from runtime.tiny_model import build_tiny_model

    HERE.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    rows = [row(rng.randrange(100), as_messages=rng.random() < 0.5) for _ in range(TRAIN_ROWS)]
    for i in rng.sample(range(TRAIN_ROWS), EMPTY_REPLY_ROWS):
        rows[i] = row(rng.randrange(100), as_messages=False, reply=False)
    with open(HERE / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(HERE / "eval.jsonl", "w") as f:  # every number once, as a plain prompt
        f.writelines(json.dumps(row(n, as_messages=False)) + "\n" for n in range(100))
    build_tiny_model(HERE / "model", seed=SEED, corpus=corpus(), vocab_size=400)
    print(f"SFT demo data and model written to {HERE}")


if __name__ == "__main__":
    main()
