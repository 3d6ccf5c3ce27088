"""Build the MoE demo's model: a warm-started tiny Qwen3-MoE on the demo's toy-math task.

    python recipes/data/make_demo_moe.py        # writes recipes/data/demo_moe/model/

Same task, data and warm-start as `make_demo.py` (recipes/demo_moe.yaml reads demo_math's train/eval sets); the
model is a Qwen3-MoE of 2 layers with 4 experts, 2 routed per token, untied embeddings, so routing replay (R3), the frozen router and
the aux losses have something to act on. Deterministic: the same seed gives byte-identical files.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo import SEED, WARM_START_STEPS, corpus, examples  # noqa: E402

HERE = Path(__file__).resolve().parent / "demo_moe"


def main() -> None:
    from runtime.tiny_model import build_tiny_model, warm_start

    # untied embeddings: nemo-automodel's Qwen3-MoE (the demo's automodel backend) refuses tied ones (rule MOE014)
    model_dir = build_tiny_model(HERE / "model", seed=SEED, corpus=corpus(), vocab_size=300, experts=4,
                                 experts_per_token=2, tie_word_embeddings=False)
    warm_start(model_dir, examples, WARM_START_STEPS, SEED)
    print(f"warm-started tiny Qwen3-MoE written to {model_dir}")


if __name__ == "__main__":
    main()
