"""Expert parallelism of a VLM on the automodel backend (`runtime/models/automodel.py` `expert_parallel`): the tiny
Qwen3.5-MoE VLM (nemo-automodel's own image-text-to-text class) on 2 gloo ranks, fp32, placed by nemo-automodel's
MoE parallelizer at ep 2 (each rank holds 2 of the 4 experts of each language-model MoE layer, the vision tower and
the rest FSDP2 over the data-parallel ranks) against the same checkpoint at ep 1 (FSDP2 over the same 2 ranks).

Each rank takes its own image prompt (rank 1's right-padded):
- the log-probs of both rows at ep 2 equal ep 1's (relative 1e-5), and other images give other log-probs;
- one clipped optimizer step on the global token mean (vision tower trained) gives the same weights (1e-5), the
  experts and the tower among those that moved;
- with the tower frozen (`freeze_visual_encoder`) it stays in the root unit and does not move, and a window where
  one rank's micro-batch has no image runs (the same collectives on every rank).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from runtime.tiny_vlm import build_tiny_moe_vlm
from schemas.plan import MeshPlan, ModelPlan, OptimizerPlan

WORLD = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(build_tiny_moe_vlm(tmp_path_factory.mktemp("moe_vlm") / "model", seed=0, vocab_size=300))


def _plan(path: str) -> ModelPlan:
    return ModelPlan(path=path, arch=None, backend="automodel", dtype="float32", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")


def _image(colour: tuple[int, int, int]):
    from PIL import Image

    img = Image.new("RGB", (64, 64), colour)
    img.paste((255 - colour[0], 20, 90), (8, 8, 40, 30))  # some structure, so patches differ
    return img


def _batch(path: str, colours=((10, 200, 30), (220, 40, 60)), images: bool = True):
    """Two prompts with answers, the second right-padded: (ids, mask, per-row image inputs); `images` False: the
    second row is text only."""
    from runtime import vlm

    processor = vlm.load_processor(path)
    rows, mm = [], []
    turns = [("<image>what colour is it", "green, with a box"), ("<image>?", "red")]
    for i, (colour, (prompt, answer)) in enumerate(zip(colours, turns, strict=True)):
        if images or i == 0:
            ids, inputs = vlm.encode(processor, vlm.render(processor, prompt, 1) + answer, [_image(colour)])
        else:
            ids, inputs = vlm.encode(processor, vlm.render(processor, "what colour", 0) + answer, [])
        rows.append(ids)
        mm.append(inputs)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
    return ids, mask, mm


def _logprobs(model, ids, mask, mm):
    from runtime.logprobs import token_logprobs, vision_inputs

    vision = vision_inputs(mm, ids, model.config.image_token_id, torch.device("cpu"))
    return token_logprobs(model, ids, mask, 1.0, vision=vision)[0]


def _gathered(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


OPT = OptimizerPlan(name="adam", lr=1e-3, betas=[0.9, 0.95], eps=1e-5, weight_decay=0.0, max_norm=1.0,
                    scheduler="constant", warmup_steps=0, total_steps=10, min_lr_ratio=0.1, muon=None)


def _built(path: str, meshes, freeze_visual_encoder: bool = False):
    """The model and its optimizer, made before any forward as the trainer makes them (FSDP2's units stay gathered
    after a forward here: nemo-automodel's parallelizer does not reshard after forward)."""
    from runtime import fsdp
    from runtime.models import automodel

    model = automodel.build(_plan(path), path, meshes, torch.device("cpu"), freeze_visual_encoder=freeze_visual_encoder)
    return model, *fsdp.build_optimizer(OPT, model)


def _step(built, ids, mask, mm, rank: int) -> dict[str, torch.Tensor]:
    """One clipped step on the global token mean of both rows, this rank's row its share (FSDP2 averages the
    gradients over the 2 data-parallel ranks; an expert's, summed over the ep group, is averaged back by
    `expert_parallel`'s hook): the full weights after it."""
    from runtime import fsdp

    model, optimizer, scheduler = built
    real = mask[:, 1:]
    lp = _logprobs(model, ids[rank:rank + 1], mask[rank:rank + 1], mm[rank:rank + 1])
    (-(lp * real[rank:rank + 1]).sum() / real.sum() * WORLD).backward()
    fsdp.clipped_step(model, optimizer, scheduler, OPT.max_norm)
    return {n: _full(p) for n, p in model.named_parameters()}


def _rank_main(rank: int, port: int, path: str, out: str) -> None:
    import torch.distributed as dist

    from runtime.models import automodel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    meshes = {ep: automodel.device_mesh("cpu", WORLD, MeshPlan(tp=1, cp=1, ep=ep, pp=1, dp_replicate=1))
              for ep in (1, 2)}
    ids, mask, mm = _batch(path)
    other = _batch(path, ((0, 0, 250), (250, 250, 0)))[2]
    result: dict = {}
    for ep in (2, 1):
        built = _built(path, meshes[ep])
        model = built[0]
        if ep == 2:
            result["placements"] = {n: str(getattr(p, "device_mesh", None)) for n, p in model.named_parameters()}
        result["start"] = {n: _full(p) for n, p in model.named_parameters()}
        with torch.no_grad():
            lp = _logprobs(model, ids[rank:rank + 1], mask[rank:rank + 1], mm[rank:rank + 1])
            lp_other = _logprobs(model, ids[rank:rank + 1], mask[rank:rank + 1], other[rank:rank + 1])
        result[ep] = {"lp": _gathered(lp), "other": _gathered(lp_other), "trained": _step(built, ids, mask, mm, rank)}
    # the tower frozen at ep 2: a window where rank 1's micro-batch is text only
    built = _built(path, meshes[2], freeze_visual_encoder=True)
    result["frozen"] = _step(built, *_batch(path, images=False), rank)
    if rank == 0:
        torch.save(result, out)
    dist.destroy_process_group()


def test_vlm_at_ep2_equals_ep1(checkpoint, tmp_path):
    from runtime.trainer import free_port

    out = str(tmp_path / "result.pt")
    mp.spawn(_rank_main, args=(free_port(), checkpoint, out), nprocs=WORLD, join=True)
    result = torch.load(out)
    placed = result["placements"]  # nemo-automodel's parallelizer placed the language model's experts over ep
    experts = [n for n in placed if n.endswith(".experts.gate_and_up_projs")]
    assert len(experts) == 2 and all("ep=2" in placed[n].lower() for n in experts)
    assert "dp_shard_cp=2" in placed["model.language_model.layers.1.self_attn.q_proj.weight"].lower()
    ids, mask, _ = _batch(checkpoint)
    real = mask[:, 1:]
    ep2, ep1 = result[2], result[1]
    scale = ep1["lp"][real].abs().max().item()
    torch.testing.assert_close(ep2["lp"][real], ep1["lp"][real], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(ep2["other"][real], ep1["other"][real], rtol=0, atol=1e-5 * scale)
    assert (ep2["lp"][real] - ep2["other"][real]).abs().max() > 1e-3  # the images reach the model
    assert ep2["trained"].keys() == ep1["trained"].keys()
    for name, w in ep1["trained"].items():
        torch.testing.assert_close(ep2["trained"][name], w, rtol=0, atol=1e-5, msg=name)
    start, frozen = result["start"], result["frozen"]
    moved = {n for n, w in ep2["trained"].items() if (w - start[n]).abs().max() > 1e-4}
    assert len(moved) == len(start)  # the experts and the tower among them
    tower = [n for n in start if ".visual." in n]
    assert tower and all(torch.equal(frozen[n], start[n]) for n in tower)
    assert {n for n in start if (frozen[n] - start[n]).abs().max() > 1e-4} == set(start) - set(tower)
