"""The `automodel` backend: nemo-automodel's `NeMoAutoModelForCausalLM` builds the model, FSDP2 shards it.

nemo-automodel (pinned in the `automodel` extra) picks its own implementation of the architecture from its model
registry: for the MoE families the compiler sends here (`model.backend: automodel` on an architecture with an
AutoModel class, Molt H9), its MoE layers (`Gate` routers, grouped experts) built with the `BackendConfig` Molt uses
for custom models (B19): the plan's attention (sdpa or te), torch linear layers, `torch_mm` experts, fp32 RMSNorm,
no rope fusion, the plan's router dtype as the gate precision and the plan's token dispatcher. The model then goes
through the same FSDP2 wrapping as the `hf` backend (`hf.shard`: routers their own unit in the router dtype, one
unit per decoder layer, the root), over the `dp` mesh at `mesh.ep` 1 (HSDP's 2-D (dp_replicate, dp_shard) mesh at
the plan's `mesh.dp_replicate`). At `mesh.ep` > 1 nemo-automodel's own device mesh (`MeshContext`: ep carved out of
the data-parallel ranks, ep_shard = ranks / ep, dp_replicate as the plan says) and its MoE parallelizer
(`parallelize_model`: each rank holds experts/ep of every MoE layer, FSDP2-sharded over its ep_shard group when ep is
below the ranks; the plan's token dispatcher moves the tokens; FSDP2, or HSDP, shards the rest over dp) place the
model. At `mesh.tp` > 1 (a dense Qwen2, Qwen3 or Llama: the compiler sends them here for it) nemo-automodel's mesh
with its tp axis and its dense parallelizer with its TP plan (`tensor_parallel`). The expert gradients' scaling to the global token
mean is `expert_parallel`'s; the weight sync reads every one of these placements piece by piece
(`runtime/shard_layout.py`).

On CPU nemo-automodel runs too, its MoE layers included (they match transformers' Qwen3-MoE logits to 3e-7 here),
once three of its CUDA assumptions are answered for the build (`_built_on_cpu`): its build reads
`torch.cuda.current_device()` for a device index, its checkpoint load goes to that device, and the rotary embedding
keeps it for buffers it makes at the first forward. `reference/environment.md` §2 documents the first.

The engines and the HF export see transformers' names and layouts (`hf_weights`, and `hf_state_dict` for a whole
state dict): nemo-automodel's grouped experts hold (experts, in, out) matrices where transformers' fused experts hold
(experts, out, in), so the two expert parameters of each MoE layer travel transposed under transformers' names; every
other parameter has the same layout, and the same name but for nemo-automodel's module renames (`renames`: its fp32
holder of the gated-delta-net parameters, Qwen3.5/3.6-MoE's `shared_experts`) (checked against transformers' model of
the same checkpoint in tests/runtime/models/test_automodel.py and test_automodel_vlm.py).

A VLM builds as nemo-automodel's image-text-to-text model (`NeMoAutoModelForImageTextToText`: its own Qwen3.5/3.6-MoE
implementation, say) and is sharded as the hf backend shards one (`build`); its image prompts' log-probs and
optimizer steps equal the hf backend's (tests/runtime/models/test_automodel_vlm.py). At `mesh.ep` > 1 the same
parallelizer places its language model's experts over ep, with the hf backend's FSDP2 units (`_RootUnit`); its
log-probs and optimizer step equal ep 1's (tests/runtime/models/test_automodel_vlm_ep.py, and in SFT
tests/runtime/test_sft_vlm_expert_parallel.py).

Its gates' own load-balancing loss is switched off (`aux_loss_coeff = 0`): the trainer adds the recipe's
load-balancing and z-loss itself from the gates' logits (`runtime/moe.py`), once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from runtime import context_parallel, moe, nemotron_omni
from runtime.logprobs import attach
from runtime.models import hf
from runtime.models.base import Meshes
from runtime.packages import DISPATCHER_PACKAGES

if TYPE_CHECKING:
    from schemas.plan import LoraPlan, MeshPlan, ModelPlan


def device_mesh(device: str, world: int, mesh: MeshPlan | None) -> Meshes:
    """`hf`'s `dp` mesh at ep 1 (HSDP's (dp_replicate, dp_shard) at the plan's dp_replicate; no mesh: the reference
    and critic groups); at ep > 1 nemo-automodel's world mesh (pp, dp_replicate, dp_shard, cp, tp) and its
    (ep_shard, ep) expert mesh over the same ranks (ep_shard = ranks / ep: 1 when ep spans them): every rank is a
    data-parallel rank (ep is carved out of dp), so each takes its own rows of a batch. At cp > 1 the same world
    mesh with its cp axis (`Meshes.cp`, runtime/context_parallel.py); at ep 1 FSDP2 then shards over its flattened
    dp x cp ranks (`dp_shard_cp`)."""
    if mesh is None or (mesh.ep == 1 and mesh.cp == 1 and mesh.tp == 1):
        return hf.dp_meshes(device, world, 1 if mesh is None else mesh.dp_replicate)
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.mesh_utils import get_fsdp_dp_mesh

    sizes = ParallelismSizes(ep_size=mesh.ep, dp_replicate_size=mesh.dp_replicate, cp_size=mesh.cp,
                             tp_size=mesh.tp)
    ctx = MeshContext.build(FSDP2Config(), sizes, world_size=world)
    cp = ctx.device_mesh["cp"] if mesh.cp > 1 else None
    tp = ctx.device_mesh["tp"] if mesh.tp > 1 else None
    if tp is not None:  # nemo-automodel's dense parallelizer takes the world mesh (`tensor_parallel`)
        return Meshes(fsdp=ctx.device_mesh, moe=None, cp=cp, tp=tp)
    # ep 1: `hf.shard` takes nemo-automodel's FSDP mesh of the dp x cp ranks
    fsdp = ctx.device_mesh if ctx.moe_mesh is not None else get_fsdp_dp_mesh(ctx.device_mesh)
    return Meshes(fsdp=fsdp, moe=ctx.moe_mesh, cp=cp)


# nemo-automodel's grouped-experts parameters -> transformers' fused-experts names (both (experts, ., .), transposed)
_EXPERTS = {".experts.gate_and_up_projs": ".experts.gate_up_proj", ".experts.down_projs": ".experts.down_proj"}


# nemo-automodel's other names that transformers spells otherwise: its gated-delta-net layers keep their fp32
# parameters in a `_fp32_params` holder (every architecture), and some of its implementations rename modules (its
# state-dict adapter's `internal_to_hf_map`: Qwen3.5/3.6-MoE's and Qwen3-Next's `shared_experts` are transformers'
# `shared_expert`; `renames`). Expert renames stay `_EXPERTS`' (they also transpose).
_FP32_HOLDER = {"._fp32_params.": "."}
_export_renames: dict[str, str] = dict(_FP32_HOLDER)
"""The trained model's renames, for `hf_state_dict` (it sees only a state dict): set by `build`."""


