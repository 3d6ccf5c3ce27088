"""Image prompts of nemo-automodel's Nemotron-3-Nano-Omni (the omni3 launch recipes' architecture) on the automodel
backend on CPU, a tiny random one (runtime/tiny_vlm.py `build_tiny_omni`: RADIO tower, pixel-shuffle projector,
an attention and an MoE block: its Mamba mixer is CUDA-only) in a one-rank gloo world, in bf16 (its forward casts
the vision features to bf16, as its checkpoints are).

- the log-probs of image prompts (a padded row included) are those of its own forward's logits, and change with
  the image;
- under context parallelism (`context_parallel.prepare`, `logprobs._vlm_shard_hidden`) its forward takes the whole
  rows, splices the images in and cuts the result itself (its `cp_mesh`); on a 1-rank cp mesh (torch's ring
  attention has no CPU path) the log-probs and every gradient, the vision tower's included, equal the forward
  without CP (the gradients to bf16's rounding). tests/runtime/test_context_parallel.py checks its in-forward cut against the sharder's on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

from runtime.logprobs import token_logprobs, vision_inputs
from runtime.models import automodel
from runtime.tiny_vlm import build_tiny_omni
from schemas.plan import ModelPlan

FEATURES = 4  # <image> placeholders per 64x64 image: 4x4 patches of 16, 2x2 pixel shuffle


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(build_tiny_omni(tmp_path_factory.mktemp("omni") / "model", seed=0, vocab_size=300))


def _build(path: str, world):
    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="bfloat16", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")
    return automodel.build(plan, path, world, torch.device("cpu"))


def _batch(path: str, seed: int = 0):
    """Two image prompts with answers, the second right-padded: (ids, mask, per-row image inputs)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    image = [tok.convert_tokens_to_ids("<img>"), *[tok.convert_tokens_to_ids("<image>")] * FEATURES,
             tok.convert_tokens_to_ids("</img>")]
    rows = [tok.encode("what is") + image + tok.encode("it is green, with a box"), tok.encode("?") + image + [5, 6]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows]).bool()
    gen = torch.Generator().manual_seed(seed)
    mm = [{"pixel_values": torch.randn(1, 3, 64, 64, generator=gen), "imgs_sizes": torch.tensor([[64, 64]])}
          for _ in rows]
    return ids, mask, mm


def _logprobs(model, ids, mask, mm, cp=None):
    vision = vision_inputs(mm, ids, model.config.image_token_id, torch.device("cpu"))
    return token_logprobs(model, ids, mask, 1.0, vision=vision, cp=cp)[0]


def test_image_prompt_logprobs_are_its_forwards(world, checkpoint):
    model = _build(checkpoint, world)
    assert "nemo_automodel.components.models.nemotron_omni.model.NemotronOmniForConditionalGeneration" in {
        f"{c.__module__}.{c.__name__}" for c in type(model).__mro__}  # nemo-automodel's own class, under FSDP2
    assert [b.block_type for b in automodel.decoder_layers(model)] == ["attention", "moe"]
    ids, mask, mm = _batch(checkpoint)
    with torch.no_grad():
        mine = _logprobs(model, ids, mask, mm)
        other = _logprobs(model, ids, mask, _batch(checkpoint, seed=1)[2])
        logits = model(input_ids=ids, attention_mask=mask.long(), pixel_values=torch.cat([m["pixel_values"] for m in mm]),
                       imgs_sizes=torch.cat([m["imgs_sizes"] for m in mm]), use_cache=False).logits
    theirs = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    real = mask[:, 1:]
    torch.testing.assert_close(mine[real], theirs[real], rtol=0, atol=1e-5)
    assert (mine[real] - other[real]).abs().max() > 1e-3  # the images reach the model


def test_context_parallel_cuts_the_spliced_rows_in_its_forward(world, checkpoint):
    from torch.distributed.device_mesh import init_device_mesh

    from runtime import context_parallel

    cp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    ids, mask, mm = _batch(checkpoint)
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
