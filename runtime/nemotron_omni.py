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

Its HF export (`export_weights`) is its state-dict adapter's `to_hf`, the checkpoint's own layout (the legacy RADIO
and projector names, `language_model.backbone.*` with one tensor per expert), not the streamed export of the other
models: that stream sends one tensor per parameter under a renamed name (`automodel.hf_weights`), and the omni's
adapter has no such map (`internal_to_hf_map`): it splits each grouped-experts parameter into a tensor per expert.
(Its fusing of RADIO's query/key/value, for the timm-style `attention.attention.query` names, does not apply to
transformers 5's `RadioModel`, whose attention has `q_proj` / `k_proj` / `v_proj`.)
"""

from __future__ import annotations

import contextlib
import functools
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


_CONFIG_CLASS = "NemotronH_Nano_Omni_Reasoning_V3_Config"


def __getattr__(name: str):
    """The config class as a module attribute, built on first use (transformers is imported then): pickle finds it
    by this name (vLLM sends the config to its engine-core process)."""
    if name == _CONFIG_CLASS:
        return _config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _config_class():
    from transformers.models.nemotron_h_omni.configuration_nemotron_h_omni import NemotronH_Omni_Reasoning_V3_Config

    def alias(field: str) -> property:
        return property(lambda self: getattr(self, field))

    return type(
        _CONFIG_CLASS,
        (NemotronH_Omni_Reasoning_V3_Config,),
        {"model_type": MODEL_TYPE, "__module__": __name__,
         **{legacy: alias(field) for legacy, field in _LEGACY_NAMES.items()}},
    )


def register() -> None:
    """The checkpoint's model_type in transformers' `AutoConfig` (`register_config`) and nemo-automodel's omni
    reading and writing the checkpoint's RADIO names (`_checkpoint_radio_names`). Idempotent."""
    register_config()
    _checkpoint_radio_names()


def register_config() -> None:
    """The checkpoint's model_type in transformers' `AutoConfig` (unless something registered it already): what
    vLLM's processes need too (`runtime.no_torchvision.allow`, vLLM's plugin hook). Idempotent."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, _config_class())


_NEMO_TO_TRANSFORMERS_RADIO = (
    ("attention.attention.query.", "attention.q_proj."),
    ("attention.attention.key.", "attention.k_proj."),
    ("attention.attention.value.", "attention.v_proj."),
    ("attention.output.dense.", "attention.o_proj."),
)
"""nemo-automodel's omni adapter maps the checkpoint's timm RADIO names (`attn.qkv` fused, `attn.proj`) to the
native RadioModel of the checkpoints' remote code (`attention.attention.query` ..., `attention.output.dense`);
transformers 5's own RadioModel, which it builds here, calls them `attention.q_proj` ... `attention.o_proj`
(transformers' own conversion mapping for "radio" splits `attn.qkv` into those)."""


def _checkpoint_radio_names() -> None:
    """nemo-automodel's omni built with transformers' RadioModel reads and writes the checkpoint's RADIO names
    (`vision_model.radio_model.model.blocks.N.attn.qkv` / `attn.proj`, what the released checkpoints and vLLM's
    `radio.py` use): its adapter's names for the native tower are the remote code's (`_NEMO_TO_TRANSFORMERS_RADIO`);
    without this, `to_hf` wrote `blocks.N.attention.q_proj` ... (no checkpoint's and no vLLM's name: vLLM skips
    them silently) and `from_hf` left a real checkpoint's q/k/v and projection unloaded. The model's adapter
    becomes `_TransformersRadioAdapter` right after it is built, when its tower is transformers' RadioModel.
    Idempotent."""
    from nemo_automodel.components.models.nemotron_omni import model as omni

    cls = omni.NemotronOmniForConditionalGeneration
    if getattr(cls, "_molt_radio_names", False):
        return
    build = cls.__init__

    def __init__(self, *args, **kwargs):
        build(self, *args, **kwargs)
        from transformers.models.radio.modeling_radio import RadioModel

        adapter = getattr(self, "state_dict_adapter", None)
        if adapter is not None and isinstance(self.vision_model, RadioModel) and adapter.vision_uses_native_radio:
            adapter.__class__ = _adapter_class()

    cls.__init__ = __init__
    cls._molt_radio_names = True


def _rename(name: str, pairs) -> str:
    if ".encoder.layer." in name:
        for old, new in pairs:
            name = name.replace(old, new)
    return name


@functools.cache
def _adapter_class():
    from nemo_automodel.components.models.nemotron_omni.state_dict_adapter import NemotronOmniStateDictAdapter

    to_transformers = _NEMO_TO_TRANSFORMERS_RADIO
    to_nemo = tuple((new, old) for old, new in to_transformers)

    class _TransformersRadioAdapter(NemotronOmniStateDictAdapter):
        """nemo-automodel's omni adapter between the checkpoint and transformers' RadioModel's names."""

        def from_hf(self, hf_state_dict, device_mesh=None, **kwargs):
            state = super().from_hf(hf_state_dict, device_mesh=device_mesh, **kwargs)
            return {_rename(k, to_transformers): v for k, v in state.items()}

        def to_hf(self, state_dict, exclude_key_regex=None, **kwargs):
            renamed = {_rename(k, to_nemo): v for k, v in state_dict.items()}
            return super().to_hf(renamed, exclude_key_regex=exclude_key_regex, **kwargs)

    return _TransformersRadioAdapter


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


def is_omni(model) -> bool:
    """nemo-automodel's Nemotron-Omni (its state-dict adapter is the omni's)."""
    adapter = type(getattr(model, "state_dict_adapter", None))
    return any(c.__name__ == "NemotronOmniStateDictAdapter" for c in adapter.__mro__)  # `_adapter_class` too


VISION_TOWER = "vision_model."
"""The RADIO tower's parameter prefix: no engine is sent it (`engine_names`)."""


def engine_names(model) -> dict[str, tuple[str, bool]]:
    """Each floating parameter's name as vLLM's `nano_nemotron_vl` loads it, and whether its last two dims swap: the
    checkpoint's name, from the adapter's own per-tensor conversion (`convert_single_tensor_to_hf`, run on a meta
    stand-in); a grouped-experts parameter, which that conversion splits into a tensor per expert, under the fused
    name vLLM's MoE loader takes whole (`...experts.up_proj` / `down_proj`, (experts, out, in): nemo-automodel's
    (experts, in, out) swapped). The RADIO tower is left out: vLLM loads it only as the checkpoint's fused `attn.qkv`,
    which a stream of one tensor per parameter cannot send (its query, key and value are three parameters), so the
    compiler refuses omni RL on vLLM engines unless the tower is frozen (`actor.freeze.visual_encoder`, rule
    VLLM014) and the engines keep the tower they loaded."""
    import torch

    adapter = model.state_dict_adapter
    names: dict[str, tuple[str, bool]] = {}
    for name, p in model.named_parameters():
        if not p.is_floating_point() or name.startswith(VISION_TOWER):
            continue
        converted = adapter.convert_single_tensor_to_hf(name, torch.empty(p.shape, device="meta"))
        if len(converted) == 1:
            names[name] = (converted[0][0], False)
        else:  # one tensor per expert: `....experts.0.up_proj.weight` -> `....experts.up_proj`
            head, _, tail = converted[0][0].partition(".experts.0.")
            names[name] = (f"{head}.experts.{tail.removesuffix('.weight')}", True)
    return names


def export_weights(model, out_dir: str, rank: int, file_bytes: int) -> None:
    """The model's weights in the checkpoint's layout under `out_dir` (collective; rank 0 writes): the full fp32
    state dict gathered to rank 0's host memory (torch's `get_model_state_dict`, every placement), its adapter's
    `to_hf`, files of at most `file_bytes` (an index when more than one). Rank 0 holds the whole model on the host
    while it writes (the 31.6 B omni: 126 GB in fp32)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    hf = model.state_dict_adapter.to_hf({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    files: list[dict] = [{}]
    size = 0
    for name, tensor in hf.items():
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > file_bytes:
            files.append({})
            size = 0
        files[-1][name] = tensor.contiguous()
        size += nbytes
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    for name, tensors in zip(names, files, strict=True):
        save_file(tensors, str(Path(out_dir) / name), metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(t.numel() * t.element_size() for f in files for t in f.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: name for name, f in zip(names, files, strict=True) for n in f}}
        (Path(out_dir) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
