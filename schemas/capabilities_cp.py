"""The capability table's context-parallelism rows (`schemas/capabilities.py` lists them).

The trainer's CP (runtime/context_parallel.py) is nemo-automodel's sharder cutting padded text rows for torch's ring
attention, which has no CPU path (the CPU SDPA op has no sharding strategy), or with te attention for
transformer_engine's own CP (CUDA-only): on GPUs it is written and not run (a CAP002 warning), on CPUs refused. What
it does not take is refused everywhere, each by its own row at its own key: packed te rows (on the automodel backend
rows pack only with te or tilelang, PACK001, PACK002) and image prompts of a VLM other than the catalog's
Qwen3.5/3.6-MoE and Nemotron-Omni (nemo-automodel's own). Packed tilelang rows under CP are GLM-5.2's own CP
(runtime/packed_cp.py), one row of `capabilities_attn` (so its `actor.mesh.cp` gets one diagnostic, not this
module's too). The hf backend has no CP (PAR004).
Importable without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.capabilities import Capability
    from schemas.plan import Plan, SftTrainerPlan, TrainerPlan

_TE_NOT_RUN = (
    "transformer_engine's context parallelism in nemo-automodel's layers (its `apply_cp`: each DotProductAttention "
    "in the cp group, a hybrid's Mamba / gated-delta-net layers' own CP) on the sharder's rows over several GPUs; "
    "the sharding, the log-probs put back in row order and the loss over dp x cp ran on gloo CPU ranks without "
    "attention (tests/runtime/test_context_parallel.py); transformer_engine is installed on no machine of ours"
    "; with image prompts, a Qwen3.5/3.6-MoE VLM's splice before the cut and a Nemotron-Omni's splice and cut in "
    "its own forward ran on a 1-rank cp mesh with sdpa (tests/runtime/models/test_automodel_vlm.py, "
    "test_automodel_omni.py; the omni's Mamba mixers, mamba_ssm's CUDA kernels with their CP, on no machine)"
)
_NOT_RUN = (
    "torch context_parallel's ring attention with nemo-automodel's sharder on several GPUs (the sharding, the "
    "log-probs put back in row order and the loss over dp x cp ran on gloo CPU ranks without attention, "
    "tests/runtime/test_context_parallel.py; no multi-GPU machine is lent); with image prompts, a Qwen3.5/3.6-MoE "
    "VLM's splice before the cut and a Nemotron-Omni's splice and cut in its own forward ran on a 1-rank cp mesh "
    "(tests/runtime/models/test_automodel_vlm.py, test_automodel_omni.py; the omni's Mamba mixers, mamba_ssm's "
    "CUDA kernels with their CP, on no machine); with tensor parallelism (actor.mesh.tp > 1, tp x cp), the ring "
    "attention over each tp rank's heads, the TP model's forward and backward on the cut and its gradients on no "
    "machine (cp 2 x tp 2 on gloo CPU ranks without attention: the rank arithmetic, the cut shared by the tp ranks, "
    "a per-token model's vocab-parallel head and sequence-sharded output on it, the loss over dp x cp, the build on "
    "nemo-automodel's (dp_shard_cp, tp) mesh, tests/runtime/test_context_parallel.py; tests/gpu/"
    "check_context_parallel.py --tp 2 is the check to run on 4 GPUs)"
)


_SPLICE_VLMS = ("Qwen3_5MoeForConditionalGeneration", "NemotronH_Nano_Omni")
"""The catalog architectures of the VLMs whose CP this trainer runs, nemo-automodel's own: Qwen3.5/3.6-MoE splices
the images into the whole rows before the cut (`_embed_and_splice_for_cp`), Nemotron-Omni inside its own forward,
which then cuts the spliced rows itself (the same head-tail chunks)."""


def _splices_before_the_cut(arch: str | None) -> bool:
    """The catalog's architecture `arch` is a VLM whose CP is wired (`_SPLICE_VLMS`); unknown: not."""
    from schemas.catalog import MODELS

    spec = MODELS.get(arch) if arch is not None else None
    return spec is not None and spec.architecture in _SPLICE_VLMS


def cp_rows(
    kind: str, section: Callable[[Plan], TrainerPlan | SftTrainerPlan | None], row: Callable[..., Capability]
) -> tuple[Capability, ...]:
    """`kind`'s (rl | sft) CP rows, made by `row` (the `Capability` class): the one that runs (written, not run on
    cuda), then one per setting it does not take (exclusive of it: a plan gets one diagnostic per setting)."""

    def cp(plan: Plan) -> bool:
        trainer = section(plan)
        return trainer is not None and trainer.mesh.cp > 1

    def attn(plan: Plan) -> str:
        return plan.rl.model.attn if kind == "rl" else plan.sft.model.attn

    def images(plan: Plan) -> bool:
        return (plan.rl.data.image_key if kind == "rl" else plan.sft.data.image_key) is not None

    def packed(plan: Plan) -> bool:
        trainer = section(plan)
        return trainer is not None and trainer.packing

    refused: list[tuple[str, str, str, Callable[[Plan], bool], str, str]] = [
        (
            "packed",
            "actor.packing",
            "packed rows",
            lambda p: packed(p) and attn(p) != "tilelang",  # tilelang's CP: its own row (capabilities_attn.py)
            "actor.packing: false",
            "this trainer's CP cuts padded rows; nemo-automodel's CP of packed THD rows (te's cu_seqlens partition, "
            "`make_cp_batch_for_te`) is not wired",
        ),
        (
            "images",
            "data.max_images_per_prompt" if kind == "rl" else "data.image_key",
            "image prompts",
            lambda p: images(p) and not _splices_before_the_cut(p.rl.model.arch if kind == "rl" else p.sft.model.arch),
            "data.max_images_per_prompt: 0" if kind == "rl" else "data.image_key: null",
            "a VLM's CP here is nemo-automodel's splice of the images into the whole rows before the cut, as its "
            f"own {' and '.join(_SPLICE_VLMS)} do it; another VLM's, or one outside the catalog (model.arch), is "
            "not wired",
        ),
    ]
    others = tuple(
        row(
            f"{kind}-trainer-cp-{suffix}",
            kind,
            key,
            f"context parallelism (actor.mesh.cp > 1) with {what}",
            lambda p, asks=asks: cp(p) and asks(p),
            f"{instead}, or actor.mesh.cp: 1",
            tracked=f"issue 27: {why}",
        )
        for suffix, key, what, asks, instead, why in refused
    )
    te = row(
        f"{kind}-trainer-cp-te",
        kind,
        "model.attn",
        "context parallelism (actor.mesh.cp > 1) with attention te",
        lambda p: cp(p) and attn(p) == "te" and not any(r.asks(p) for r in others),
        "model.attn: sdpa, or actor.mesh.cp: 1",
        unverified=frozenset({"cuda"}),
        not_run=_TE_NOT_RUN,
        tracked="issue 27: te's own CP has no CPU path (transformer_engine is CUDA-only)",
    )
    written = row(
        f"{kind}-trainer-cp",
        kind,
        "actor.mesh.cp",
        "context parallelism in the trainer (actor.mesh.cp > 1)",
        # tilelang's CP is GLM-5.2's own, one row of capabilities_attn.py at this key
        lambda p: cp(p) and attn(p) not in ("te", "tilelang") and not any(r.asks(p) for r in others),
        "actor.mesh.cp: 1",
        unverified=frozenset({"cuda"}),
        not_run=_NOT_RUN,
        tracked="issue 27: torch's context_parallel has no CPU path (the CPU SDPA op has no sharding strategy), so "
        "CP runs on GPUs only",
    )
    return (written, te, *others)
