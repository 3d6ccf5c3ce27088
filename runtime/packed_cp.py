"""Context parallelism of a packed THD row: nemo-automodel's own, for the models that own their CP (GLM-5.2's DSA).

nemo-automodel's GLM-5.2 (`glm_moe_dsa`, `BackendConfig.attn: tilelang`) takes packed rows as THD only
(runtime/packed_thd.py) and owns its CP: its `prepare_model_inputs_for_cp` hook hands nemo-automodel's
`ContextParallelSharder` its packed-THD strategy (`shard_glm_dsa_packed_cp_batch`), which flattens the row into one
THD stream and gives cp rank r the contiguous r-th slice of its queries, with the whole stream's `cu_seqlens` and each
local query's place in it (`glm_dsa_cp_query_indices`); its DSA layers then all-gather their keys and latent values
over the cp group (`glm_dsa_cp_all_gather`, differentiable) and run the indexer and sparse MLA of the local queries
against the whole stream. No torch `context_parallel` context is entered (its strategy's context is a no-op).

The row fed to it is `runtime.logprobs.pack`'s (1, N) packed row with next-token labels, padded to a multiple of cp
as nemo-automodel's packed datasets pad it: the pad slots extend the last document's padded length
(`seq_lens_padded`), so its THD conversion (`process_input_for_thd`) marks them padding (what its routers skip) and
they sit after every real token (causal: no real token sees them). The values of the local positions (log-probs,
entropy, top-k log-probs, router logits) come back in the packed row's order on every cp rank by the sharder's
differentiable all-gather (`gather`), and what goes in per position (score-centering top-k ids, replayed experts)
is cut like the tokens (`shard`), as `runtime/context_parallel.py` does for padded rows; the loss and gradient math
around it is that module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from runtime import moe, packed_thd

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class PackedCpRows:
    """One micro-batch's rows packed into one THD stream, as this cp rank holds it: n = the padded stream / cp of
    its tokens."""

    inputs: dict[str, Any]
    """The backbone's keywords for the local queries (nemo-automodel's sharded THD batch): `input_ids`,
    `position_ids` and `padding_mask` (n,), the whole stream's `cu_seqlens`, `glm_dsa_cp_query_indices`, the cp
    group."""
    labels: Tensor
    """(n,) the next token of each local position in the packed row (0 past its end)."""
    tokens: int
    """N: the packed row's real tokens (its padded stream is N rounded up to a multiple of cp)."""
    sharder: Any
    """nemo-automodel's `ContextParallelSharder` that cut them (its token verbs)."""

    @property
    def input_ids(self) -> Tensor:
        return self.inputs["input_ids"]

    def shard(self, full: Tensor, fill: float | int = 0) -> Tensor:
        """(m, ...) per-position values in the packed row's order, m <= the padded stream (the rest: `fill`) ->
        this rank's (n, ...)."""
        padded_len = self.sharder.shard_layout.padded_seq_len
        pad = torch.full((padded_len - full.shape[0], *full.shape[1:]), fill, dtype=full.dtype, device=full.device)
        return self.sharder.shard_token_tensor(torch.cat([full, pad])[None], seq_dim=1)

    def gather(self, local: Tensor) -> Tensor:
        """(n, ...) values of the local positions -> (N, ...) in the packed row's order on every cp rank;
        differentiable (its backward sums the cp ranks' gradients into each rank's own positions)."""
        return self.sharder.gather_token_tensor(local, seq_dim=0, trim=True)[0, :self.tokens]

    def decoder_hidden(self, model) -> Tensor:
        """(n, hidden) decoder output of the local queries: nemo-automodel's backbone on its sharded THD batch (its
        layers gather the keys and values of the whole stream), handed over as its causal LM's forward hands it
        (`packed_thd.backbone_inputs`: `max_seqlen` a number)."""
        return packed_thd.hidden_states(model.model(**packed_thd.backbone_inputs(self.inputs)))

    def replay_targets(self, routed: Tensor, attention_mask: Tensor) -> Tensor:
        """The rollout's (b, w, layers, k) routing of the rows -> the local positions' (n, layers, k), in the order
        the routers see them; the pad slots as not recorded (-1: they keep the live choice)."""
        return self.shard(moe.flat_targets(routed, attention_mask, packed=True), fill=-1)

    def gather_router_logits(self, logits: list[Tensor]) -> list[Tensor]:
        """Each router's (n, experts) logits -> (N, experts) of the packed row's tokens, as without CP."""
        return [self.gather(layer) for layer in logits]


def packed_rows(cp_mesh: DeviceMesh, model, sequences: Tensor, attention_mask: Tensor) -> PackedCpRows:
    """This cp rank's share of right-padded (b, w) rows packed into one THD stream, cut by `model`'s own CP
    (nemo-automodel's `ContextParallelSharder` resolves its `prepare_model_inputs_for_cp` strategy)."""
    from nemo_automodel.components.distributed.context_parallel import ContextParallelSharder

    from runtime.logprobs import pack

    flat, positions = pack(sequences, attention_mask.sum(-1))
    tokens = flat.shape[1]
    pad = (-tokens) % cp_mesh.size()
    labels = torch.nn.functional.pad(flat[:, 1:], (0, 1 + pad))
    lengths = packed_thd.document_lengths(positions)
    padded_lengths = lengths.clone()
    padded_lengths[-1] += pad
    # the pad slots go on counting the last document's positions
    tail = positions[:, -1:] + torch.arange(1, pad + 1, device=flat.device)
    batch = {"input_ids": torch.nn.functional.pad(flat, (0, pad)), "labels": labels,
             "position_ids": torch.cat([positions, tail], dim=1), "seq_lens": lengths[None],
             "seq_lens_padded": padded_lengths[None]}
    sharder = ContextParallelSharder(model, cp_mesh, batch)  # the model's own strategy (its hook)
    _, local = sharder.shard(batch)
    return PackedCpRows(local, local.pop("labels"), tokens, sharder)