def renames(model) -> dict[str, str]:
    """nemo-automodel's module renames of `model` (its adapter's, expert entries left to `_EXPERTS`)."""
    mapping = getattr(getattr(model, "state_dict_adapter", None), "internal_to_hf_map", None) or {}
    return {**_FP32_HOLDER, **{k: v for k, v in mapping.items() if "experts." not in k or "shared_experts" in k}}


def hf_name(name: str, names: dict[str, str] = _FP32_HOLDER) -> tuple[str, bool]:
    """(transformers' name of a nemo-automodel parameter, whether its last two dims are swapped there); `names`:
    the model's `renames`."""
    for nemo, transformers_name in names.items():
        name = name.replace(nemo, transformers_name)
    for nemo, transformers_name in _EXPERTS.items():
        if name.endswith(nemo):
            return name[: -len(nemo)] + transformers_name, True
    return name, False


@dataclass
class TransposedExperts:
    """A grouped-experts parameter as transformers lays it out: (experts, out, in); the weight sync's
    `shard_layout` swaps its pieces' last two dims too (`swapped`: under ep_shard FSDP2 cuts the base's dim 1)."""

    base: torch.Tensor
    swapped = True

    @property
    def shape(self) -> torch.Size:
        e, a, b = self.base.shape
        return torch.Size((e, b, a))

    def is_floating_point(self) -> bool:
        return True

    def local(self) -> torch.Tensor:
        local = self.base.to_local() if hasattr(self.base, "to_local") else self.base
        return local.detach().transpose(1, 2)


