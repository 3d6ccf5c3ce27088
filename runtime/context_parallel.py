"""Context parallelism in the trainer: nemo-automodel's sharder splits each micro-batch's sequence over the cp ranks.

The mesh is nemo-automodel's (`MeshContext` with `ParallelismSizes(cp_size=...)`, runtime/models/automodel.py): its
axes are (pp, dp_replicate, dp_shard, cp, tp), cp inside dp, so the cp ranks of one data-parallel rank are
consecutive (`dp_rank`) and they take the same rows of every batch. FSDP2 shards the parameters over every rank
(its `dp_shard_cp`), so gradients are averaged over dp x cp ranks. With tensor parallelism (tp innermost) a
data-parallel rank's cp x tp ranks are the consecutive ones: each cp rank's cut is shared by its tp ranks, each cp
group is the ranks of one tp coordinate, and FSDP2 (nemo-automodel's dense parallelizer) shards over dp x cp only.

Per micro-batch (`sharded_rows`), inside the block that runs its forward *and* backward:
- nemo-automodel's `ContextParallelSharder` (its generic strategy, `shard_batch_load_balanced`) pads the rows to a
  multiple of 2 x cp and gives each cp rank two of the 2 x cp chunks (the head-tail pairing that evens out causal
  attention work) of the token ids, the next-token labels, the position ids (kept global: a token keeps its row
  position) and the padding mask (True on pads);
- torch's `context_parallel` context it enters turns `scaled_dot_product_attention` into ring attention over the
  cp group (causal only, no explicit mask: right padding sits after every real token, and the MoE routers take the
  sharded padding mask). It has no CPU path (the CPU SDPA op has no sharding strategy): CP runs on CUDA only.

The log-probs (entropy, score-centering top-k log-probs, router logits) of the local positions are then put back in
row order by the sharder's differentiable all-gather (`CpRows.gather`), so every cp rank of a data-parallel rank
holds the same whole rows and everything after the forward (IS correction, sequence-level GSPO ratios, the
aggregation modes, the MoE aux losses) is the code of a run without CP. The loss is the global token mean over the
data-parallel ranks, scaled by dp (not by the world): each cp rank computes the same loss, the all-gather's
backward sums their cp gradients into each rank's own positions, and FSDP2's average over dp x cp leaves exactly the
gradient of the single-rank loss (tests/runtime/test_context_parallel.py checks this on gloo ranks). Token counts
are summed once per data-parallel rank (`FsdpRank.window_tokens` divides the world's sum by cp x tp). What goes *into*
the forward per position is cut like the tokens (`CpRows.shard`): the score-centering top-k ids, and the experts
MoE routing replay imposes (the sharder's pad slots as not recorded, so they keep the live choice).

With te attention the rows and the cut are the same (nemo-automodel gives a te model's unpacked rows this sharder):
transformer_engine's own CP takes the 2 x cp head-tail chunks, causal and without a padding mask, once its
`apply_cp` has put each attention in the cp group (`prepare`). Without te, `prepare` sets up the rest of what
`apply_cp` sets (a hybrid's Mamba and gated-delta-net layers' own CP, the MoE layers' cp mesh). Packed rows go to
a model that owns their CP: GLM-5.2's packed THD row with tilelang attention, cut by its own sharder and its layers'
K/V all-gather (`sharded_rows` packed, runtime/packed_cp.py); the capability table refuses the others.

A VLM (nemo-automodel's Qwen3.5/3.6-MoE) takes its images as nemo-automodel's VLM forward does under CP: spliced
into the whole rows' embeddings, then cut like the tokens (`runtime/logprobs.py` `_vlm_shard_hidden`); its
Nemotron-Omni does both inside its own forward (the whole rows in, its `cp_mesh`, which `prepare` sets, cutting the
spliced embeddings with nemo-automodel's in-forward sharder: the same head-tail chunks). Other VLMs are refused (the
capability table, and `prepare` for a checkpoint the compiler did not know).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from runtime.logprobs import splices_in_forward, uses_te
from runtime.packed_cp import PackedCpRows, packed_rows

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def dp_rank(rank: int, cp_mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None = None) -> int:
    """The data-parallel rank of global `rank`: in nemo-automodel's mesh (.., dp, cp, tp) tp is the innermost axis
    and cp the one inside dp, so the cp x tp ranks of one data-parallel rank are consecutive, rank = (dp_rank x cp +
    cp_rank) x tp + tp_rank (checked against the mesh)."""
    tp = 1 if tp_mesh is None else tp_mesh.size()
    cp = 1 if cp_mesh is None else cp_mesh.size()
    if tp_mesh is not None and tp_mesh.get_local_rank() != rank % tp:
        raise RuntimeError(f"rank {rank} is tp rank {tp_mesh.get_local_rank()} of nemo-automodel's mesh, not "
                           f"{rank % tp}: its tp axis is no longer the innermost")
    if cp_mesh is not None and cp_mesh.get_local_rank() != (rank // tp) % cp:
        raise RuntimeError(f"rank {rank} is cp rank {cp_mesh.get_local_rank()} of nemo-automodel's mesh, not "
                           f"{(rank // tp) % cp}: its cp axis is no longer the one between dp and tp")
    return rank // (cp * tp)


def prepare(model: torch.nn.Module, cp_mesh: DeviceMesh | None) -> None:
    """What nemo-automodel's own CP setup does to a sharded model: FSDP2 units a cp rank did not run still join the
    reduce-scatter with zeros (its parallelizers' setting at cp > 1), and transformers-style attention layers drop
    the attention mask for a causal SDPA call (`attach_context_parallel_hooks`: ring attention takes no mask).
    With te attention, its MoE parallelizer's `apply_cp` (`_te_context_parallel`)."""
    if cp_mesh is None:
        return
    vlm = getattr(model.config, "vision_config", None) is not None
    # the compiler knows the catalog's VLMs only
    if vlm and not hasattr(model, "_embed_and_splice_for_cp") and not splices_in_forward(model):
        raise RuntimeError(f"actor.mesh.cp > 1 on {type(model).__name__}: this trainer's CP of a vision-language "
                           "model is nemo-automodel's splice before the cut of its Qwen3.5/3.6-MoE VLMs "
                           "(`_embed_and_splice_for_cp`) or inside its Nemotron-Omni's forward, which this model "
                           "has neither of; set actor.mesh.cp: 1")
    from nemo_automodel.components.distributed.context_parallel.utils import attach_context_parallel_hooks
    from nemo_automodel.components.distributed.parallelizer_utils import configure_fsdp_unused_param_reduction

    configure_fsdp_unused_param_reduction(model)
    if hasattr(model, "get_decoder"):  # nemo-automodel's MoE layers get no mask under CP (runtime/logprobs.py)
        attach_context_parallel_hooks(model)
    if uses_te(model):
        _te_context_parallel(model, cp_mesh)
    else:
        _layers_context_parallel(model, cp_mesh)
    # at cp 1 its layers take their path without CP; above, stop at the build, not inside the first forward
    gdn = any(getattr(m, "_cp_mesh", None) is cp_mesh for m in model.modules())
    if gdn and cp_mesh.size() > 1 and importlib.util.find_spec("fla") is None:
        raise RuntimeError("actor.mesh.cp > 1 on a gated-delta-net model: nemo-automodel's CP of its linear attention "
                           "is flash-linear-attention's (the `fla` package), which does not import here; install it "
                           "(pip install flash-linear-attention) or set actor.mesh.cp: 1")


def _te_context_parallel(model: torch.nn.Module, cp_mesh: DeviceMesh) -> None:
    """te attention under CP, as nemo-automodel sets up its own models for it (its MoE parallelizer's `apply_cp`):
    each transformer_engine `DotProductAttention` joins the cp group (`set_context_parallel_group`: its ring over
    the cp ranks, p2p, all-gather for sliding windows), and a hybrid's other layers get their own CP (Mamba mixers
    `MambaContextParallel`, gated-delta-net layers the cp mesh), the MoE layers the cp mesh. The rows stay the
    sharder's: te's CP on BSHD rows takes the same 2 x cp head-tail chunks as torch's ring attention (nemo-automodel's
    dispatch gives a te model's unpacked rows this same sharder), causal, with no padding mask (which te refuses
    under CP; right padding sits after every real token). It imports transformer_engine, which a te plan has (the
    job's package check)."""
    from nemo_automodel.components.moe.parallelizer import apply_cp

    apply_cp(model, cp_mesh)


def _layers_context_parallel(model: torch.nn.Module, cp_mesh: DeviceMesh) -> None:
    """nemo-automodel's `apply_cp` but for the te attention (which it imports first, so it cannot run without
    transformer_engine): the attention is torch's ring here, and everything else is set as it sets it. The model and
    its text module are marked CP (`_cp_enabled`: Qwen3.5/3.6-MoE's then drops the masks its layers cannot take and
    cuts no packed GDN metadata), the model gets the cp mesh (`cp_mesh`: a VLM's vision tower then runs outside the
    ring attention; Nemotron-Omni's forward cuts its spliced rows by it), and per decoder layer: a Mamba mixer its `MambaContextParallel`, a gated-delta-net layer the cp
    mesh (its FLA context parallelism), an MoE layer the cp mesh (its router's statistics over the cp ranks)."""
    from nemo_automodel.components.distributed.context_parallel.mamba import MambaContextParallel
    from nemo_automodel.components.distributed.pipelining.hf_utils import get_text_module
    from nemo_automodel.components.moe.layers import MoE
    from nemo_automodel.shared.model_utils import iter_transformer_and_mtp_blocks

    inner = model.model if getattr(model, "model", None) is not None else model
    model._cp_enabled = True  # type: ignore[assignment]
    get_text_module(inner)._cp_enabled = True
    model.cp_mesh = cp_mesh  # type: ignore[assignment]
    for _, _, block in iter_transformer_and_mtp_blocks(model):
        layer_type = getattr(block, "layer_type", getattr(block, "attention_type", "full_attention"))
        if layer_type == "mamba":
            mixer = block.self_attn
            mixer.cp = MambaContextParallel(cp_group=cp_mesh.get_group(), num_heads=mixer.num_heads,
                                            head_dim=mixer.head_dim, n_groups=mixer.n_groups,
                                            d_state=mixer.ssm_state_size, mixer=mixer)
        elif layer_type == "linear_attention":
            if not hasattr(getattr(block, "linear_attn", None), "_cp_mesh"):
                raise RuntimeError(f"layer {getattr(block, 'layer_idx', '?')} is linear attention without "
                                   "nemo-automodel's CP-aware module: its CP would be wrong; set actor.mesh.cp: 1")
            block.linear_attn._cp_mesh = cp_mesh
        experts = block.moe if hasattr(block, "moe") else getattr(block, "mlp", None)
        if isinstance(experts, MoE):
            experts.cp_mesh = cp_mesh


@dataclass
class CpRows:
    """One micro-batch's padded rows as this cp rank holds them inside `sharded_rows`: (b, n) tensors, n = the
    padded width / cp (valid inside the block only: torch's context_parallel restores the position ids in place
    when it ends)."""

    input_ids: Tensor
    position_ids: Tensor
    """Each token's position in its row (global, not local)."""
    labels: Tensor
    """The next token of each local position (0 past a row's end and on the sharder's pad slots)."""
    padding_mask: Tensor
    """True on padding (the row's own and the sharder's): what nemo-automodel's routers skip."""
    sharder: Any
    """nemo-automodel's `ContextParallelSharder` that cut them (its token verbs)."""

    def shard(self, full: Tensor, fill: float | int = 0, seq_dim: int = 1) -> Tensor:
        """A (b, w, ...) per-token tensor of the rows cut like the inputs: (b, n, ...) (`seq_dim` 2: M-RoPE's
        (3, b, w) positions)."""
        return self.sharder.shard_token_tensor(full, seq_dim=seq_dim, fill=fill)

    def gather(self, local: Tensor) -> Tensor:
        """(b, n, ...) values of the local positions -> (b, w, ...) in row order on every cp rank; differentiable
        (its backward sums the cp ranks' gradients into each rank's own positions)."""
        return self.sharder.gather_token_tensor(local, seq_dim=1, trim=True)

    def replay_targets(self, routed: Tensor, attention_mask: Tensor) -> Tensor:
        """The rollout's (b, w, layers, k) routing -> the local positions' (b x n, layers, k), in the order the
        routers see them; the sharder's pad slots as not recorded (-1: they keep the live choice)."""
        from runtime import moe

        return moe.flat_targets(self.shard(routed, fill=-1), attention_mask, packed=False)

    def gather_router_logits(self, logits: list[Tensor]) -> list[Tensor]:
        """Each router's (b x n, experts) logits of the local positions -> (b x w, experts) in row order, so the aux
        losses see the rows' whole sequences, as without CP."""
        b, n = self.input_ids.shape
        return [self.gather(layer.reshape(b, n, -1)).reshape(-1, layer.shape[-1]) for layer in logits]


@contextlib.contextmanager
def sharded_rows(cp_mesh: DeviceMesh, sequences: Tensor, attention_mask: Tensor, model=None,
                 packed: bool = False) -> Iterator[CpRows | PackedCpRows]:
    """Within the block, this cp rank's share of right-padded (b, w) rows, and torch's ring attention over the cp
    group in place of `scaled_dot_product_attention` (run the forward and the backward inside). `packed`: the rows
    as one packed THD row cut by `model`'s own CP (runtime/packed_cp.py: GLM-5.2's tilelang attention; the
    capability table takes packed rows under CP with it only), no ring attention."""
    from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder

    if packed:
        yield packed_rows(cp_mesh, model, sequences, attention_mask)
        return

    labels = torch.zeros_like(sequences)
    labels[:, :-1] = sequences[:, 1:]
    b, w = sequences.shape
    # copies: torch's context_parallel cuts its buffers in place
    batch = {"input_ids": sequences.clone(), "labels": labels,
             "position_ids": torch.arange(w, device=sequences.device).expand(b, w).contiguous(),
             "padding_mask": ~attention_mask.bool()}
    sharder = ContextParallelSharder(None, cp_mesh, batch)  # no model: nemo-automodel's generic (torch) strategy
    context, batch = sharder.shard(batch)
    with context():
        # its pad slots carry label -100 (its loss's ignore index); they are trimmed by `gather`
        yield CpRows(batch["input_ids"], batch["position_ids"], batch["labels"].clamp(min=0), batch["padding_mask"],
                     sharder)
