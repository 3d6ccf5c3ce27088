"""The capability table's attention rows of the automodel backend (`schemas/capabilities.py` lists them).

The plan's `model.attn` goes to nemo-automodel's own layers as `BackendConfig.attn` (runtime/models/automodel.py
`backend_config`): sdpa runs everywhere; te is transformer_engine's DotProductAttention, written and not run (the
package is on none of our machines); tilelang is nemo-automodel's GLM-5.2 (`glm_moe_dsa`) DSA kernels (its TileLang
lighting indexer and sparse MLA), which take packed THD rows only (runtime/packed_thd.py hands them so; under CP
GLM-5.2's own sharder cuts them, runtime/packed_cp.py), written and not run on CUDA (tilelang is on none of our
machines), with no CPU path. The job's package check
(runtime/packages.py) stops a te or tilelang plan at start without its package. Which models have the tilelang
kernels and in which dtype they run are the compiler's rules (PACK005, PACK006).
Importable without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.capabilities import Capability
    from schemas.plan import Plan

AUTOMODEL_ATTN = ("sdpa", "te", "tilelang")
"""Attentions the automodel backend hands to nemo-automodel's own layers (`BackendConfig.attn`)."""

_ATTN_WHY = (
    "flex: nemo-automodel 0.7.0's FlexAttention has no backward on CPU (torch 2.13), its Qwen3-MoE attention does not "
    "pass enable_gqa (a GQA model fails at its first forward) and it builds causal masks only (no padding or document "
    "mask); flash_attention_2/3 and eager: on a model with an AutoModel class the compiler runs them as sdpa unpacked "
    "(B20, the plan's model.attn) and Molt refuses them packed (PACK002), so they reach the plan only for a model it "
    "cannot read"
)
_TE_WHY = (
    "nemo-automodel's te path (BackendConfig attn te: transformer_engine's DotProductAttention, padding_causal from "
    "the padded rows' mask); the job's package check (runtime/packages.py) stops it at start without transformer_engine"
)
_TE_NOT_RUN = (
    "transformer_engine's DotProductAttention in nemo-automodel's layers (transformer_engine is installed neither on "
    "the CPU machines nor on the H200 machine)"
)
_TE_PACKED_WHY = (
    "packed rows go to nemo-automodel's te path as THD (its `process_input_for_thd`: cu_seqlens, max_seqlen; "
    "runtime/logprobs.py `thd_row`), which only transformer_engine's kernel runs"
)
_TE_PACKED_NOT_RUN = (
    "transformer_engine's DotProductAttention on THD rows in nemo-automodel's layers (the THD conversion of packed "
    "rows and nemo-automodel's model on it ran on CPU with a stand-in for the kernel, "
    "tests/runtime/models/test_automodel_thd.py; transformer_engine is installed on no machine of ours)"
)
_TILELANG_WHY = (
    "nemo-automodel 0.7.0's GLM-5.2 layers with BackendConfig attn tilelang (the plan's model.attn), fed the packed "
    "row in THD form with cu_seqlens (runtime/packed_thd.py, nemo-automodel's own process_input_for_thd); its "
    "TileLang kernels are CUDA bf16 programs (no CPU path), and the job's package check (runtime/packages.py) stops "
    "the plan at start without the tilelang package"
)
_TILELANG_NOT_RUN = (
    "nemo-automodel's TileLang lighting-indexer and sparse-MLA kernels, forward and backward, on CUDA (tilelang is "
    "installed on none of our machines): on CPU the same THD rows ran through nemo-automodel's GLM-5.2 layers with "
    "the indexer's logits and sparse MLA (forward and backward) replaced by torch references: log-probs, gradients "
    "and critic values equal to its dense sdpa path to bf16 precision, routing replay on the THD row "
    "(tests/runtime/models/test_automodel_dsa.py)"
)
_TILELANG_PADDED_WHY = (
    "nemo-automodel's TileLang DSA indexer and sparse MLA take THD rows only and raise on a (b, w) batch; this trainer "
    "hands unpacked rows as (b, w) with a padding mask"
)
_TILELANG_CP_WHY = (
    "nemo-automodel's GLM-5.2 context parallelism of the packed THD row (runtime/packed_cp.py): its "
    "prepare_model_inputs_for_cp sharder (shard_glm_dsa_packed_cp_batch) gives each cp rank a contiguous slice of "
    "the row's queries with the whole stream's cu_seqlens, its DSA layers all-gather keys and latent values over "
    "the cp group, and the log-probs come back in row order by the sharder's differentiable all-gather"
)
_TILELANG_CP_NOT_RUN = (
    "nemo-automodel's TileLang lighting-indexer and sparse-MLA kernels under its GLM-5.2 context parallelism on "
    "GPUs (tilelang is installed on none of our machines), its all-gathers over NCCL, with expert parallelism, and "
    "a whole trainer step of it: on 2 gloo CPU ranks a tiny GLM-5.2 sharded by FSDP2 (bf16, full checkpointing, "
    "routing replayed) ran its sharder's cut of the packed THD row and the K/V all-gather in its layers with the "
    "kernels replaced by torch references, its log-probs, entropy, top-k log-probs, router logits, loss and "
    "gradients equal to cp 1's to bf16 precision (tests/runtime/test_context_parallel.py)"
)


