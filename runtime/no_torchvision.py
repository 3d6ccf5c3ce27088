"""Let Qwen-VL processors and vLLM's Qwen-VL models load without torchvision (it does not load against CPU torch).

PyPI's torchvision wheels are CUDA builds: against our `torch==2.13.0+cpu` they fail to import, and transformers'
image utils then break vLLM, so the setup uninstalls them (`reference/environment.md` §3). Only the *video*
processors and the torchvision image backend need it; Qwen-VL images go through transformers' PIL backend
(`Qwen2VLImageProcessorPil`) just as well. Three places still insist on torchvision, and `allow()` relaxes each,
only when torchvision is missing:

- a processor needs a video processor: `NoVideoProcessor` stands in (it declares no kwargs, so vLLM's kwarg
  introspection works, and processes no video);
- `ProcessorMixin`'s argument check looks `VideoProcessorMixin` up on a torchvision-less dummy mapping: the
  stand-in is accepted for `video_processor`;
- `from_pretrained` asks `AutoVideoProcessor` for a video processor: it answers the stand-in;
- vLLM's `qwen2_vl` model module imports `smart_resize` from the torchvision image-processor module: that module
  name is served by the PIL one (same function, and `Qwen2VLImageProcessor` names the PIL class).

vLLM inspects and runs models in other processes (registry subprocess, engine core, workers); it calls
`allow` there through the `vllm.general_plugins` entry point in pyproject.toml. Idempotent.
"""

from __future__ import annotations

import sys
import types

from transformers.processing_utils import VideosKwargs
from transformers.utils import PushToHubMixin

_TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class NoVideoProcessor(PushToHubMixin):
    """The video processor of a processor loaded without torchvision: no videos (a video request fails in it).

    A `PushToHubMixin` with an empty `to_dict` so the processor's repr/serialisation skips it.
    """

    valid_kwargs = VideosKwargs
    # vLLM's Qwen3-VL profiling sizes the largest video even when a prompt may hold none (limit 0): the smallest
    # video its own defaults describe (one 64x64 frame pair of 16-pixel patches); no video is ever processed
    size = {"shortest_edge": 64 * 64, "longest_edge": 64 * 64}
    temporal_patch_size = 2
    patch_size = 16
    merge_size = 2

    def to_dict(self) -> dict:
        return {}

    def __call__(self, *args, **kwargs):
        raise RuntimeError("videos need torchvision, which is not installed (runtime/no_torchvision.py)")


def allow() -> None:
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or _TORCHVISION_IMAGE_MODULE in sys.modules:
        return
    from transformers import processing_utils
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check_argument(self, argument_name, argument):
        if argument_name == "video_processor" and isinstance(argument, NoVideoProcessor):
            return None
        return check(self, argument_name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_argument
    AutoVideoProcessor.from_pretrained = classmethod(lambda cls, *args, **kwargs: NoVideoProcessor())
    alias = types.ModuleType(_TORCHVISION_IMAGE_MODULE, "PIL stand-in for the torchvision Qwen2-VL image processor")
    alias.smart_resize = pil.smart_resize
    alias.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[_TORCHVISION_IMAGE_MODULE] = alias
