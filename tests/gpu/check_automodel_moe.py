"""GPU check: a tiny Qwen3-MoE trains through nemo-automodel on one GPU (not part of `just test`).

    python3 tests/gpu/check_automodel_moe.py OUT_DIR [STEPS]

Needs nemo-automodel importable. The H200 machines have torch (CUDA) and transformers but not nemo-automodel: carry
its wheel and the few it needs and install them without dependencies first (they leave torch and transformers as
they are):
    pip download --no-deps -d .cache/gpu_wheels nemo-automodel==0.7.0 megatron-fsdp==0.5.0 "torchao>=0.16.0" torchdata
    (on the GPU machine) pip install --no-deps .cache/gpu_wheels/*.whl
(8 MB: nemo_automodel 3.8, torchao 3.4, megatron_fsdp 0.1, torchdata 0.06; `*.whl` is git-ignored, so carry the
folder.) The H200 image has torch 2.11.0+cu130 and transformers 5.17.0, while nemo-automodel 0.7.0 pins
transformers==5.18.0: if its import fails on 5.17, carry the transformers 5.18.0 wheel too (not tried yet).

What runs: `runtime.tiny_model` builds a random Qwen3-MoE (2 layers, 4 experts, top-2, untied embeddings: NeMo's
Qwen3-MoE class refuses tied ones); `NeMoAutoModelForCausalLM.from_pretrained` loads it as NeMo's own MoE
implementation (its `Gate` routers and grouped experts) on cuda:0 in a world-1 process group; the routers are frozen
by type (Molt F11) and the rest trains with AdamW (bf16 autocast, fp32 master weights) on a fixed batch for STEPS
steps. Checks: the model class is NeMo's, the loss falls, the routers are unchanged and fp32, the experts moved.
Writes OUT_DIR/automodel_moe_gpu.json and prints it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(out_dir: str, steps: int = 30) -> dict:
    import torch
    import torch.distributed as dist

    from runtime.tiny_model import build_tiny_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "moe", seed=0, vocab_size=300, experts=4,
                                 experts_per_token=2, tie_word_embeddings=False)
    t0 = time.perf_counter()
    from nemo_automodel import NeMoAutoModelForCausalLM

    model = NeMoAutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, use_liger_kernel=False,
                                                     attn_implementation="sdpa")
    model.to("cuda")
    build_s = time.perf_counter() - t0
    gates = {n: m for n, m in model.named_modules() if type(m).__name__ == "Gate"}
    gate_params = {f"{n}.{pn}": p for n, m in gates.items() for pn, p in m.named_parameters()}
    for p in gate_params.values():
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 290, (8, 64), generator=g).cuda()
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids)
        logits = (out.logits if hasattr(out, "logits") else out).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    params = dict(model.named_parameters())
    moved = {n: not torch.equal(before[n], p.detach()) for n, p in params.items()}
    result = {
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "nemo_automodel": __import__("nemo_automodel").__version__,
        "build_s": round(build_s, 2), "train_s": round(train_s, 2), "steps": steps,
        "loss_first": losses[0], "loss_last": losses[-1],
        "gates": len(gates), "gate_dtypes": sorted({str(p.dtype) for p in gate_params.values()}),
        "gates_unchanged": not any(moved[n] for n in gate_params),
        "experts_moved": any(v for n, v in moved.items() if "experts" in n),
        "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
    }
    result["ok"] = bool("nemo_automodel" in result["model_class"] and losses[-1] < losses[0] and gates
                        and result["gates_unchanged"] and result["experts_moved"]
                        and result["gate_dtypes"] == ["torch.float32"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "automodel_moe_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)["ok"] else 1)
