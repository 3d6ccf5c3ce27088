"""SFT on the automodel backend (`runtime/sft.py` building through `models.backend`: nemo-automodel's own model class,
FSDP2 over the plan's `dp` mesh, packed micro-batches) trains exactly like SFT on the hf backend.

The plans are compiled from the SFT demo by the real compiler, on the tiny Qwen3-MoE of the MoE demo (an
architecture with an AutoModel class: the compiler keeps `model.backend: automodel`; a dense Qwen3 takes the HF
fallback, Molt H9), one rank over gloo, packing on, the MoE aux loss on and the routers frozen. Each plan runs
`SftJob.setup` (the job's own build) and three optimizer steps on the same rows, in this process: fp32, the
losses agree to 1e-5 and the trained weights (under transformers' names) to 1e-5; the routers stay unchanged.
"""

from __future__ import annotations

import os
import shutil
import signal

import torch
from loop_support import ROOT, compile_plan

STEPS = 3
NAME = "test-sft-automodel"


def _plan(backend: str):
    return compile_plan(
        "recipes/demo_sft.yaml", f"model.path={ROOT}/recipes/data/demo_moe/model", f"model.backend={backend}",
        "model.attn=sdpa", "cluster.gpus_per_node=1", "actor.gpus_per_node=1", "actor.packing=true", "data.max_samples=48",
        "train.batch_size=16", "eval.dataset=null",
        "actor.aux_loss_coef=0.01", "actor.freeze={moe_router: true}",
        f"ignore={{{'MOE001' if backend == 'automodel' else 'MOE005'}: one CPU rank}}", f"name={NAME}-{backend}")


def _train(plan) -> tuple[list[float], dict[str, torch.Tensor], type]:
    """`STEPS` optimizer steps of the job on this rank; (losses, full weights under HF names, model class)."""
    import torch.distributed as dist

    from runtime.ranks import free_port
    from runtime.sft import SftJob

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    recipe = SftJob(plan)
    try:
        recipe.setup()
        losses = [recipe.train_step(recipe.data.examples[w * recipe.window:(w + 1) * recipe.window], 0)[0]["train/loss"]
                  for w in range(STEPS)]
        state = {n: p.detach().full_tensor().clone() for n, p in recipe.model.named_parameters()}
        return losses, recipe.backend.hf_state_dict(state), type(recipe.model)
    finally:
        if recipe.__dict__.get("sink") is not None:
            recipe.sink.close()
        dist.destroy_process_group()
        for s, h in handlers.items():
            signal.signal(s, h)


def test_sft_on_automodel_equals_sft_on_hf():
    cwd = os.getcwd()
    os.chdir(ROOT)  # plan paths are relative to the project root
    try:
        start = {n: t.clone() for n, t in _load_hf(ROOT / "recipes/data/demo_moe/model").items()}
        runs = {b: _train(_plan(b)) for b in ("automodel", "hf")}
    finally:
        os.chdir(cwd)
        for b in ("automodel", "hf"):
            shutil.rmtree(ROOT / "runs" / f"{NAME}-{b}", ignore_errors=True)  # the metrics the jobs wrote
    (a_losses, a_weights, a_class), (h_losses, h_weights, h_class) = runs["automodel"], runs["hf"]
    assert any(c.__module__.startswith("nemo_automodel.") for c in a_class.__mro__), a_class.__mro__
    assert not any(c.__module__.startswith("nemo_automodel.") for c in h_class.__mro__)
    assert h_losses[-1] < h_losses[0]  # it learns
    torch.testing.assert_close(torch.tensor(a_losses), torch.tensor(h_losses), rtol=0, atol=1e-5)
    assert a_weights.keys() == h_weights.keys()
    gates = [n for n in h_weights if n.endswith("mlp.gate.weight")]
    assert gates and all(torch.equal(h_weights[n], start[n]) and torch.equal(a_weights[n], start[n]) for n in gates)
    moved = max((h_weights[n] - start[n]).abs().max().item() for n in start.keys() & h_weights.keys())
    assert moved > 1e-3
    for name, w in h_weights.items():
        torch.testing.assert_close(a_weights[name], w, rtol=0, atol=1e-5, msg=name)


def _load_hf(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
