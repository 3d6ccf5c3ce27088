"""The `hf` model backend (`runtime/models/__init__.py`): transformers' `AutoModelForCausalLM` under FSDP2 over a
1-D data-parallel mesh.

fp32 master weights, activation checkpointing, `fully_shard` per decoder layer and then the root, compute dtype from
the plan (`reference/environment.md` §5), and the chunked log-prob method of `runtime/logprobs.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runtime import moe, packed_attention
from runtime.logprobs import attach
from runtime.models.base import Meshes

if TYPE_CHECKING:
    from schemas.plan import LoraPlan, MeshPlan, ModelPlan


def dp_meshes(device: str, world: int, replicate: int = 1) -> Meshes:
    """One `dp` axis over every rank (the process group must be initialised); with `replicate` > 1 HSDP's 2-D
    (dp_replicate, dp_shard) mesh instead: FSDP2 shards over dp_shard and all-reduces the gradients across the
    replicas. Every rank is a data-parallel rank either way."""
    import torch.distributed as dist

    shape, names = ((world,), ("dp",)) if replicate == 1 else ((replicate, world // replicate),
                                                                ("dp_replicate", "dp_shard"))
    return Meshes(fsdp=dist.device_mesh.init_device_mesh(device, shape, mesh_dim_names=names), moe=None)


def device_mesh(device: str, world: int, mesh: MeshPlan | None) -> Meshes:
    """FSDP2 data parallelism over every rank, HSDP at the plan's `dp_replicate`: the capability table keeps
    tp/cp/ep at 1 on this backend."""
    return dp_meshes(device, world, 1 if mesh is None else mesh.dp_replicate)


def hf_weights(model) -> list:
    """The floating parameters under their own (transformers') names, in module order; under LoRA the merged base
    weights W + scale·B@A under their HF names, without the adapters (`runtime/lora.py`)."""
    if getattr(model, "molt_lora", None) is not None:
        from runtime import lora

        return lora.merged_weights(model)
    return [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own names and layouts already."""
    return state


def is_vlm(path: str) -> bool:
    """The checkpoint is a vision-language model (its config has a `vision_config`): a fact of the model."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


# Selective (per-op) checkpointing keeps what is expensive to recompute and cheap to keep: the outputs of the
# matmuls (projections, MLP) and of the fused attention kernels. Norms, rotary, activations, residual adds and
# casts are recomputed in the backward: memory-bound work, a fraction of a layer's time (torchtitan's "op" SAC).
_SAVED_OPS = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")}


def _keep_expensive(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpoint_kwargs(mode: str) -> dict:
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_expensive)
    return kwargs


def enable_checkpointing(model, mode: str, layers=None) -> None:
    """Activation checkpointing of every decoder layer (non-reentrant): `full` keeps each layer's input and
    recomputes the whole layer in the backward; `selective` also keeps its matmul and attention outputs and
    recomputes only the cheap ops (Molt's per-op mode). transformers' switch for transformers' own models (it also
    covers a VLM's vision blocks), `checkpoint_layers` on `layers` for other implementations (nemo-automodel's)."""
    if type(model).__module__.startswith("transformers.") and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=_checkpoint_kwargs(mode))
        return
    checkpoint_layers(layers, mode)


def checkpoint_layers(layers, mode: str) -> None:
    """Each of `layers`' forwards run under `torch.utils.checkpoint` (what transformers' switch does, module and
    parameter names unchanged), inside the FSDP2 hooks of the layer once it is sharded (torchtitan's order): the
    checkpoint keeps the inputs FSDP2 cast to the compute dtype, and its recompute gets the same ones.
    transformers' switch checkpoints the whole module call instead, hooks included, and torch 2.11's FSDP2 does not
    cast a layer's inputs again when that recompute calls it (torch 2.13 does): nemo-automodel's models hand their
    layers fp32 rotary coefficients, so its recompute got fp32 where the forward had bf16 and failed the checkpoint's
    metadata check (CheckpointError, H100, tests/gpu/bench_trainer.py `uniform/padded-automodel`, 2026-12-05).
    transformers' own models hand their layers cos/sin already in the hidden states' dtype."""
    import functools

    from torch.utils.checkpoint import checkpoint

    kwargs = _checkpoint_kwargs(mode)
    for layer in layers:
        layer.forward = functools.partial(checkpoint, layer.forward, **kwargs)


def compile_layers(layers, checkpoint_mode: str = "none") -> None:
    """Each decoder layer's forward under `torch.compile`, FSDP2's hooks staying eager around it. The layers share
    one compiled graph (the models call them with `use_cache=False`, so no per-layer cache state is guarded on),
    compiled once for every batch shape (`_batch_shape_dynamic`). Measured on an H200 (tests/gpu/bench_trainer.py,
    Qwen3-1.7B shape, 4 x 4096 tokens, full checkpointing): first step 10.0 s, a step at a new shape 0.39 s, where
    torch's automatic dynamic shapes alone recompiled for 9.4 s at the first new shape (17 s for the 1.4B model of
    the RL loop); the steady step is the same (0.505 s against 0.499 s). `dynamic=True` (every dimension of every
    input generic) compiled for 48 s and ran 10-30 % slower in the RL loop.

    With activation checkpointing the checkpoint goes inside the compiled function (torchtitan's order): dynamo
    traces `torch.utils.checkpoint` as one region and the recomputation is part of the compiled backward, and a
    selective policy sees the traced aten ops. The other order (a compiled forward re-entered by an eager
    checkpoint's recompute) can recompile during the backward and then fails the checkpoint's saved-tensor check
    (pytorch issue 166926, reproduced on CPU, before the graphs were shape-generic); callers then leave the model's
    own checkpointing off. Under tensor parallelism full checkpointing takes that other order (torch 2.13 fails the
    traced one there: `automodel.tensor_parallel`), and its recompute runs the compiled graph again.

    A layer with an MoE block (`moe.blocks`: its router and experts, nemo-automodel's token dispatcher under expert
    parallelism) runs that block eager between its compiled parts (attention, norms, residuals). Compiled, the block
    fails or falls apart: the expert count per token is data-dependent (boolean masks, `nonzero`, `bincount`: a graph
    break each), torch's fake `_grouped_mm` takes bf16 only (fp32 fails to trace), nemo-automodel's dispatcher
    exchanges token counts with `.item()` and gathers through c10d calls (traced at ep 2, the experts' step resumed
    after the break got its gathered token mask as int64 and failed), and routing replay (R3, `moe.replay`) swaps
    the routers' top-k from Python state (`.known` counts, per-layer `_GateReplay`s) that a graph would guard on.
    Eager, the block is the code the uncompiled model runs, replay included. The graph break at the block (and
    nemo-automodel's MoE models' attention's own, its padding check `key_mask.all().item()`, in their dense layers
    too) starts resumed graphs whose inputs `_batch_shape_dynamic` cannot mark, so an MoE model's layers compile
    with every size generic (`generic`: nemo-automodel's Qwen3-MoE layer, 6 graphs per grad mode for every shape,
    where automatic dynamic shapes recompiled them at each new length and row count). A checkpoint cannot hold a
    graph break (dynamo then ran the whole checkpointed layer eager, silently), so their checkpoint goes around the
    compiled forward: the resumed graphs being generic, the recompute does not recompile (issue 166926's trigger).
    Checked against eager at ep 2 under replay (tests/runtime/models/test_expert_parallel.py) and at ep 1
    (test_automodel.py)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    layers = list(layers)
    breaks = any(moe.blocks(layer) for layer in layers)  # an MoE model: every layer graph-breaks
    for layer in layers:
        for block in moe.blocks(layer):
            block.forward = torch.compiler.disable(block.forward)
        forward = layer.forward
        if checkpoint_mode != "none" and not breaks:
            forward = functools.partial(checkpoint, forward, **_checkpoint_kwargs(checkpoint_mode))
        forward = _batch_shape_dynamic(torch.compile(forward, options=_ONE_GRAPH_FOR_EVERY_SHAPE), generic=breaks)
        if checkpoint_mode != "none" and breaks:
            forward = functools.partial(checkpoint, forward, **_checkpoint_kwargs(checkpoint_mode))
        layer.forward = forward


_ONE_GRAPH_FOR_EVERY_SHAPE = {"triton.mix_order_reduction": False}
"""Inductor options of the compiled layers. Inductor's mixed-order reduction fusion (the backward's norm-weight
gradients) decides by the token count (rows x width >= 2560 for a 2048-wide model), and a symbolic token count turns
that decision into a guard: a micro-batch on the other side of it recompiled the layers (about 11 s on an H200,
mid-run). Off, the graph is the same for every shape; the steady step was the same (Qwen3-1.7B shape, 28 layers,
16 rows x 64..424 positions: 0.069-0.180 s against 0.067-0.179 s with the fusion, tests/gpu/bench_loop.py's
measurements of issue 29). The other shape guard (the SDPA mask's 8-alignment) is met by padding every width to
the plan's `width_multiple`."""


_PACKED_ROW_SOURCES = ",".join(f"L['kwargs']['{k}']" for k in packed_attention.PACKED_ROW_KWARGS)
"""A packed row's varlen offsets (`packed_attention.packed_row_kwargs`), generic from the first compile: their
document count and longest document change from one micro-batch to the next, and each compiled once more under
torch's automatic dynamic shapes (the first new value of the int `max_length_q`, then of the offsets' length): an
8.7 s step in the middle of the H200 run of the packed GPU demo (tests/gpu/bench_loop.py, 2026-12-05), at the first
micro-batch without a row at full length. `maybe_mark_dynamic` cannot mark an int; dynamo's `dynamic_sources` can."""


class _Waited(torch.autograd.Function):
    """An `AsyncCollectiveTensor` (tensor parallelism's vocabulary-parallel embedding hands the first decoder layer its
    all-reduced output as one) as the plain tensor it wraps, waited on, its gradient passed through: compiled, the
    wrapper would be guarded on as a type of its own (a second graph, recompiled at every new shape), and its
    `trigger_wait` alone drops the autograd edge."""

    @staticmethod
    def forward(ctx, x):
        return x.trigger_wait()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _batch_shape_dynamic(compiled, generic: bool = False):
    """`compiled` with its inputs' batch and sequence dimensions marked dynamic before each call, so the first
    compile is the shape-generic graph: a later batch of another length or row count runs it without the recompile
    torch's automatic dynamic shapes would do at the first new shape (17 s on an H200 for a 1.4B model, in the
    middle of a run). A dimension is the batch's or the sequence's when its size is the hidden states' (rows,
    tokens) and it is not a 3-D tensor's trailing feature dimension (hidden size, rotary width); torch may still
    specialize one it cannot keep generic (`maybe_mark_dynamic`): it does at one row (a one-row micro-batch compiles
    a second graph once, 7 s on an H200). Unbacked row counts, which torch does not specialize, compiled on CPUs but
    broke the graph on the H200 (the layers then ran eager: 0.91x of the eager model).

    `generic`: every size of every input and of the graphs resumed after a graph break generic from the first
    compile (dynamo's `assume_static_by_default` off while the layer runs; parameters keep their static shapes);
    `compile_layers` says which layers."""
    import functools

    from torch._dynamo import maybe_mark_dynamic
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def mark(t: object, sizes: tuple[int, ...]) -> None:
        if isinstance(t, (tuple, list)):
            for x in t:
                mark(x, sizes)
        elif isinstance(t, torch.Tensor):
            for dim, n in enumerate(t.shape):
                if n in sizes and n > 1 and not (t.dim() == 3 and dim == 2):
                    maybe_mark_dynamic(t, dim)

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        if args and isinstance(args[0], AsyncCollectiveTensor):
            args = (_Waited.apply(args[0]), *args[1:])
        # the hidden states: the first input, positional (transformers' layers) or keyword (nemo-automodel's `x`)
        hidden = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        mark((args, tuple(kwargs.values())), tuple(hidden.shape[:2]))
        with (torch.compiler.config.patch(dynamic_sources=_PACKED_ROW_SOURCES),
              torch._dynamo.config.patch(assume_static_by_default=not generic)):
            return compiled(*args, **kwargs)

    return run


def build(model_plan: ModelPlan, path: str, meshes: Meshes, device: torch.device, trainable: bool = True,
          freeze_router: bool = False, lora: LoraPlan | None = None, freeze_visual_encoder: bool = False,
          offload: str = "none", sequence_parallel: bool = False):
    """`path`'s HF causal LM with `model_plan`'s attention, dtype and checkpointing, FSDP2-sharded over the `dp`
    mesh of `meshes`.

    A VLM loads as an image-text-to-text model; its language-model layers are the FSDP units and the vision tower
    stays in the root unit (all-gathered on every forward, so a rank whose micro-batch has no image runs the same
    collectives). `freeze_visual_encoder` (Molt's: train only the language model and lm_head) stops the tower's
    gradients. The rest is `shard`'s. `sequence_parallel` is tensor parallelism's, which this backend has not
    (the compiler sends tp > 1 to the automodel backend, PAR004).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    # Master weights in fp32; FSDP2 casts to the compute dtype on all-gather.
    vlm = is_vlm(path)
    auto = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    from runtime.packed_attention import implementation

    model = auto.from_pretrained(path, dtype=torch.float32,
                                 attn_implementation=implementation(model_plan.attn, torch.device(device)))
    model.to(device)
    if vlm and freeze_visual_encoder:
        model.model.visual.requires_grad_(False)
    layers = model.model.language_model.layers if vlm else model.model.layers
    return shard(model, layers, model_plan, meshes.fsdp, trainable, freeze_router, lora, offload)


def shard(model, layers, model_plan: ModelPlan, mesh, trainable: bool, freeze_router: bool,
          lora: LoraPlan | None, offload: str = "none"):
    """An unsharded fp32 causal LM (on its device) -> the trained or reference model, FSDP2-sharded over `mesh`.

    A frozen model (a reference) is in eval mode without gradients and never checkpoints. MoE routers are their own
    FSDP2 unit computing in `model_plan.router_dtype` (fp32 by default, Molt's `MOLT_GATE_PRECISION`: the unit casts
    its input to that dtype, so top-k ties are decided in fp32), and with `freeze_router` they take no gradient.
    `lora`: peft adapters patched in before sharding (`runtime/lora.py`); only they train. `layers` (the decoder
    layers) are the FSDP units between the routers and the root. `offload: full` keeps every unit's shards on the
    host (`runtime/fsdp.py`; a reference is never offloaded).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from runtime.fsdp import offload_policy

    if lora is not None:
        from runtime import lora as lora_adapters

        lora_adapters.apply(model, lora)
    checkpointed = trainable and model_plan.gradient_checkpoint != "none"
    if checkpointed and not model_plan.compile_layers:  # compiled layers checkpoint inside the compiled forward
        enable_checkpointing(model, model_plan.gradient_checkpoint, layers)
    if checkpointed and lora is not None:
        inputs_require_grads(model)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if freeze_router:
        moe.freeze_routers(model)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, model_plan.dtype), reduce_dtype=torch.float32)
    router_mp = MixedPrecisionPolicy(param_dtype=getattr(torch, model_plan.router_dtype), reduce_dtype=torch.float32)
    policy = offload_policy(offload if trainable else "none", next(model.parameters()).device)
    for router in moe.routers(model):
        fully_shard(router, mesh=mesh, mp_policy=router_mp, offload_policy=policy)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
    if model_plan.compile_layers:
        compile_layers(layers, model_plan.gradient_checkpoint if trainable else "none")
    attach(model)  # chunked lm_head log-probs as an FSDP forward method
    return model


def inputs_require_grads(model) -> None:
    """Frozen embeddings under LoRA: checkpointed blocks still need a grad path into them. transformers' switch, or
    (nemo-automodel's own implementations have none) the same hook on the input embeddings."""
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
        return
    model.model.embed_tokens.register_forward_hook(lambda module, args, output: output.requires_grad_(True))


def build_value_model(model_plan: ModelPlan, path: str, meshes: Meshes, device: torch.device, offload: str = "none"):
    """The critic: `path`'s architecture with its vocabulary head replaced by a scalar head (transformers'
    `...ForTokenClassification` with one label: `score = Linear(hidden, 1)`, initialised with the model's
    `initializer_range`), no dropout on the head, sharded like the policy (`reference/molt_rules.md` §6.4),
    offloaded like it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from runtime.fsdp import offload_policy

    model = load_value_model(path, model_plan.attn)
    model.to(device)
    if model_plan.gradient_checkpoint != "none" and not model_plan.compile_layers:
        enable_checkpointing(model, model_plan.gradient_checkpoint)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, model_plan.dtype), reduce_dtype=torch.float32)
    policy = offload_policy(offload, device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=meshes.fsdp, mp_policy=mp, offload_policy=policy)
    fully_shard(model, mesh=meshes.fsdp, mp_policy=mp, offload_policy=policy)
    if model_plan.compile_layers:
        compile_layers(model.model.layers, model_plan.gradient_checkpoint)
    return model


def load_value_model(path: str, attn: str):
    """`path`'s architecture as an unsharded fp32 one-label token classifier, without dropout before the head."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32,
                                                           attn_implementation=attn)
