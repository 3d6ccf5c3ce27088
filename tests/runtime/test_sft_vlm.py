"""VLM SFT (`data.image_key`: runtime/sft_vlm.py, runtime/sft.py) on CPU, one gloo rank, fp32.

Plans compiled from the SFT demo by the real compiler on the VLM demo's data (a digit image and "<image>+1="; the
answer is the digit plus one). `SftJob.setup` (the job's own data and build) and optimizer steps run in this process:
- on the hf backend (the VLM demo's tiny Qwen2.5-VL, vision tower frozen): each row carries its image, expanded to
  4 placeholder tokens that are not supervised; the loss goes down over 8 steps; the tower does not move; the same
  rows with their images swapped give another loss (the images reach the model);
- on the automodel backend (a tiny Qwen3.5-MoE VLM, nemo-automodel's own class; the compiler keeps automodel for
  it): three steps give the losses and weights of the hf backend on the same checkpoint (1e-5).
"""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch
from loop_support import ROOT, compile_plan

NAME = "test-sft-vlm"


def _plan(model: str, backend: str, *sets: str):
    return compile_plan(
        "recipes/demo_sft.yaml", f"model.path={model}", f"model.backend={backend}", "cluster.gpus_per_node=1",
        "actor.gpus_per_node=1", f"data.dataset={ROOT}/recipes/data/demo_vlm/train.jsonl", "data.input_key=prompt",
        "data.output_key=answer", "data.image_key=image", "data.max_images_per_prompt=1", "data.max_samples=64",
        "train.batch_size=8", "train.micro_batch_size=4", "eval.dataset=null", "actor.freeze={visual_encoder: true}",
        f"name={NAME}-{backend}", *sets)


def _job(plan):
    """`SftJob.setup` on this rank; yields the job, then leaves the process group and the signals as they were."""
    from runtime.ranks import free_port
    from runtime.sft import SftJob

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    job = SftJob(plan)
    job.setup()
    return job, handlers


def _close(job, handlers) -> None:
    import torch.distributed as dist

    if job.__dict__.get("sink") is not None:
        job.sink.close()
    dist.destroy_process_group()
    for s, h in handlers.items():
        signal.signal(s, h)
    shutil.rmtree(ROOT / job.s.logging.out_dir, ignore_errors=True)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _steps(job, n: int) -> list[float]:
    w = job.window
    return [job.train_step(job.data.examples[(i * w) % len(job.data.examples):][:w], 0)[0]["train/loss"]
            for i in range(n)]


def _nll(job, rows) -> float:
    from runtime.sft_data import collate, reply_logprobs

    ids, attn, mask = collate(rows, job.pad_id)
    with torch.no_grad():
        lp = reply_logprobs(job.model, ids, attn, vision=job._vision(rows, ids))
    return float((-lp * mask[:, 1:]).sum() / mask[:, 1:].sum())


@pytest.fixture
def in_root():
    cwd = os.getcwd()
    os.chdir(ROOT)  # plan paths are relative to the project root
    yield
    os.chdir(cwd)


def test_vlm_sft_trains_on_the_images(in_root):
    job, handlers = _job(_plan(f"{ROOT}/recipes/data/demo_vlm/model", "hf", "actor.optimizer.lr=3e-3"))
    try:
        image_id = job.image_token_id
        ex = job.data.examples
        assert len(ex) == 64 and all(e.mm is not None and e.mm["image_grid_thw"].tolist() == [[1, 4, 4]] for e in ex)
        for e in ex:
            placeholders = [i for i, t in enumerate(e.input_ids) if t == image_id]
            assert len(placeholders) == 4 and all(e.loss_mask[i] == 0 for i in placeholders)
            assert 0 < sum(e.loss_mask) < len(e.input_ids)
        digits = {}  # rows by their image, to swap images between rows of different digits
        for e in ex:
            digits.setdefault(round(float(e.mm["pixel_values"].sum()), 3), e)
        a, b = list(digits.values())[:2]
        swapped = [type(a)(a.input_ids, a.loss_mask, b.mm), type(b)(b.input_ids, b.loss_mask, a.mm)]
        assert abs(_nll(job, [a, b]) - _nll(job, swapped)) > 1e-4  # the images reach the model
        tower = {n: _full(p) for n, p in job.model.named_parameters() if ".visual." in n}
        losses = _steps(job, 8)
        assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3, losses
        assert tower and all(torch.equal(_full(p), tower[n])
                             for n, p in job.model.named_parameters() if n in tower)
    finally:
        _close(job, handlers)


def test_vlm_sft_on_automodel_equals_hf(in_root, tmp_path):
    from runtime.tiny_vlm import build_tiny_moe_vlm

    model = build_tiny_moe_vlm(tmp_path / "model", seed=0, vocab_size=300)
    runs = {}
    for backend in ("automodel", "hf"):
        job, handlers = _job(_plan(str(model), backend, "ignore={MOE001: one CPU rank, MOE005: one CPU rank}"))
        try:
            losses = _steps(job, 3)
            weights = {}
            for name, p in job.model.named_parameters():
                full = _full(p)
                adapter = getattr(job.model, "state_dict_adapter", None)  # nemo-automodel's names -> transformers'
                pairs = adapter.convert_single_tensor_to_hf(name, full) if backend == "automodel" else [(name, full)]
                weights.update(pairs)
            runs[backend] = (losses, weights, type(job.model))
        finally:
            _close(job, handlers)
    (a_losses, a_weights, a_class), (h_losses, h_weights, _) = runs["automodel"], runs["hf"]
    assert any(c.__module__.startswith("nemo_automodel.components.models.") for c in a_class.__mro__)
    torch.testing.assert_close(torch.tensor(a_losses), torch.tensor(h_losses), rtol=0, atol=1e-5)
    assert a_weights.keys() == h_weights.keys()
    for name, w in h_weights.items():
        torch.testing.assert_close(a_weights[name], w, rtol=0, atol=1e-5, msg=name)
    from safetensors.torch import load_file

    start = load_file(model / "model.safetensors")
    assert max((h_weights[n] - start[n]).abs().max().item() for n in start) > 1e-4  # it trained
    assert all(torch.equal(h_weights[n], start[n]) for n in start if n.startswith("model.visual."))  # frozen
