"""Image prompts on the automodel backend (runtime/models/automodel.py) on CPU: a tiny Qwen3.5-MoE VLM (the Qwen3.6
launch recipes' architecture, which nemo-automodel builds with its own implementation) in a one-rank gloo world,
against the hf backend's transformers model of the same checkpoint.

- it is nemo-automodel's image-text-to-text class, sharded as the hf backend shards a VLM (language-model layers
  the FSDP units, the vision tower in the root unit);
- the log-probs of image prompts (a padded row included) equal the hf backend's, and change with the image;
- one optimizer step with the vision tower frozen gives the same weights (compared under transformers' names
  through nemo-automodel's own state-dict adapter) and leaves the tower unchanged;
- the weight sync and the HF export see the hf backend's names and values (nemo-automodel's renames undone).
"""

from __future__ import annotations

import os

import pytest
import torch

from runtime import fsdp, vlm
from runtime.logprobs import token_logprobs, vision_inputs
from runtime.models import automodel, hf
from runtime.tiny_vlm import build_tiny_moe_vlm
from schemas.plan import ModelPlan, OptimizerPlan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_tiny_moe_vlm(tmp_path_factory.mktemp("moe_vlm") / "model", seed=0, vocab_size=300))


def _plan(path: str, backend: str) -> ModelPlan:
    return ModelPlan(path=path, arch=None, backend=backend, dtype="float32", attn="sdpa", gradient_checkpoint="none",
                     compile_layers=False, disable_fast_tokenizer=False, router_dtype="float32",
                     moe_dispatcher="torch")


def _image(colour: tuple[int, int, int]):
    from PIL import Image

    img = Image.new("RGB", (64, 64), colour)
    img.paste((255 - colour[0], 20, 90), (8, 8, 40, 30))  # some structure, so patches differ
    return img


def _batch(path: str, colours=((10, 200, 30), (220, 40, 60))):
    """Two image prompts with answers, the second right-padded: (ids, mask, per-row image inputs)."""
    processor = vlm.load_processor(path)
    rows, mm = [], []
    turns = [("<image>what colour is it", "green, with a box"), ("<image>?", "red")]
    for colour, (prompt, answer) in zip(colours, turns, strict=True):
        ids, inputs = vlm.encode(processor, vlm.render(processor, prompt, 1) + answer, [_image(colour)])
        rows.append(ids)
        mm.append(inputs)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
    return ids, mask, mm


def _logprobs(model, ids, mask, mm):
    vision = vision_inputs(mm, ids, model.config.image_token_id, torch.device("cpu"))
    return token_logprobs(model, ids, mask, 1.0, vision=vision)[0]


def test_image_prompt_logprobs_equal_the_hf_backends(world, checkpoint):
    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    reference = hf.build(_plan(checkpoint, "hf"), checkpoint, world, torch.device("cpu"), trainable=False)
    assert "nemo_automodel.components.models.qwen3_5_moe.model.Qwen3_5MoeForConditionalGeneration" in {
        f"{c.__module__}.{c.__name__}" for c in type(model).__mro__}  # nemo-automodel's own class, under FSDP2
    assert len(automodel.decoder_layers(model)) == 2  # the language model's, each its own FSDP unit
    ids, mask, mm = _batch(checkpoint)
    assert int((ids == model.config.image_token_id).sum()) == 8  # 4 per 64x64 image after the 2x2 merge
    with torch.no_grad():
        mine, theirs = _logprobs(model, ids, mask, mm), _logprobs(reference, ids, mask, mm)
        other = _logprobs(model, ids, mask, _batch(checkpoint, ((0, 0, 250), (250, 250, 0)))[2])
    real = mask[:, 1:]
    torch.testing.assert_close(mine[real], theirs[real], rtol=0, atol=1e-5)
    assert (mine[real] - other[real]).abs().max() > 1e-3  # the images reach the model