def hf_weights(model) -> list[tuple[str, Any]]:
    """(transformers' name, parameter, transposed view or merged LoRA weight) of every floating parameter, in module
    order: what a weight sync streams to the engines. Under expert parallelism an expert parameter is Shard(0) over
    `ep` (whole experts per rank), and with ep below the ranks Shard(1) over `ep_shard` as well; the sync reads each
    rank's box of it (`runtime/shard_layout.py`). Nemotron-Omni's names are its checkpoint's
    (`nemotron_omni.engine_names`: what vLLM's `nano_nemotron_vl` loads; its HF export is its own). Under LoRA the
    adapted linear layers travel merged (W + scale·B@A, `runtime/lora.py`); the adapters go on `nn.Linear` layers
    only, so the grouped experts are never adapted (Molt L12 refuses adapters on them)."""
    if getattr(model, "molt_lora", None) is not None:
        from runtime import lora

        named = lora.merged_weights(model)
    else:
        named = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
    out: list[tuple[str, Any]] = []
    if nemotron_omni.is_omni(model):  # its adapter renames tensor by tensor; its RADIO tower is not streamed
        omni = nemotron_omni.engine_names(model)
        for name, p in named:
            if name in omni:
                engine_name, swapped = omni[name]
                out.append((engine_name, TransposedExperts(p) if swapped else p))
        return out
    names = renames(model)
    for name, p in named:
        name, swapped = hf_name(name, names)
        out.append((name, TransposedExperts(p) if swapped else p))
    return out


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full nemo-automodel state dict under transformers' names and layouts (the HF export)."""
    out = {}
    for name, t in state.items():
        name, swapped = hf_name(name, _export_renames)
        out[name] = t.transpose(1, 2).contiguous() if swapped else t
    return out


@contextlib.contextmanager
def _built_on_cpu():
    """Within the block nemo-automodel builds for the CPU: `torch.cuda.current_device()` answers 0, so its device
    objects can be made (nothing is allocated on them while building), and its checkpoint load into the built model
    (`apply_model_infrastructure`) goes to the CPU."""
    import nemo_automodel._transformers.auto_model as auto_model

    current, infrastructure = torch.cuda.current_device, auto_model.apply_model_infrastructure

    def on_cpu(*args, **kwargs):
        return infrastructure(*args, **{**kwargs, "device": torch.device("cpu")})

    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    auto_model.apply_model_infrastructure = on_cpu
    try:
        yield
    finally:
        torch.cuda.current_device = current  # type: ignore[assignment]
        auto_model.apply_model_infrastructure = infrastructure


def check_dispatcher(dispatcher: str | None, device: torch.device, world: int) -> None:
    """Stop at job start, with the reason, when the plan's token dispatcher cannot run here: nemo-automodel swaps in
    its DeepEP experts only when more than one rank runs (at one rank it keeps its local grouped experts, and so
    may this), and would otherwise fail inside the first MoE forward. `world`: the ranks of the process group."""
    import importlib.util

    package = DISPATCHER_PACKAGES.get(dispatcher or "")
    if package is None or world == 1:
        return
    if device.type != "cuda":
        raise RuntimeError(f"model.moe_dispatcher: {dispatcher} runs on CUDA only (nemo-automodel's {package} "
                           f"kernels), not on {device.type}; set model.moe_dispatcher: torch")
    if importlib.util.find_spec(package) is None:
        raise RuntimeError(f"model.moe_dispatcher: {dispatcher} needs the {package} package, which does not import "
                           "in this environment; install it or set model.moe_dispatcher: torch")


