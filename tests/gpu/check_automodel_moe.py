"""GPU check: a tiny Qwen3-MoE trains through the automodel backend on one GPU (not part of `just test`).

    source tests/gpu/setup_device.sh .gpuwheels && python3 tests/gpu/check_automodel_moe.py OUT_DIR [STEPS]

The carry (tests/gpu/make_carry.sh) brings nemo-automodel 0.7.0 and what its import needs beyond the H200 image
(megatron-fsdp, torchao, torchdata, and transformers 5.18.0, its pin: the image's 5.17 lacks `resolve_revision`).

What runs, through the runtime's own code: `runtime.models.automodel.build` (nemo-automodel's own Qwen3-MoE
implementation, its `Gate` routers and grouped experts, FSDP2 over a world-1 NCCL mesh, bf16 compute with fp32
master weights and fp32 routers, routers frozen by type: Molt F11) on a random Qwen3-MoE from `runtime.tiny_model`
(2 layers, 4 experts, top-2, untied embeddings); then
1. routing replay (R3): the routing of one forward is recorded, the gate weights are perturbed, and the replayed
   forward selects the recorded experts for every token (without replay it does not);
2. STEPS AdamW steps (`runtime.fsdp`) on a fixed batch with the recipe-style aux losses from the gates' logits
   (`runtime.moe`): the loss falls, the gates stay fp32 and unchanged, the experts move.
Writes OUT_DIR/automodel_moe_gpu.json and prints it.
Run 2026-12-05 (one H100, 30 steps): ok; build 3.4 s, training 12.4 s; replayed forward selects the recorded experts
for 100 % of the tokens, 17.7 % agreement live after the perturbation; loss 5.72 -> 3.33, balance 1.006 -> 1.000;
gates fp32 and unchanged, experts moved, peak 121 MB.
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

    from runtime import fsdp, moe
    from runtime.logprobs import token_logprobs
    from runtime.models import automodel
    from runtime.tiny_model import build_tiny_model
    from schemas.plan import ModelPlan, OptimizerPlan

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    mesh = automodel.device_mesh("cuda", 1, None)
    path = str(build_tiny_model(Path(tempfile.mkdtemp()) / "moe", seed=0, vocab_size=300, experts=4,
                                experts_per_token=2, tie_word_embeddings=False))
    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="bfloat16", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")
    t0 = time.perf_counter()
    model = automodel.build(plan, path, mesh, device, freeze_router=True)
    build_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 290, (8, 64), generator=g).to(device)
    mask = torch.ones_like(ids)

    def full(p):
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    def local(p):
        return p.to_local() if hasattr(p, "to_local") else p

    not_sharded = [n for n, p in model.named_parameters() if not hasattr(p, "full_tensor")]

    # 1. R3 on a perturbed copy
    with moe.record(model) as captured, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    recorded = torch.stack([c.to(torch.int16) for c in captured], dim=1)
    before = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for gate in moe.routers(model):
            local(gate.weight).add_(torch.randn(gate.weight.shape, generator=g).to(device) * 3.0)
    with moe.replay(model) as state, torch.no_grad():
        state.targets = recorded
        model(input_ids=ids, attention_mask=mask)
    replayed_match = sum(int((c.sort(-1).values == recorded[:, i].long().sort(-1).values).all(-1).sum())
                         for i, c in enumerate(state.selected)) / (recorded.shape[0] * recorded.shape[1])
    live_agreement = state.agreed / state.known
    with torch.no_grad():  # back to the checkpoint's gates
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                local(p).copy_(before[name])

    # 2. training steps with the aux losses
    opt = OptimizerPlan(name="adam", lr=3e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, max_norm=1.0,
                        scheduler="constant", warmup_steps=0, total_steps=steps, min_lr_ratio=0.1, muon=None)
    optimizer, scheduler = fsdp.build_optimizer(opt, model)
    real = mask.reshape(-1).bool()
    losses, balances = [], []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        with moe.collect_logits(model) as sink:
            logprobs = token_logprobs(model, ids, mask, 1.0)[0]
        balance = moe.load_balancing_loss(sink.logits, 2, real)
        loss = -logprobs.mean() + 1e-3 * balance + 1e-4 * moe.z_loss(sink.logits, real)
        loss.backward()
        fsdp.clipped_step(model, optimizer, scheduler, 1.0)
        losses.append(float(-logprobs.detach().mean()))
        balances.append(float(balance.detach()))
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    after = {n: full(p.detach()) for n, p in model.named_parameters()}
    gates = [n for n in after if n.endswith("mlp.gate.weight")]
    result = {
        "model_class": next(f"{c.__module__}.{c.__name__}" for c in type(model).__mro__
                            if c.__module__.startswith("nemo_automodel")),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "nemo_automodel": __import__("nemo_automodel").__version__,
        "build_s": round(build_s, 2), "train_s": round(train_s, 2), "steps": steps,
        "replayed_selects_recorded": replayed_match, "live_agreement_after_perturbation": live_agreement,
        "loss_first": losses[0], "loss_last": losses[-1], "balance_first": balances[0], "balance_last": balances[-1],
        "gates": len(gates), "gate_dtypes": sorted({str(after[n].dtype) for n in gates}),
        "gates_unchanged": all(torch.equal(after[n], before[n]) for n in gates),
        "experts_moved": all(not torch.equal(after[n], before[n]) for n in after if "experts" in n),
        "not_dtensor_params": not_sharded,
        "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
    }
    result["ok"] = bool("nemo_automodel" in result["model_class"] and losses[-1] < losses[0] and gates
                        and replayed_match == 1.0 and live_agreement < 1.0
                        and result["gates_unchanged"] and result["experts_moved"]
                        and result["gate_dtypes"] == ["torch.float32"])
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "automodel_moe_gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)["ok"] else 1)
