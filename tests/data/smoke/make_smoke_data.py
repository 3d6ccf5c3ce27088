"""Tiny offline stand-ins for the datasets the Molt launch recipes name, in the same on-disk format (`save_to_disk`
directories) and row schema as Molt's prepare scripts write them, for `molt-compile RECIPE --smoke`:

| directory | stands in for | used by |
|---|---|---|
| `proRL_text_rl/{train,eval}` | `.tmp/proRL_text_rl` (DeepScaleR / AIME text math) | qwen3_4b_math*, sft_qwen3_4b* |
| `geo3k/{train,eval}` | `.tmp/geo3k` (geometry with one image, answers in `\\boxed{}`) | qwen3_6_35b_geo3k*, glm5_ep256, sft_qwen3_6_35b*, sft_omni3_30b |
| `geo3k_answer/{train,eval}` | `.tmp/geo3k_answer` (the same, answers in `<answer>...</answer>`) | omni3_30b_geo3k, omni3_30b_distill |

Columns (Molt's examples/python/utils/prepare_*.py): `datasource`; `prompt`, a list of chat messages (the recipes'
`data.input_key`); `reward_model` = `{ground_truth, style: "rule"}` (RL `data.label_key`, graded by
recipes/agents/grading.py); `response`, the assistant reply ending in the answer (SFT `data.output_key`); geo3k adds
`tools` (the python tool schema, `data.tools_key`) and `images`, a list of one PIL image (`data.image_key`).

The problems are real, small, and their labels are correct (checked below with the agents' grader), so a smoke run's
rewards mean something. Deterministic: the same bytes on every run (`python tests/data/smoke/make_smoke_data.py`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_ROWS, EVAL_ROWS = 32, 8

MATH_INSTRUCTION = "\n\nLet's think step by step and output the final answer within \\boxed{}."
GEO_INSTRUCTION = (" Reason step by step inside <think>...</think>, calling python_executor as needed to verify "
                   "intermediate computations. Provide your final answer in ")
GEO_WRAPPERS = {"boxed": ("\\boxed{}.", "\\boxed{{{}}}"), "answer": ("<answer>...</answer>.", "<answer>{}</answer>")}
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "python_executor",
        "description": "Run a Python snippet in a sandbox for math/geometry calculations. Returns captured stdout.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source."}},
                       "required": ["code"]},
    },
}


def math_problem(rng: random.Random) -> tuple[str, str, str]:
    """(problem, solution, answer) of a one-step word problem."""
    kind = rng.randrange(4)
    a, b = rng.randint(2, 40), rng.randint(2, 12)
    if kind == 0:
        return (f"A shelf holds {a} books and {b} more are added. How many books are on the shelf?",
                f"{a} + {b} = {a + b}.", str(a + b))
    if kind == 1:
        return (f"Each of {b} boxes holds {a} pencils. How many pencils are there in total?",
                f"{b} \\times {a} = {a * b}.", str(a * b))
    if kind == 2:
        return (f"Solve for $x$: $x - {b} = {a}$.", f"Add {b} to both sides: $x = {a} + {b} = {a + b}$.",
                str(a + b))
    num, den = rng.randint(1, 9), rng.randint(10, 19)
    return (f"Simplify $\\frac{{{num * b}}}{{{den * b}}}$.", f"Divide numerator and denominator by {b}.",
            f"\\frac{{{num}}}{{{den}}}")


TRIPLES = [(3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (9, 12, 15), (7, 24, 25), (12, 16, 20), (20, 21, 29)]


def geo_problem(rng: random.Random) -> tuple[str, str, tuple]:
    """(problem, answer, drawing) of a geometry question about the shape in its image."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b, c = rng.choice(TRIPLES)
        return (f"<image>\nThe right triangle in the figure has legs {a} and {b}. Find x, the length of the "
                "hypotenuse.", str(c), ("triangle", a, b))
    if kind == 1:
        w, h = rng.randint(2, 15), rng.randint(2, 15)
        return f"<image>\nFind the area of the rectangle with sides {w} and {h}.", str(w * h), ("rectangle", w, h)
    angle = rng.randint(20, 70)
    return (f"<image>\nIn the right triangle shown, one acute angle measures {angle}°. Find x, the other acute "
            "angle, in degrees.", str(90 - angle), ("triangle", angle, 90 - angle))


def draw(shape: tuple, size: int = 32):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(img)
    kind, a, b = shape
    w, h = max(6, min(size - 4, 2 * a)), max(6, min(size - 4, 2 * b))
    if kind == "rectangle":
        pen.rectangle([2, 2, 2 + w, 2 + h], outline="black")
    else:
        pen.polygon([(2, size - 3), (2 + w, size - 3), (2, size - 3 - h)], outline="black")
    return img


def proRL(n: int, seed: int, source: str) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        problem, solution, answer = math_problem(rng)
        rows.append({"datasource": source,
                     "prompt": [{"role": "user", "content": problem + MATH_INSTRUCTION}],
                     "reward_model": {"ground_truth": answer, "style": "rule"},
                     "response": [{"role": "assistant", "content": f"{solution}\n\n\\boxed{{{answer}}}"}]})
    return rows


def geo3k(n: int, seed: int, wrapper: str) -> list[dict]:
    rng = random.Random(seed)
    ask, reply = GEO_WRAPPERS[wrapper]
    rows = []
    for _ in range(n):
        problem, answer, shape = geo_problem(rng)
        rows.append({"datasource": "geo3k_imgurl_processed",
                     "prompt": [{"role": "user", "content": problem + GEO_INSTRUCTION + ask}],
                     "tools": [TOOL_SCHEMA],
                     "reward_model": {"ground_truth": answer, "style": "rule"},
                     "response": [{"role": "assistant", "content": reply.format(answer)}],
                     "images": [draw(shape)]})
    return rows


def save(rows: list[dict], out: Path) -> None:
    import datasets

    features = None
    if "images" in rows[0]:
        inferred = datasets.Dataset.from_list([{k: v for k, v in r.items() if k != "images"} for r in rows[:1]])
        features = datasets.Features({**inferred.features, "images": datasets.List(datasets.Image())})
    ds = datasets.Dataset.from_list(rows, features=features)
    ds.save_to_disk(str(out))


def check_labels(rows: list[dict]) -> None:
    """Every row's own response grades as correct: the labels are right and the answer format is the grader's."""
    sys.path.insert(0, str(HERE.parents[2] / "recipes" / "agents"))
    from grading import grade_answer

    for r in rows:
        assert grade_answer(r["response"][0]["content"], r["reward_model"]), r


def main() -> None:
    sets = {
        "proRL_text_rl": (proRL(TRAIN_ROWS, 1, "DeepScaleR-Preview-Dataset"), proRL(EVAL_ROWS, 2, "aime_2024")),
        "geo3k": (geo3k(TRAIN_ROWS, 3, "boxed"), geo3k(EVAL_ROWS, 4, "boxed")),
        "geo3k_answer": (geo3k(TRAIN_ROWS, 5, "answer"), geo3k(EVAL_ROWS, 6, "answer")),
    }
    for name, (train, evals) in sets.items():
        check_labels(train + evals)
        save(train, HERE / name / "train")
        save(evals, HERE / name / "eval")
        print(f"{name}: {len(train)} train + {len(evals)} eval rows")


if __name__ == "__main__":
    main()
