"""The capability table's tensor-parallelism rows (`schemas/capabilities.py` lists them).

The trainer's TP is nemo-automodel's dense parallelizer and its tensor-parallel plan of the architecture
(runtime/models/automodel.py `tensor_parallel`; the compiler sends the dense architectures it has a plan for to the
automodel backend at tp > 1, `model_facts.TP_ARCHITECTURES`; the hf backend has no TP, PAR004; MoE models have no
plan of nemo-automodel's, MOE002). It runs on gloo CPU ranks (RL and SFT: tp 2, tp 2 x dp 2, and HSDP with tp 2 on
8 ranks, nemo-automodel's (dp_replicate 2, dp_shard 2, tp 2) mesh; LoRA too: nemo-automodel's adapters, which its
plan's LoRA-aware styles cut with their layers; and `actor.sequence_parallel`: its plan's sequence-parallel styles;
RL: gae's critic at tp 2 x dp 2 on the plan's critic mesh, the actor's tp, with the same plan, its scalar head
replicated; both levels of CPU offload, `actor.offload`; compiled decoder layers, without activation checkpointing
and with full checkpointing, whose eager checkpoint wraps each compiled layer: torch 2.13 fails a full checkpoint traced
inside a compiled TP layer, `runtime/models/automodel.py` `tensor_parallel`);
over NCCL it is written and not run (a CAP002 warning). With context parallelism (tp x cp: each cp rank's cut of a
data-parallel rank's rows shared by its tp ranks, runtime/ranks.py) it is written and not run on GPUs, this row's
warning and the CP row's (`capabilities_cp`), and refused on CPUs by the CP row (torch's ring attention has no CPU
path). What the TP build does not take is refused everywhere, each by its own row at its own key. Importable without
torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from schemas.capabilities import Capability
    from schemas.plan import Plan, SftTrainerPlan, TrainerPlan

_NOT_RUN = (
    "nemo-automodel's tensor parallelism over NCCL on several GPUs: the same parallelizer, vocab-parallel log-probs, "
    "TP-replica gradient sync, weight sync, CPU offload, compiled layers (with full checkpointing too) and DCP "
    "checkpoints as the gloo CPU ranks run, on no multi-GPU machine yet (tests/gpu/check_tensor_parallel.py is the "
    "check to run on one); with context parallelism "
    "(actor.mesh.cp > 1, tp x cp), nothing of a TP model's forward or backward under CP ran anywhere (torch's ring "
    "attention over each tp rank's heads has no CPU path): the rank arithmetic, each cp rank's cut shared by its tp "
    "ranks, a per-token model's vocab-parallel head and sequence-sharded output on the cut, the loss over dp x cp, "
    "the build on nemo-automodel's (dp_shard_cp, tp) mesh ran on gloo CPU ranks without attention at cp 2 x tp 2 "
    "(tests/runtime/test_context_parallel.py; tests/gpu/check_context_parallel.py --tp 2 is the check to run on 4 "
    "GPUs)"
)


def tp_rows(
    kind: str, section: Callable[[Plan], TrainerPlan | SftTrainerPlan | None], row: Callable[..., Capability]
) -> tuple[Capability, ...]:
    """`kind`'s (rl | sft) TP rows, made by `row` (the `Capability` class): the one that runs (written, not run on
    cuda), then one per setting the TP build does not take (exclusive of it: a plan gets one diagnostic per
    setting)."""

    def tp(plan: Plan) -> bool:
        trainer = section(plan)
        return trainer is not None and trainer.mesh.tp > 1

    def compiled_selective(plan: Plan) -> bool:
        runtime = plan.rl if kind == "rl" else plan.sft
        return runtime is not None and runtime.model.compile_layers and runtime.model.gradient_checkpoint == "selective"

    test = (
        "tests/runtime/models/test_tensor_parallel.py" if kind == "rl" else "tests/runtime/test_sft_tensor_parallel.py"
    )
    refused: list[tuple[str, str, str, Callable[[TrainerPlan | SftTrainerPlan, Plan], bool], str, str]] = [
        (
            "compile",
            "model.compile_layers",
            "compiled decoder layers with selective activation checkpointing",
            lambda t, p: compiled_selective(p),
            "model.gradient_checkpoint: full or none with model.compile_layers, or model.compile_layers: false",
            "selective checkpointing picks ops inside the compiled layer (torch's checkpoint traced in the graph); "
            "under TP it ran once on gloo ranks with the one-rank numbers, but its compile is not in the TP test's "
            "time; compiled layers run under TP without checkpointing and with full checkpointing (an eager "
            "checkpoint around each compiled layer: tests/runtime/models/test_tensor_parallel.py)",
        ),
    ]

    def refuses(check: Callable[[TrainerPlan | SftTrainerPlan, Plan], bool]) -> Callable[[Plan], bool]:
        def asks(plan: Plan) -> bool:
            trainer = section(plan)
            return trainer is not None and trainer.mesh.tp > 1 and check(trainer, plan)

        return asks

    return (
        row(
            f"{kind}-trainer-tp-cuda",
            kind,
            "actor.mesh.tp",
            "tensor parallelism in the trainer on GPUs (NCCL)",
            tp,
            "actor.mesh.tp: 1 on GPUs",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run=_NOT_RUN,
            tracked=f"issue 27: run on gloo ranks ({test}), not yet on several GPUs",
        ),
        *(
            row(
                f"{kind}-trainer-tp-{name}",
                kind,
                key,
                f"{what} with tensor parallelism in the trainer",
                refuses(check),
                f"{instead}, or actor.mesh.tp: 1",
                tracked=f"issue 27: {why}",
            )
            for name, key, what, check, instead, why in refused
        ),
    )
