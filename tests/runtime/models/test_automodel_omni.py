"""Image prompts of nemo-automodel's Nemotron-3-Nano-Omni (the omni3 launch recipes' architecture) on the automodel
backend on CPU, a tiny random one (runtime/tiny_vlm.py `build_tiny_omni`: RADIO tower, pixel-shuffle projector,
an attention and an MoE block: its Mamba mixer is CUDA-only) in a one-rank gloo world, in bf16 (its forward casts
the vision features to bf16, as its checkpoints are). The images come from the checkpoint's processor
(runtime/omni_processor.py, what the SFT data path and the runners load), as the trainer gets them.

- the processor: its grids are transformers' (`get_patch_grid_size`: the sizes below worked by hand), its patches
  the image resized as vLLM's `nano_nemotron_vl` resizes it (bicubic, antialiased, float) and normalized, in the
  patch order vLLM's `DynamicResolutionImageTiler.stack` lays out, and each image's `<image>` run wrapped in
  `<img>` ... `</img>`;
- the log-probs of image prompts of two sizes (a padded row included) are those of its own forward's logits on the
  images built here from the pixels (`omni_processor.model_images` maps the patches), and change with the image;
- under context parallelism (`context_parallel.prepare`, `logprobs._vlm_shard_hidden`) its forward takes the whole
  rows, splices the images in and cuts the result itself (its `cp_mesh`); on a 1-rank cp mesh (torch's ring
  attention has no CPU path) the log-probs and every gradient, the vision tower's included, equal the forward
  without CP (the gradients to bf16's rounding). tests/runtime/test_context_parallel.py checks its in-forward cut against the sharder's on 2 ranks;
- its HF export (`ckpt.export_hf`: its adapter's checkpoint layout, `nemotron_omni.export_weights`) of an untrained
  model is its checkpoint, tensor for tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from runtime import vlm
from runtime.engines.weights import image_wrapper_ids
from runtime.logprobs import token_logprobs, vision_inputs
from runtime.models import automodel
from runtime.tiny_vlm import build_tiny_omni
from schemas.plan import ModelPlan

SIZES = ((64, 64), (40, 90))  # (h, w) pixels -> 4x4 patches of 16 (4 features); 4x6 (6 features), worked below


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_tiny_omni(tmp_path_factory.mktemp("omni") / "model", seed=0, vocab_size=300))


def _build(path: str, world):
    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="bfloat16", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")
    return automodel.build(plan, path, world, torch.device("cpu"))


def _images(seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def _batch(path: str, seed: int = 0):
    """Two image prompts with answers, the second right-padded, through the checkpoint's processor: (ids, mask,
    per-row image inputs, the images)."""
    processor = vlm.load_processor(path)
    images = _images(seed)
    rows, mm = [], []
    for text, image in zip(("what is<image>it is green, with a box", "?<image>no"), images, strict=True):
        ids, inputs = vlm.encode(processor, text, [image])
        rows.append(ids)
        mm.append(inputs)
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
    return ids, mask, mm, images


def _resized(image, grid: tuple[int, int], mean, std) -> torch.Tensor:
    """vLLM's `_bicubic_resize_and_normalize` of one image to `grid` patches of 16: (3, 16 h, 16 w)."""
    x = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)[None].float()
    x = torch.nn.functional.interpolate(x, size=(16 * grid[0], 16 * grid[1]), mode="bicubic", align_corners=False,
                                        antialias=True)
    return ((x / 255.0 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))[0]


