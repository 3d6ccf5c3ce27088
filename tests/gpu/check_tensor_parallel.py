"""GPU check: tensor parallelism on the automodel backend over NCCL, one GPU per rank (needs 2 or 4 GPUs; not part
of `just test`, whose tests/runtime/models/test_tensor_parallel.py runs the same layouts on gloo CPU ranks).

    source tests/gpu/setup_device.sh .gpuwheels && python3 tests/gpu/check_tensor_parallel.py OUT_DIR

The CPU test's own code with `MOLT_PARALLEL_DEVICE=cuda` (fp32, a tiny dense Qwen3, nemo-automodel's mesh, dense
parallelizer and Qwen3 TP plan, the real `PolicyWorker`): the one-GPU run, then TP 2 on 2 GPUs and, with 4 GPUs,
TP 2 x dp 2, with 8 TP 2 x HSDP (dp_replicate 2, dp_shard 2), each without and with LoRA (nemo-automodel's adapters under its LoRA-aware plan) and with CPU offload (`actor.offload`: full, optimizer); each must give
the one-GPU run's old log-probs, loss statistics, gradients and weights over three
optimizer steps (relative 1e-5), the same weights through a weight sync and the HF export, and a DCP checkpoint that
resumes exactly. Writes OUT_DIR/tensor_parallel_gpu.json and prints it; exit 1 on any difference. Not run yet: no
multi-GPU machine has been lent (the capability rows rl/sft-trainer-tp-cuda are CAP002 warnings until it passes on
one).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "runtime"), str(ROOT / "tests" / "runtime" / "models")]
os.environ["MOLT_PARALLEL_DEVICE"] = "cuda"


def main() -> int:
    import test_expert_parallel as checks
    import test_tensor_parallel as layouts
    import torch

    from runtime.tiny_model import build_tiny_model
    from schemas.plan import MeshPlan

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"needs 2 or more GPUs, found {gpus}", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="molt_tp_gpu_"))
    path = str(build_tiny_model(work / "model", seed=0, vocab_size=300, tie_word_embeddings=False))
    plain = [(layouts._mesh(1), None), (layouts._mesh(1), checks.LORA)]
    singles = [ranks[0] for ranks in layouts._run(1, plain, path, work / "single")]
    runs = {"tp2": 2} | ({"tp2_dp2": 4} if gpus >= 4 else {}) | ({"tp2_hsdp": 8} if gpus >= 8 else {})
    report: dict = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "layouts": {}}
    for name, world in runs.items():
        mesh = MeshPlan(tp=2, cp=1, ep=1, pp=1, dp_replicate=2 if name == "tp2_hsdp" else 1)
        meshes = [(mesh, None), (mesh, checks.LORA)]
        for k, (single, ranks) in enumerate(zip(singles, layouts._run(world, meshes, path, work / name),
                                                strict=True)):
            key = name + ("+lora" if k else "")
            try:
                checks._check(single, ranks)
                report["layouts"][key] = "equal"
            except AssertionError as exc:
                report["layouts"][key] = str(exc)[:2000]
        # CPU offload at both levels in a spawn of their own, `full` first: the spawn's one process group is its
        # first layout's, and full offload's host shards need the cuda:nccl,cpu:gloo group
        offloaded = [(mesh, None, False, "full"), (mesh, None, False, "optimizer")]
        for (*_, level), ranks in zip(offloaded, layouts._run(world, offloaded, path, work / f"{name}_offload"),
                                      strict=True):
            key = f"{name}+offload-{level}"
            try:
                checks._check(singles[0], ranks)
                report["layouts"][key] = "equal"
            except AssertionError as exc:
                report["layouts"][key] = str(exc)[:2000]
    text = json.dumps(report, indent=1)
    (out / "tensor_parallel_gpu.json").write_text(text)
    print(text)
    return 0 if all(v == "equal" for v in report["layouts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