def backend_config(model_plan: ModelPlan):
    """The `BackendConfig` of nemo-automodel's own implementations (Molt B19), from the plan. `attn` is the plan's
    `model.attn`, sdpa, te or tilelang (the capability table refuses the others on this backend): nemo-automodel's
    own attention paths, its te one being transformer_engine's DotProductAttention, its tilelang one GLM-5.2's DSA
    kernels, which take packed rows in THD form (`runtime.packed_thd`; the job's package check, `runtime.packages`,
    stops a te or tilelang plan at start without its package). flash_attention_2 never reaches here: unpacked, the
    compiler runs it as sdpa (B20: the plan says sdpa; on CUDA torch's sdpa picks its own flash kernel for the
    unmasked causal rows), and packed Molt refuses it on these models (PACK002); nemo-automodel's flex is refused
    (`rl-automodel-attn` says why)."""
    from nemo_automodel.components.models.common.utils import BackendConfig

    # a dense model has no dispatcher (None in the plan): nemo-automodel's default stands, unused
    dispatcher = {"dispatcher": model_plan.moe_dispatcher} if model_plan.moe_dispatcher else {}
    return BackendConfig(attn=model_plan.attn, linear="torch", experts="torch_mm", rms_norm="torch_fp32",
                         rope_fusion=False, gate_precision=getattr(torch, model_plan.router_dtype), **dispatcher)


def load(model_plan: ModelPlan, path: str, device: torch.device):
    """`path` as nemo-automodel builds it, fp32 master weights, unsharded, on `device`. A VLM (`hf.is_vlm`) builds
    as nemo-automodel's image-text-to-text model (`NeMoAutoModelForImageTextToText`, as its VLM recipes do): its
    own implementation where it has one (the Qwen3.5/3.6-MoE and omni families), else transformers' class with its
    checkpointing mixin. The `BackendConfig` goes only to its own implementations: its fallback forwards every
    keyword into transformers' constructor, which takes no `backend`."""
    import torch.distributed as dist
    from nemo_automodel import NeMoAutoModelForCausalLM, NeMoAutoModelForImageTextToText

    nemotron_omni.register()  # the omni checkpoint's config without its remote code (runtime/nemotron_omni.py)
    check_dispatcher(model_plan.moe_dispatcher, device, dist.get_world_size() if dist.is_initialized() else 1)
    if model_plan.gradient_checkpoint == "selective":
        _fsdp_hooks_outside_selective_replay()
    auto = NeMoAutoModelForImageTextToText if hf.is_vlm(path) else NeMoAutoModelForCausalLM
    backend = {"backend": backend_config(model_plan)} if auto is NeMoAutoModelForCausalLM or _native(path) else {}
    with _built_on_cpu() if device.type == "cpu" else contextlib.nullcontext(), nemotron_omni.without_timm():
        model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa", use_liger_kernel=False,
                                     **backend)
    model.to(device)
    for module in model.modules():
        if isinstance(getattr(module, "device", None), torch.device) and module.device != device:
            module.device = device  # the rotary embedding's lazily built buffers
    for gate in moe.routers(model):
        gate.aux_loss_coeff = 0.0  # the trainer adds the recipe's aux losses itself, from the logits that
        gate.use_routing_core = True  # its routing_core child receives (the same routing: runtime/moe.py)
    return model


def build_value_model(model_plan: ModelPlan, path: str, meshes: Meshes, device: torch.device,
                      offload: str = "none"):
    """The critic as Molt builds it on this path: nemo-automodel's causal LM of `path` with its vocabulary head
    replaced by a scalar head (`value_head`: transformers' token-classification `score`, one label, the same
    initialisation), its routers in their own unit, sharded and checkpointed like the policy (`hf.shard`), over the
    critic's data-parallel mesh (the plan gives the critic no expert mesh). With a tp mesh nemo-automodel's
    tensor-parallel build as the policy's (`tensor_parallel`), its plan of the architecture without the vocabulary
    head's entry: the scalar head stays whole on every tp rank (a column cut of one output has nothing to cut), fed
    the replicated hidden states, and its gradient comes out equal on them."""
    model = load(model_plan, path, device)
    if meshes.tp is not None:  # the architecture's plan, chosen for its causal LM before the head is replaced
        from nemo_automodel.components.distributed.parallelizer import _get_parallel_plan

        plan = _get_parallel_plan(model, sequence_parallel=False, tp_size=meshes.tp.size())
        plan = {name: style for name, style in plan.items() if not name.endswith("lm_head")}
    model.lm_head = value_head(model.config.get_text_config()).to(device)  # a VLM keeps its sizes in text_config
    if meshes.tp is not None:
        from runtime.fsdp import offload_policy

        # no sequence parallelism: the critic's plan never asks it (rule PAR005)
        return tensor_parallel(model, model_plan, meshes, True, offload_policy(offload, device), False, plan)
    return hf.shard(model, decoder_layers(model), model_plan, meshes.fsdp, True, False, None, offload)