def test_the_processor_resizes_and_lays_out_patches_as_the_engine_does(checkpoint):
    processor = vlm.load_processor(checkpoint)
    assert type(processor.image_processor).__name__ == "NemotronH_Omni_Reasoning_V3ImageProcessorPil"
    ip = processor.image_processor
    # transformers' grid by hand, min 16 max 64 patches: 40x90 -> (floor(2.5)+1, floor(5.625)+1) = (3, 6), 18
    # patches; 3 is odd and 4x6 fits in 64, so (4, 6). 64x64 is 4x4 already. 300x20 -> (19, 2) = 38 patches;
    # 19 -> 20 fits. 1000x1000 -> (63, 63) scaled by sqrt(64 / 63²) -> (8, 8)
    images = _images(0) + [Image.new("RGB", (20, 300)), Image.new("RGB", (1000, 1000))]
    out = ip(images, return_tensors="pt")
    assert out["image_grid_hw"].tolist() == [[4, 4], [4, 6], [20, 2], [8, 8]]
    start = 0
    for image, (h, w) in zip(images[:2], out["image_grid_hw"].tolist(), strict=False):
        want = _resized(image, (h, w), ip.image_mean, ip.image_std)  # the image, resized as vLLM does
        patches = out["pixel_values"][start:start + h * w]
        start += h * w
        # vLLM's `stack`: "c (py yy) (px xx) -> (py px) (c yy xx)"
        want = want.reshape(3, h, 16, w, 16).permute(1, 3, 0, 2, 4).reshape(h * w, 3 * 16 * 16)
        torch.testing.assert_close(patches, want, rtol=0, atol=1e-5)  # fused vs unfused normalization only
    ids, mm = vlm.encode(processor, "see<image>and<image>", images[:2])
    tok = processor.tokenizer
    img, start_id, end_id = (tok.convert_tokens_to_ids(t) for t in ("<image>", "<img>", "</img>"))
    runs = [ids[i + 1:ids.index(end_id, i)] for i, t in enumerate(ids) if t == start_id]
    assert runs == [[img] * 4, [img] * 6] and mm["image_grid_hw"].tolist() == [[4, 4], [4, 6]]
    # what a vLLM engine is sent: each run and its <img> ... </img> back to the template's one <image>
    wrapper = image_wrapper_ids(checkpoint)
    assert wrapper == (start_id, end_id)
    assert vlm.collapse_image_runs(ids, img, wrapper) == tok.encode("see<image>and<image>", add_special_tokens=False)


def _logprobs(model, ids, mask, mm, cp=None):
    vision = vision_inputs(mm, ids, model.config.image_token_id, torch.device("cpu"))
    return token_logprobs(model, ids, mask, 1.0, vision=vision, cp=cp)[0]


def test_image_prompt_logprobs_are_its_forwards(world, checkpoint):
    model = _build(checkpoint, world)
    assert "nemo_automodel.components.models.nemotron_omni.model.NemotronOmniForConditionalGeneration" in {
        f"{c.__module__}.{c.__name__}" for c in type(model).__mro__}  # nemo-automodel's own class, under FSDP2
    assert [b.block_type for b in automodel.decoder_layers(model)] == ["attention", "moe"]
    ids, mask, mm, images = _batch(checkpoint)
    # its own dynamic-resolution input, built from the pixels: each image resized to its grid, zero-padded to 64x96
    ip = vlm.load_processor(checkpoint).image_processor
    pixels = torch.zeros(2, 3, 64, 96)
    for i, (image, m) in enumerate(zip(images, mm, strict=True)):
        h, w = m["image_grid_hw"][0].tolist()
        x = torch.from_numpy(np.asarray(image)).permute(2, 0, 1)[None].float()
        x = torch.nn.functional.interpolate(x, size=(16 * h, 16 * w), mode="bicubic", align_corners=False,
                                            antialias=True)[0]
        mean, std = (torch.tensor(v).view(3, 1, 1) * 255.0 for v in (ip.image_mean, ip.image_std))
        pixels[i, :, :16 * h, :16 * w] = (x - mean) / std  # transformers' fused rescale + normalize
    with torch.no_grad():
        mine = _logprobs(model, ids, mask, mm)
        other = _logprobs(model, ids, mask, _batch(checkpoint, seed=1)[2])
        logits = model(input_ids=ids, attention_mask=mask.long(), pixel_values=pixels,
                       imgs_sizes=torch.tensor([[64, 64], [64, 96]]), use_cache=False).logits
    theirs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    real = mask[:, 1:]
    torch.testing.assert_close(mine[real], theirs[real], rtol=0, atol=1e-5)
    assert (mine[real] - other[real]).abs().max() > 1e-3  # the images reach the model
    # a text row (an RL prompt without images, the post-sync probe): its own forward too (`model.model` is no module)
    text = ids[:1, :6]
    with torch.no_grad():
        lp = token_logprobs(model, text, torch.ones_like(text, dtype=torch.bool), 1.0)[0]
        logits = model(input_ids=text, use_cache=False).logits
    torch.testing.assert_close(lp[0], logits[0, :-1].float().log_softmax(-1).gather(-1, text[0, 1:, None])[..., 0],
                               rtol=0, atol=1e-5)