def test_an_optimizer_step_gives_the_hf_backends_weights(world, checkpoint):
    opt = OptimizerPlan(name="adam", lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0, max_norm=1.0,
                        scheduler="constant", warmup_steps=0, total_steps=10, min_lr_ratio=0.1, muon=None)
    ids, mask, mm = _batch(checkpoint)
    models = []
    for backend in ("automodel", "hf"):
        build = automodel.build if backend == "automodel" else hf.build
        model = build(_plan(checkpoint, backend), checkpoint, world, torch.device("cpu"), freeze_visual_encoder=True)
        optimizer, scheduler = fsdp.build_optimizer(opt, model)
        (-_logprobs(model, ids, mask, mm)[mask[:, 1:]].mean()).backward()
        fsdp.clipped_step(model, optimizer, scheduler, opt.max_norm)
        models.append(model)
    mine, theirs = models
    adapter = mine.state_dict_adapter
    after = {}
    for name, p in mine.named_parameters():
        for hf_name, tensor in adapter.convert_single_tensor_to_hf(name, p.detach().full_tensor()):
            after[hf_name] = tensor
    expected = {n: p.detach().full_tensor() for n, p in theirs.named_parameters()}
    assert after.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=1e-5, msg=name)
    from safetensors.torch import load_file

    start = load_file(os.path.join(checkpoint, "model.safetensors"))
    visual = [n for n in expected if n.startswith("model.visual.")]
    assert visual and all(torch.equal(after[n], start[n]) for n in visual)  # frozen tower
    moved = [n for n in expected if n.startswith("model.language_model.") and not torch.equal(after[n], start[n])]
    assert len(moved) > len(expected) // 2


def test_weight_sync_and_export_see_transformers_names(world, checkpoint):
    """What the engines and the HF export receive from this backend is the hf backend's: nemo-automodel's own names
    (`shared_experts`, the gated-delta-net's `_fp32_params` holder, the grouped experts) under transformers'."""
    model = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    reference = hf.build(_plan(checkpoint, "hf"), checkpoint, world, torch.device("cpu"), trainable=False)

    def local(p):
        return p.local() if isinstance(p, automodel.TransposedExperts) else p.detach().full_tensor()

    mine = {n: local(p) for n, p in automodel.hf_weights(model)}
    theirs = {n: p.detach().full_tensor() for n, p in hf.hf_weights(reference)}
    assert mine.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(mine[name], value), name
    state = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    assert automodel.hf_state_dict(state).keys() == theirs.keys()


def test_context_parallel_splices_the_images_before_the_cut(world, checkpoint):
    """A VLM under CP (`context_parallel.prepare`, `logprobs._vlm_shard_hidden`): nemo-automodel's M-RoPE positions
    of the whole rows (its `prepare_model_inputs_for_cp`), its splice of the image features into the whole rows'
    embeddings (`_embed_and_splice_for_cp`), both cut by the sharder, the language model on the cut (its masks
    dropped as nemo-automodel's CP drops them). On a 1-rank cp mesh (torch's ring attention has no CPU path) the
    cut is the identity, so the log-probs and every gradient (vision tower included) equal the VLM forward's
    without CP; tests/runtime/test_context_parallel.py checks the cut itself on 2 and 4 gloo ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from runtime import context_parallel

    cp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    ids, mask, mm = _batch(checkpoint)
    plain = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    under_cp = automodel.build(_plan(checkpoint, "automodel"), checkpoint, world, torch.device("cpu"))
    context_parallel.prepare(under_cp, cp_mesh)
    assert under_cp.cp_mesh is cp_mesh
    assert [m._cp_mesh for n, m in under_cp.named_modules() if n.endswith("linear_attn")] == [cp_mesh]
    real = mask[:, 1:]
    want = _logprobs(plain, ids, mask, mm)
    (-want[real].mean()).backward()
    vision = vision_inputs(mm, ids, under_cp.config.image_token_id, torch.device("cpu"))
    splice, spliced = under_cp._embed_and_splice_for_cp, []
    under_cp._embed_and_splice_for_cp = lambda input_ids, **kw: spliced.append(input_ids) or splice(input_ids, **kw)
    with context_parallel.sharded_rows(cp_mesh, ids, mask) as rows:
        got = token_logprobs(under_cp, ids, mask, 1.0, vision=vision, cp=rows)[0]
        (-got[real].mean()).backward()
    assert len(spliced) == 1 and torch.equal(spliced[0], ids)  # the whole rows, once
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    grads = {n: p.grad.full_tensor() for n, p in plain.named_parameters() if p.grad is not None}
    assert any(n.startswith("model.visual.") for n in grads)
    for name, p in under_cp.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads[name], rtol=0, atol=1e-5, msg=name)