def attention_rows(kind: str, row: Callable[..., Capability]) -> tuple[Capability, ...]:
    """The automodel backend's attention rows of `kind` (rl | sft), built by that kind's `row` (its backend filter):
    sdpa runs; te unpacked and tilelang packed, with or without CP, are written but not run on cuda; the rest
    refused, each setting by one row (tilelang's CP is this module's row, not `capabilities_cp`'s)."""

    def attn(p: Plan) -> str:
        return p.rl.model.attn if kind == "rl" else p.sft.model.attn

    def packed(p: Plan) -> bool:
        trainer = p.rl.trainer if kind == "rl" else p.sft.trainer
        return trainer is not None and trainer.packing

    def cp(p: Plan) -> bool:
        trainer = p.rl.trainer if kind == "rl" else p.sft.trainer
        return trainer is not None and trainer.mesh.cp > 1

    return (
        row(
            f"{kind}-automodel-attn",
            "model.attn",
            "an attention other than sdpa, te or tilelang on the automodel backend",
            lambda p: attn(p) not in AUTOMODEL_ATTN,
            "model.attn: sdpa",
            _ATTN_WHY,
        ),
        row(
            f"{kind}-automodel-te",
            "model.attn",
            "attention te (transformer_engine) on the automodel backend",
            lambda p: attn(p) == "te" and not packed(p),
            "model.attn: sdpa",
            _TE_WHY,
            unverified=frozenset({"cuda"}),
            not_run=_TE_NOT_RUN,
        ),
        row(
            f"{kind}-automodel-te-packed",
            "actor.packing",
            "packed rows with attention te on the automodel backend",
            lambda p: attn(p) == "te" and packed(p),
            "actor.packing: false (te then runs on padded rows)",
            _TE_PACKED_WHY,
            unverified=frozenset({"cuda"}),
            not_run=_TE_PACKED_NOT_RUN,
        ),
        row(
            f"{kind}-automodel-tilelang",
            "model.attn",
            "attention tilelang (nemo-automodel's GLM-5.2 DSA kernels) on packed rows",
            lambda p: attn(p) == "tilelang" and packed(p) and not cp(p),
            "model.attn: sdpa (nemo-automodel's dense DSA path: the same top-k as a mask)",
            _TILELANG_WHY,
            unverified=frozenset({"cuda"}),
            not_run=_TILELANG_NOT_RUN,
        ),
        row(
            f"{kind}-automodel-tilelang-padded",
            "actor.packing",
            "attention tilelang on unpacked rows",
            lambda p: attn(p) == "tilelang" and not packed(p),
            "actor.packing: true (or model.attn: sdpa)",
            _TILELANG_PADDED_WHY,
        ),
        row(
            f"{kind}-automodel-tilelang-cp",
            "actor.mesh.cp",
            "context parallelism (actor.mesh.cp > 1) with attention tilelang",
            lambda p: attn(p) == "tilelang" and packed(p) and cp(p),
            "actor.mesh.cp: 1",
            _TILELANG_CP_WHY,
            unverified=frozenset({"cuda"}),
            not_run=_TILELANG_CP_NOT_RUN,
        ),
    )