def value_head(config) -> torch.nn.Linear:
    """`Linear(hidden, 1)` initialised as transformers initialises a token classifier's `score` (normal with the
    config's `initializer_range`, zero bias)."""
    head = torch.nn.Linear(config.hidden_size, 1)
    torch.nn.init.normal_(head.weight, std=config.initializer_range)
    torch.nn.init.zeros_(head.bias)
    return head


def _fsdp_hooks_outside_selective_replay() -> None:
    """Selective checkpointing replays a layer's forward ops by per-op index; the routers are FSDP2 units inside each
    checkpointed layer, and FSDP2's hooks (torch 2.13 runs them under profiler record_function ranges, and its
    all-gather copy-out runs only in the recompute when the forward prefetched) emit ops the recompute does not
    match. nemo-automodel's own fix takes those ops out of torch's replay accounting (they still run)."""
    from nemo_automodel.components.distributed.activation_checkpointing import (
        ensure_fsdp_ops_sac_ignored,
        ensure_profiler_ops_sac_ignored,
    )

    ensure_profiler_ops_sac_ignored()
    ensure_fsdp_ops_sac_ignored()


def _native(path: str) -> bool:
    """nemo-automodel has its own implementation of the checkpoint's architecture (its model registry)."""
    from nemo_automodel._transformers.registry import ModelRegistry
    from transformers import AutoConfig

    return any(ModelRegistry.has_custom_model(a) for a in AutoConfig.from_pretrained(path).architectures or ())


def decoder_layers(model) -> list:
    """nemo-automodel's decoder layers (a ModuleDict in its own implementations, a ModuleList in transformers'); a
    VLM's are its language model's (the Qwen-VL layout, `model.model.language_model`, in both)."""
    backbone = model.model
    layers = backbone.language_model.layers if hasattr(backbone, "language_model") else backbone.layers
    return list(layers.values()) if isinstance(layers, torch.nn.ModuleDict) else list(layers)


