"""GPU check: expert parallelism and HSDP on the automodel backend over NCCL, one GPU per rank (needs 2 or 4 GPUs;
not part of `just test`, whose tests/runtime/models/test_expert_parallel.py runs the same layouts on gloo CPU ranks).

    source tests/gpu/setup_device.sh .gpuwheels && python3 tests/gpu/check_expert_parallel.py OUT_DIR

The CPU test's own code with `MOLT_PARALLEL_DEVICE=cuda` (fp32, a tiny Qwen3-MoE, nemo-automodel's mesh and MoE
parallelizer, its `torch` token dispatcher, the real `PolicyWorker`): the one-GPU run, then EP 2 on 2 GPUs and, with
4 GPUs, EP 2 x dp 2, HSDP with EP 2 and HSDP alone, and LoRA (nemo-automodel's adapters) at EP 2 and EP 2 x dp 2,
and compiled decoder layers under routing replay at EP 2 (inductor's CUDA kernels for the attention and norms, the
MoE block eager; against the one-GPU eager replayed run; its graph breaks and graphs per rank are reported, the CPU
test's being `COMPILED_BREAKS, COMPILED_GRAPHS`); each must give the one-GPU run's old log-probs, loss statistics,
gradients and weights over three optimizer steps (relative 1e-5), the same weights through a weight sync and the HF
export, and a DCP checkpoint that resumes exactly. Writes OUT_DIR/expert_parallel_gpu.json and prints it; exit 1
on any difference. Not run yet: no multi-GPU machine has been lent (the capability rows rl/sft-trainer-ep-cuda and
-hsdp-cuda are CAP002 warnings until it passes on one).
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
    import test_expert_parallel as layouts
    import torch

    from runtime.tiny_model import build_tiny_model

    gpus = torch.cuda.device_count()
    if gpus < 2:
        print(f"needs 2 or more GPUs, found {gpus}", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="molt_ep_gpu_"))
    path = str(build_tiny_model(work / "model", seed=0, vocab_size=300, experts=4, experts_per_token=2,
                                tie_word_embeddings=False))
    lora = layouts.LORA
    single = layouts._run(1, [(layouts._mesh(1), None), (layouts._mesh(1), lora), (layouts._mesh(1), None, True)],
                          path, work / "single")
    runs = {"ep2+lora+compiled": (2, [(layouts._mesh(2), None), (layouts._mesh(2), lora),
                                      (layouts._mesh(2), None, True, True)])}
    if gpus >= 4:
        runs["ep2_dp2+hsdp_ep2+hsdp+lora"] = (4, [(layouts._mesh(2), None), (layouts._mesh(2, 2), None),
                                                  (layouts._mesh(1, 2), None), (layouts._mesh(2), lora)])
    report: dict = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "layouts": {}}
    for name, (world, meshes) in runs.items():
        for k, ranks in enumerate(layouts._run(world, meshes, path, work / name)):
            replayed = len(meshes[k]) > 2 and meshes[k][2]
            if replayed:
                report[f"{name}[{k}] graph breaks, graphs"] = [(r["graph_breaks"], r["graphs"]) for r in ranks]
            try:
                layouts._check(single[2 if replayed else 1 if meshes[k][1] is not None else 0][0], ranks)
                report["layouts"][f"{name}[{k}]"] = "equal"
            except AssertionError as exc:
                report["layouts"][f"{name}[{k}]"] = str(exc)[:2000]
    text = json.dumps(report, indent=1)
    (out / "expert_parallel_gpu.json").write_text(text)
    print(text)
    return 0 if all(v == "equal" for v in report["layouts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
