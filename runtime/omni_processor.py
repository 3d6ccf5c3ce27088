"""Nemotron-Omni's image processor without torchvision, and its output as nemo-automodel's omni forward takes it.

transformers' `NemotronH_Omni_Reasoning_V3ImageProcessor` is a torchvision backend (its module imports
`torchvision.transforms.v2.functional`), and torchvision does not load against our CPU torch
(`reference/environment.md` §3). Its arithmetic needs none of torchvision: per image, the patch grid
(`get_patch_grid_size`), a float32 bicubic antialiased resize (torchvision's float path is `torch.nn.functional.
interpolate(mode="bicubic", align_corners=False, antialias=True)`, unclamped), rescale and normalize fused
((x - 255 mean) / (255 std), float32), and the patch split (`convert_image_to_patches`). `ImageProcessor` is a PIL
backend that runs exactly that, with transformers' own two grid/patch functions (its module imported with a
stand-in for its torchvision import, for the import only: nothing calls torchvision). `Processor` is transformers'
`NemotronH_Omni_Reasoning_V3Processor` around it: `<image>` becomes `<img>` + one `<image>` per feature (grid / 2x2
pixel shuffle) + `</img>`, and it returns `pixel_values` (patches x 3·16², the patches of all images in order) and
`image_grid_hw` (images x 2), the row's model inputs (`runtime/vlm.py`).

nemo-automodel's omni takes images differently: `pixel_values` (images x 3 x H x W, padded to the largest) with
`imgs_sizes` (images x 2, pixels), its dynamic-resolution path (the one vLLM's `nano_nemotron_vl` serves);
`model_images` turns the patches back into those images, exactly (a reshape).

transformers has no auto-class entry for this processor (nor for the checkpoint's model_type), so `load` builds it
from the checkpoint's files: the tokenizer and `preprocessor_config.json` (`norm_mean` / `norm_std`, the released
checkpoints' names, read as transformers' class reads them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import types
from pathlib import Path

import numpy as np
import torch
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PILImageResampling
from transformers.processing_utils import ImagesKwargs

_REFERENCE = "transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni"
_TORCHVISION = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                "torchvision.transforms.v2.functional")


@functools.cache
def reference():
    """transformers' omni image-processor module (its `get_patch_grid_size`, `convert_image_to_patches`); where
    torchvision is missing, imported with stand-in torchvision modules that exist during the import only (and the
    module then dropped from `sys.modules`, so nothing else finds its torchvision class half-built)."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():  # cached by transformers before any stand-in exists
        import importlib

        return importlib.import_module(_REFERENCE)
    with _torchvision_stand_in():
        import importlib

        module = importlib.import_module(_REFERENCE)
    sys.modules.pop(_REFERENCE, None)
    return module


@contextlib.contextmanager
def _torchvision_stand_in():
    stand_ins = {name: types.ModuleType(name) for name in _TORCHVISION}
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name in _TORCHVISION:
            if sys.modules.get(name) is stand_ins[name]:
                del sys.modules[name]


class ImageProcessorKwargs(ImagesKwargs, total=False):
    """transformers' `NemotronH_Omni_Reasoning_V3ImageProcessorKwargs` (its module cannot be imported as is)."""

    patch_size: int
    downsample_ratio: float
    min_num_patches: int
    max_num_patches: int
    max_model_len: int


class NemotronH_Omni_Reasoning_V3ImageProcessorPil(PilBackend):  # noqa: N801 (transformers' name + "Pil")
    """transformers' Nemotron-Omni image processor, its numbers computed without torchvision (module docstring).
    Saved, it names transformers' class (`PilBackend.to_dict` drops the "Pil")."""

    resample = PILImageResampling.BICUBIC
    do_rescale = True
    do_normalize = True
    image_mean = OPENAI_CLIP_MEAN
    image_std = OPENAI_CLIP_STD
    do_convert_rgb = True
    patch_size = 16
    downsample_ratio = 0.5
    min_num_patches = 1024
    max_num_patches = 13312
    max_model_len = 16384
    valid_kwargs = ImageProcessorKwargs
    model_input_names = ["pixel_values", "image_grid_hw"]

    def __init__(self, **kwargs):
        # as transformers' class: released checkpoints store the statistics as `norm_mean` / `norm_std`
        if (norm_mean := kwargs.pop("norm_mean", None)) is not None:
            kwargs.setdefault("image_mean", norm_mean)
        if (norm_std := kwargs.pop("norm_std", None)) is not None:
            kwargs.setdefault("image_std", norm_std)
        kwargs.pop("_downsample_factor", None)
        super().__init__(**kwargs)

    @property
    def merge_size(self) -> int:
        """Patches per side of one feature (the model's pixel shuffle)."""
        return round(1 / self.downsample_ratio)

    def _preprocess(self, images: list[np.ndarray], resample, do_rescale: bool, rescale_factor: float,
                    do_normalize: bool, image_mean, image_std, patch_size: int, downsample_ratio: float,
                    min_num_patches: int, max_num_patches: int, max_model_len: int, return_tensors=None,
                    **kwargs) -> BatchFeature:
        if resample not in (PILImageResampling.BICUBIC, int(PILImageResampling.BICUBIC)):
            raise ValueError(f"resample {resample!r}: only transformers' default (bicubic) is implemented here")
        ref = reference()
        merge_size = round(1 / downsample_ratio)
        # transformers' budget: every image of the call gets the context length in pre-shuffle patches, clamped
        num_patches = max((max_model_len - 4) * merge_size**2, min_num_patches * len(images))
        if max_num_patches:
            num_patches = min(num_patches, max_num_patches)
        num_patches = max(num_patches, min_num_patches)
        mean, std = _normalization(do_rescale, rescale_factor, do_normalize, image_mean, image_std)
        patches, grids = [], []
        for image in images:  # (C, H, W) uint8, as the torchvision backend's tensors
            height, width = image.shape[-2:]
            grid_h, grid_w = ref.get_patch_grid_size(height, width, patch_size, merge_size, min_num_patches,
                                                     num_patches)
            x = torch.from_numpy(np.ascontiguousarray(image))[None].to(torch.float32)
            if (height, width) != (grid_h * patch_size, grid_w * patch_size):
                x = torch.nn.functional.interpolate(x, size=[grid_h * patch_size, grid_w * patch_size],
                                                    mode="bicubic", align_corners=False, antialias=True)
            if mean is not None:
                x = (x - mean) / std
            elif do_rescale:
                x = x * rescale_factor
            patches.append(ref.convert_image_to_patches(x, patch_size)[0])
            grids.append([grid_h, grid_w])
        return BatchFeature(data={"pixel_values": torch.cat(patches), "image_grid_hw": torch.tensor(grids)},
                            tensor_type=return_tensors)