def build(model_plan: ModelPlan, path: str, meshes: Meshes, device: torch.device, trainable: bool = True,
          freeze_router: bool = False, lora: LoraPlan | None = None, freeze_visual_encoder: bool = False,
          offload: str = "none", sequence_parallel: bool = False):
    """`path` built by nemo-automodel, with `model_plan`'s checkpointing; without an expert mesh FSDP2-sharded over
    the `dp` mesh (`hf.shard`: routers in their own unit in the router dtype, frozen with `freeze_router`, matched
    by type as Molt F11 does; `offload: full` keeps the shards on the host), with one placed by nemo-automodel's
    parallelizer (`expert_parallel`) or its tensor-parallel one (`tensor_parallel`).
    `lora`: nemo-automodel's adapters on the plan's linear layers (`lora.apply_automodel`), patched in before
    whichever of the three builds places the model, as its recipes do: FSDP2 and expert parallelism shard them like
    the other parameters (the grouped experts are never adapted: Molt L12), its tensor-parallel plan cuts each with
    its base layer (LoRA-aware styles: a column-parallel layer's B by output rows, a row-parallel one's A by input
    columns); `sequence_parallel`: that plan's sequence-parallel styles.
    A VLM is sharded as the hf backend shards one: its language-model layers are the FSDP units and the vision
    tower stays in the root unit (all-gathered on every forward, so a rank whose micro-batch has no image runs the
    same collectives), under expert parallelism too (`_RootUnit`); `freeze_visual_encoder` stops the tower's
    gradients."""
    model = load(model_plan, path, device)
    if trainable:  # the export's names are the trained model's (a reference or teacher is never exported)
        _export_renames.clear()
        _export_renames.update(renames(model))
    if freeze_visual_encoder and hasattr(model.model, "visual"):
        model.model.visual.requires_grad_(False)
    if freeze_visual_encoder and hasattr(model, "vision_model"):  # Nemotron-Omni's RADIO tower (not its projector)
        model.vision_model.requires_grad_(False)
    video = getattr(getattr(getattr(model, "vision_model", None), "embeddings", None), "video_patch_projection", None)
    if video is not None:  # Nemotron-Omni's video embedder: no run feeds it video, so it never has a gradient, nor
        video.requires_grad_(False)  # optimizer state to checkpoint (a resume's whole-model optimizer asks for it)
    if lora is not None:
        from runtime import lora as lora_adapters

        lora_adapters.apply_automodel(model, lora)
        if trainable and model_plan.gradient_checkpoint != "none":
            hf.inputs_require_grads(model)
    if meshes.tp is not None:
        from runtime.fsdp import offload_policy

        model = tensor_parallel(model, model_plan, meshes, trainable, offload_policy(offload, device),
                                sequence_parallel)
    elif meshes.moe is None:
        model = hf.shard(model, decoder_layers(model), model_plan, meshes.fsdp, trainable, freeze_router, None,
                         offload)
    else:
        from runtime.fsdp import offload_policy

        model = expert_parallel(model, model_plan, meshes, trainable, freeze_router, offload_policy(offload, device))
    context_parallel.prepare(model, meshes.cp)
    return model