def test_context_parallel_cuts_the_spliced_rows_in_its_forward(world, checkpoint):
    from torch.distributed.device_mesh import init_device_mesh

    from runtime import context_parallel

    cp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    ids, mask, mm, _ = _batch(checkpoint)
    plain, under_cp = _build(checkpoint, world), _build(checkpoint, world)
    context_parallel.prepare(under_cp, cp_mesh)
    assert under_cp.cp_mesh is cp_mesh  # its forward cuts the spliced rows by it
    assert [b.mixer.cp_mesh for b in automodel.decoder_layers(under_cp) if b.block_type == "moe"] == [cp_mesh]
    real = mask[:, 1:]
    want = _logprobs(plain, ids, mask, mm)
    (-want[real].mean()).backward()
    seen = []
    encode = under_cp.extract_feature_dynamic
    under_cp.extract_feature_dynamic = lambda pv, sizes: seen.append(pv.shape[0]) or encode(pv, sizes)
    with context_parallel.sharded_rows(cp_mesh, ids, mask) as rows:
        got = _logprobs(under_cp, ids, mask, mm, cp=rows)
        (-got[real].mean()).backward()
    assert seen == [2]  # both rows' images, once: the whole rows went in
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    grads = {n: p.grad.full_tensor() for n, p in plain.named_parameters() if p.grad is not None}
    assert any(n.startswith("vision_model.") for n in grads) and any(n.startswith("vision_projector.") for n in grads)
    for name, p in under_cp.named_parameters():
        got_grad = None if p.grad is None else p.grad.full_tensor()
        if name not in grads:  # unused without CP (its video projection): none, or the zeros nemo-automodel's CP
            assert got_grad is None or not got_grad.any(), name  # setup makes unused FSDP units reduce
            continue
        # bf16 gradients: the two attention calls (a padding mask without CP, causal only under it) round
        # differently; measured within 0.8 % of the gradient's norm (and a key bias's, zero but for rounding, 1e-7)
        assert (got_grad - grads[name]).norm().item() < 2e-2 * grads[name].norm().item() + 1e-6, name


def test_its_hf_export_is_the_checkpoint_layout(world, checkpoint, tmp_path):
    # nemo-automodel's adapter layout (the legacy RADIO and projector names, one tensor per expert), gathered from
    # FSDP2's shards: an untrained model exports its checkpoint back, every tensor exactly, with the processor
    from safetensors.torch import load_file

    from runtime import ckpt

    model = _build(checkpoint, world)
    out = ckpt.export_hf(str(tmp_path / "hf"), model, automodel.hf_weights, checkpoint, 0)
    assert out is not None
    theirs, mine = load_file(f"{checkpoint}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert sorted(mine) == sorted(theirs) and any(".mixer.experts.3.up_proj." in n for n in mine)
    for name, tensor in theirs.items():
        torch.testing.assert_close(mine[name], tensor, rtol=0, atol=0, msg=name)
    assert vlm.load_processor(out).image_processor.to_dict() == vlm.load_processor(checkpoint).image_processor.to_dict()


def test_the_engines_are_sent_the_checkpoint_names_but_the_frozen_tower(world, checkpoint):
    # vLLM's nano_nemotron_vl loads the checkpoint's names; its MoE loader takes an experts parameter whole
    # ((experts, out, in), fused name); the RADIO tower is not sent (vLLM loads only its fused attn.qkv)
    from safetensors.torch import load_file

    theirs = load_file(f"{checkpoint}/model.safetensors")
    sent = {name: (w.local() if hasattr(w, "local") else w.full_tensor()).detach()
            for name, w in automodel.hf_weights(_build(checkpoint, world))}
    assert not any(n.startswith("vision_model.") for n in sent)
    experts = [n for n in sent if n.endswith((".experts.up_proj", ".experts.down_proj"))]
    assert len(experts) == 2
    for name in experts:
        head, _, proj = name.rpartition(".experts.")
        stacked = torch.stack([theirs[f"{head}.experts.{e}.{proj}.weight"] for e in range(4)])
        torch.testing.assert_close(sent.pop(name), stacked, rtol=0, atol=0, msg=name)
    # the routers' e_score_correction_bias is a buffer (nemo-automodel updates it only when its recipe asks)
    want = {n for n in theirs if not n.startswith("vision_model.") and not n.endswith("e_score_correction_bias")
            and ".experts." not in n.replace("shared_experts", "")}
    assert set(sent) == want
    for name, tensor in sent.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=0, msg=name)