def _normalization(do_rescale: bool, rescale_factor: float, do_normalize: bool, image_mean, image_std):
    """(mean, std) as (C, 1, 1) float32, with the rescale fused in as transformers' torchvision backend fuses it
    (`_fuse_mean_std_and_rescale_factor`); (None, None) without normalization."""
    if not do_normalize:
        return None, None
    mean, std = torch.tensor(image_mean), torch.tensor(image_std)
    if do_rescale:
        mean, std = mean * (1.0 / rescale_factor), std * (1.0 / rescale_factor)
    return mean.to(torch.float32).view(-1, 1, 1), std.to(torch.float32).view(-1, 1, 1)


@functools.cache
def _processor_class():
    from transformers.models.nemotron_h_omni.processing_nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor

    class ImagesOnlyProcessor(NemotronH_Omni_Reasoning_V3Processor):
        """transformers' omni processor without a video processor or an audio feature extractor (its video
        processor needs torchvision too; no recipe feeds the omni video or audio): those two may be None."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name in ("video_processor", "feature_extractor"):
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnlyProcessor


def build(tokenizer, image_processor: NemotronH_Omni_Reasoning_V3ImageProcessorPil, chat_template: str | None = None):
    """transformers' omni processor around `image_processor`, images only."""
    return _processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                              chat_template=chat_template or tokenizer.chat_template)


def save(processor, out: Path) -> None:
    """Tokenizer, `preprocessor_config.json` (transformers' class name) and `processor_config.json`."""
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": PROCESSOR_CLASS}) + "\n")


PROCESSOR_CLASS = "NemotronH_Omni_Reasoning_V3Processor"


def load(path: str):
    """The processor of an omni checkpoint directory: its tokenizer and `preprocessor_config.json`'s settings."""
    from transformers import AutoTokenizer

    settings = json.loads((Path(path) / "preprocessor_config.json").read_text())
    known = set(ImageProcessorKwargs.__annotations__) | set(ImagesKwargs.__annotations__) | {"norm_mean", "norm_std"}
    image_processor = NemotronH_Omni_Reasoning_V3ImageProcessorPil(**{k: v for k, v in settings.items() if k in known})
    return build(AutoTokenizer.from_pretrained(path), image_processor)


def is_omni_checkpoint(path: str) -> bool:
    from runtime import nemotron_omni

    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == nemotron_omni.MODEL_TYPE


def model_images(pixel_values: torch.Tensor, image_grid_hw: torch.Tensor, patch_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The processor's patches (patches x C·p², row-major per image) as nemo-automodel's omni takes images:
    (images x C x H x W, zero-padded to the largest H and W; it crops each back) and `imgs_sizes` (images x 2)."""
    grids = [(int(h), int(w)) for h, w in image_grid_hw.tolist()]
    channels = pixel_values.shape[-1] // (patch_size * patch_size)
    if channels * patch_size * patch_size != pixel_values.shape[-1] or sum(h * w for h, w in grids) != len(pixel_values):
        raise ValueError(f"{tuple(pixel_values.shape)} pixel values are not the patches of {patch_size}-pixel grids "
                         f"{grids}")
    height, width = max(h for h, _ in grids) * patch_size, max(w for _, w in grids) * patch_size
    images = pixel_values.new_zeros((len(grids), channels, height, width))
    start = 0
    for i, (h, w) in enumerate(grids):
        patches = pixel_values[start:start + h * w].reshape(h, w, channels, patch_size, patch_size)
        images[i, :, :h * patch_size, :w * patch_size] = patches.permute(2, 0, 3, 1, 4).reshape(
            channels, h * patch_size, w * patch_size)
        start += h * w
    sizes = torch.tensor([[h * patch_size, w * patch_size] for h, w in grids], device=pixel_values.device)
    return images, sizes