def expert_parallel(model, model_plan: ModelPlan, meshes: Meshes, trainable: bool, freeze_router: bool, policy):
    """nemo-automodel's `parallelize_model` on its meshes: the experts of each MoE layer Shard(0) over `ep` (its
    `ExpertParallel` style), everything else FSDP2 over the data-parallel ranks (its `apply_fsdp`: one unit per
    decoder layer, the experts ignored when ep_shard is 1), in the plan's compute dtype with fp32 gradient
    reduction. Its gates compute in the router dtype through the `BackendConfig` (`gate_precision`). A VLM's experts
    are its language model's (the parallelizer finds them there); its units are the hf backend's (`_RootUnit`).

    Gradients: FSDP2 averages the other parameters' gradients over its data-parallel mesh (dp x cp ranks, HSDP: its
    shards and replicas; `dp_cp` below, read from the mesh as nemo-automodel's recipe reads its `dp_group_size`
    with cp); an expert's gradient arrives summed over the ep group's tokens (the dispatcher's all-gather
    backward), which is dp_cp / ep_shard times the mean — the factor nemo-automodel's own recipe divides out before
    clipping (`scale_grads_and_clip_grad_norm`). With ep over every rank (ep_shard 1) the experts are no FSDP2 unit
    and a hook on each divides by dp_cp; with ep below the ranks they are FSDP2 units over ep_shard, whose sharded
    parameters autograd never reaches, so their reduce-scatter divides by dp_cp instead of ep_shard (a sum, then the
    division: gloo has no pre-scaled sum). Either way the trainer's global token mean holds for every parameter.

    `model.compile_layers`: each decoder layer compiled after the parallelizer (`hf.compile_layers`), its MoE block
    (the gate with routing replay's seam, the token dispatcher's collectives, the experts) eager between the compiled
    attention and norms; `hf.compile_layers` says why and where the checkpoint goes. nemo-automodel's own compile
    switches do not fit here: its `compile_model` compiles a whole model only outside FSDP2, and `compile_attn`
    (`BackendConfig`) compiles the attention with `fullgraph=True, dynamic=False`, which padded rows break (its
    padding check's `.item()`) and every new width would recompile."""
    from nemo_automodel.components.distributed.mesh_utils import get_fsdp_dp_mesh
    from nemo_automodel.components.moe.parallelizer import parallelize_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    checkpointed = trainable and model_plan.gradient_checkpoint != "none"
    if checkpointed and not model_plan.compile_layers:  # compiled layers checkpoint with their compile
        hf.enable_checkpointing(model, model_plan.gradient_checkpoint, decoder_layers(model))
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if freeze_router:
        moe.freeze_routers(model)
    names = meshes.moe.mesh_dim_names
    # HSDP (a dp_replicate axis over 1): nemo-automodel shards the rest over its 2-D (replicate, shard) mesh
    hsdp = meshes.fsdp["dp_replicate"].size() > 1
    # cp_axis_name None: its `apply_cp` sets up transformer_engine's or a model's own CP attention (te under CP is
    # refused, `rl-trainer-cp-te`); torch's ring attention comes with the sharder (runtime/context_parallel.py)
    parallelize_model(model, meshes.fsdp, meshes.moe, cp_axis_name=None,
                      dp_axis_names=("dp_replicate", "dp_shard_cp") if hsdp else ("dp_shard_cp",),
                      tp_axis_name="tp", ep_axis_name="ep",
                      ep_shard_axis_names=("ep_shard",) if "ep_shard" in names else None,
                      mp_policy=MixedPrecisionPolicy(param_dtype=getattr(torch, model_plan.dtype),
                                                     reduce_dtype=torch.float32),
                      offload_policy=policy, model_parallelizer=_RootUnit.of(model))
    ep_shard = meshes.moe["ep_shard"].size() if "ep_shard" in names else 1
    dp_cp = get_fsdp_dp_mesh(meshes.fsdp).size()  # the ranks FSDP2 averages the other gradients over
    if trainable and ep_shard > 1:
        from nemo_automodel.components.moe.layers import MoE

        for module in model.modules():
            if isinstance(module, MoE):
                module.experts.set_gradient_divide_factor(float(dp_cp))
                module.experts.set_force_sum_reduction_for_comms(True)
    elif trainable and dp_cp > 1:
        for p in model.parameters():
            if p.requires_grad and _on_ep(p):
                p.register_hook(lambda g: g / dp_cp)
    if model_plan.compile_layers:
        hf.compile_layers(decoder_layers(model), model_plan.gradient_checkpoint if trainable else "none")
    attach(model)  # chunked lm_head log-probs as an FSDP forward method
    return model


