"""What lets nemo-automodel's Nemotron-3-Nano-Omni (`NemotronOmniForConditionalGeneration`) load here, offline.

The checkpoint's config.json (model_type `NemotronH_Nano_Omni_Reasoning_V3`) names its sub-configs and token ids
the way its own remote code does (`llm_config`, `img_context_token_id`, `vit_hidden_size`, ...), and
nemo-automodel's omni reads those names. transformers has this checkpoint's config class natively
(`NemotronH_Omni_Reasoning_V3_Config`, model_type `nemotron_h_omni`: a `RadioConfig` vision tower, a
`NemotronHConfig` language model, the legacy names read in); `register` serves it under the checkpoint's model_type
with the legacy names readable again, so no remote code is run (the job runs offline, and the runtime loads configs
without `trust_remote_code`).

nemo-automodel's omni also imports timm only to turn timm's fused attention off around building the vision tower
(for the checkpoints whose remote code is a timm RADIO); transformers' native `RadioModel`, which it builds when
the checkpoint ships no `modeling_radio.py`, does not use timm. Where timm is not installed (it needs torchvision,
which does not load against our CPU torch), `without_timm` gives that one switch a stand-in that does nothing,
for the build only (nothing else may take the stand-in for timm).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

MODEL_TYPE = "NemotronH_Nano_Omni_Reasoning_V3"
ARCHITECTURE = "NemotronH_Nano_Omni_Reasoning_V3"

_LEGACY_NAMES = {
    "llm_config": "text_config",
    "sound_config": "audio_config",
    "img_context_token_id": "image_token_id",
    "video_context_token_id": "video_token_id",
    "sound_context_token_id": "audio_token_id",
    "vit_hidden_size": "vision_hidden_size",
}
"""The checkpoint's names (what nemo-automodel reads) -> transformers' fields."""


def _config_class():
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

    def alias(field: str) -> property:
        return property(lambda self: getattr(self, field))

    return type(
        "NemotronH_Nano_Omni_Reasoning_V3_Config",
        (NemotronH_Omni_Reasoning_V3_Config,),
        {"model_type": MODEL_TYPE, "__module__": __name__,
         **{legacy: alias(field) for legacy, field in _LEGACY_NAMES.items()}},
    )


def register() -> None:
    """The checkpoint's model_type in transformers' `AutoConfig` (unless something registered it already).
    Idempotent."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, _config_class())


@contextlib.contextmanager
def without_timm() -> Iterator[None]:
    """Within the block, `timm.layers.config.set_fused_attn` imports as a no-op where timm is not installed."""
    import importlib.util

    if "timm" in sys.modules or importlib.util.find_spec("timm") is not None:
        yield
        return
    names = ("timm", "timm.layers", "timm.layers.config")
    modules = {name: types.ModuleType(name) for name in names}
    modules["timm.layers.config"].set_fused_attn = lambda enable=True, experimental=False: None  # type: ignore[attr-defined]
    modules["timm"].layers = modules["timm.layers"]  # type: ignore[attr-defined]
    modules["timm.layers"].config = modules["timm.layers.config"]  # type: ignore[attr-defined]
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