def tensor_parallel(model, model_plan: ModelPlan, meshes: Meshes, trainable: bool, policy, sequence_parallel: bool,
                    plan: dict[str, Any] | None = None):
    """nemo-automodel's dense parallelizer (`fsdp2_strategy_parallelize`) on its world mesh: its tensor-parallel
    plan of the architecture (`optimized_tp_plans`: for Qwen2/Qwen3 q/k/v, gate and up column-wise, o and down
    row-wise, q/k norms replicated with their gradients summed over tp, the embedding and the lm_head
    vocabulary-parallel: the head's logits stay vocab-sharded DTensors, gathered per log-prob chunk,
    `runtime/logprobs.py`), then FSDP2 over the dp x cp ranks (its units: one per decoder layer, the root), in the
    plan's compute dtype with fp32 gradient reduction. `sequence_parallel` (the plan's `actor.sequence_parallel`)
    asks the plan with its sequence-parallel styles: the embedding's output, the norms and the residual stream cut
    over tp by positions (the row-parallel layers reduce-scatter, the layers' inputs all-gathered before q/k/v and
    gate/up), so the final norm's output is a sequence-sharded DTensor (`runtime/logprobs.py` gathers it for the
    head). Any width: DTensor cuts a width that tp does not divide unevenly.

    The tp ranks of one data-parallel rank run the same rows (`FsdpRank.use_meshes`): the replicated parameters'
    gradients come out equal on them (DTensor's backward sums the partial input gradients over tp), FSDP2 averages
    over dp only, so the global token mean holds; the gradient norm is the whole mesh's (`fsdp.clip`: DTensor
    norms over every placement). `plan`: a TP plan of nemo-automodel's to use instead of the one it picks (the
    critic's, `build_value_model`).

    `model.compile_layers`: each decoder layer's forward compiled after the parallelizer (`hf.compile_layers`, as
    nemo-automodel's own per-layer compile comes after its TP and FSDP2), so dynamo traces the layer's DTensor
    parameters and TP's collectives in one graph, FSDP2's hooks eager around it. Full activation checkpointing stays
    eager around each compiled forward (`hf.checkpoint_layers` after the compile), its recompute running the same
    compiled graph again (no graph more, the one-rank numbers, a tenth of the saved activations:
    tests/runtime/models/test_tensor_parallel.py). Torch 2.13 fails the checkpoint traced inside the compiled TP layer
    (hf's order): AOT autograd's partitioner appends the saved RNG state of the recomputed attention op (CPU SDPA has
    a dropout argument) after the saved DTensor device mesh (`functionalize_rng_ops`), which shifts the mesh into the
    saved tensors ("expected all tensors_saved_with_vc_check to be Tensors"). Selective checkpointing keeps hf's
    order (the policy must see the traced ops; it never recomputes the attention op), refused by the compiler for
    now (`rl-trainer-tp-compile`)."""
    from nemo_automodel.components.distributed.parallelizer import (
        _patch_dtensor_spec_hash_for_symint,
        fsdp2_strategy_parallelize,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mode = model_plan.gradient_checkpoint if trainable else "none"
    # full checkpointing wraps each (compiled) layer's forward eagerly, compiled or not; selective goes inside a
    # compiled one
    eager_checkpoint = mode == "full" or (mode == "selective" and not model_plan.compile_layers)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    model = fsdp2_strategy_parallelize(
        model, meshes.fsdp, mp_policy=MixedPrecisionPolicy(param_dtype=getattr(torch, model_plan.dtype),
                                                          reduce_dtype=torch.float32),
        offload_policy=policy, sequence_parallel=sequence_parallel, activation_checkpointing=False,
        tp_shard_plan=plan)
    if model_plan.compile_layers:
        _patch_dtensor_spec_hash_for_symint()  # nemo-automodel's fix for DTensor specs of dynamic (symbolic) sizes
        hf.compile_layers(decoder_layers(model), "none" if eager_checkpoint else mode)
    if eager_checkpoint:  # around the compiled forward where there is one
        hf.checkpoint_layers(decoder_layers(model), mode)
    attach(model)
    return model


class _RootUnit:
    """A VLM's FSDP2 units under nemo-automodel's MoE parallelizer: the decoder layers (their experts over ep) and
    the lm_head units of their own, and, as in `hf.shard`, the vision tower (trained or frozen), the input
    embeddings and the language model's own parameters in the root unit.

    Its `apply_fsdp` would also make the trained tower, the input embeddings and the language model units of their
    own, and nemo-automodel's VLM forward runs them in an order that depends on the micro-batch (with an image it
    embeds the tokens before entering the language model, without one the language model embeds them): ranks whose
    micro-batches differ would all-gather different units at the same step (a gloo size mismatch on CPU). This is
    the `ModelParallelizer` hook `apply_fsdp` shards every unit through (`_fully_shard_module`); it leaves those
    modules to the root."""

    def __init__(self, kept: list[torch.nn.Module]):
        self.kept = {id(m) for m in kept}

    @classmethod
    def of(cls, model) -> _RootUnit | None:
        """None for a text model (nemo-automodel's own wrapping stands)."""
        from nemo_automodel.components.distributed.multimodal_fsdp import iter_multimodal_modules

        language = getattr(model.model, "language_model", None)
        if language is None:
            return None
        towers = [module for _, module in iter_multimodal_modules(model)]
        return cls([language, language.embed_tokens, *towers])

    def _fully_shard_module(self, module: torch.nn.Module, **kwargs):
        from torch.distributed.fsdp import fully_shard

        return module if id(module) in self.kept else fully_shard(module, **kwargs)


def _on_ep(p: torch.Tensor) -> bool:
    mesh = getattr(p, "device_mesh", None)
    return mesh is not None and "ep" in (mesh.mesh_dim_names or ())
