"""What this build of the runtime implements, per device kind: the capability table.

Owned by the runtime, read by the compiler. Every row is one setting a recipe may ask for that the runtime in this
repository cannot run (anywhere, or on some device kind). The compiler turns a row that a plan asks for into a
CAP001 error at the recipe line that asks (`molt_compile/capability.py`), so a plan that compiles is a plan the
runtime runs; the runtime itself keeps no refusal list (its start-up asserts this same table, which only fails for
a plan compiled by another build). When a runtime issue lands, its rows leave this table.

A row's `asks` reads the plan (the runtime's own input), `key` is the recipe key the diagnostic points at, and
`devices` the device kinds (`cpu`, `cuda`) on which this build does implement it (empty: on none). A row whose
code is written for a device kind that cannot be run here (CUDA) lists it in `unverified`: a plan for that kind
compiles with a CAP002 warning that names what was not run.
Importable without torch, ray, vllm or transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from schemas.capabilities_attn import attention_rows
from schemas.capabilities_cp import cp_rows
from schemas.capabilities_tp import tp_rows
from schemas.plan import Plan, SftTrainerPlan, TrainerPlan

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Capability:
    """One setting the runtime does not implement on (some) devices."""

    id: str
    """Stable id, kebab case (`rl-packing`)."""
    kind: str
    """Recipe kind it applies to: rl | sft."""
    key: str
    """The recipe key that asks for it (the diagnostic's position)."""
    what: str
    """What the recipe asks for, in words."""
    asks: Callable[[Plan], bool]
    """Whether a plan (of `kind`) asks for it."""
    instead: str
    """What to write instead, today."""
    devices: frozenset[str] = frozenset()
    """Device kinds on which this build implements it (empty: none)."""
    tracked: str = ""
    """Where the work to implement it is tracked."""
    unverified: frozenset[str] = frozenset()
    """Device kinds on which the code is written but no test of this project has run it (a CAP002 warning that
    names what was not run, `not_run`), instead of a CAP001 error."""
    not_run: str = ""
    """What was not run on the `unverified` device kinds."""


def _colocated(plan: Plan) -> bool:
    """The engines share the actor's bundles (rollout.placement: colocate)."""
    roles = [r for r in plan.roles if r.name == "rollout.engine"]
    return bool(roles) and roles[0].placement_group != "rollout"


def _ep_rows(kind: str) -> tuple[Capability, ...]:
    """The trainer's expert parallelism and HSDP (RL and SFT alike), run on CPU ranks: the automodel backend at any
    ep dividing the trainer's ranks (each rank holds experts/ep of each MoE layer, FSDP2-sharded over the world / ep
    ranks of its ep_shard group; nemo-automodel's mesh and parallelizer, runtime/models/automodel.py; with LoRA
    adapters too, nemo-automodel's, patched in before the parallelizer; with compiled decoder layers too, their MoE
    blocks eager, under routing replay as well: on GPUs the `*-trainer-ep-cuda` and `*-automodel-compile` rows warn),
    and HSDP (actor.mesh.dp_replicate) on either backend. The hf backend's expert parallelism is refused by rules
    (MOE005, PAR004)."""

    def trainer(plan: Plan) -> TrainerPlan | SftTrainerPlan | None:
        return plan.rl.trainer if kind == "rl" else plan.sft.trainer

    def asks_ep(plan: Plan) -> bool:
        t = trainer(plan)
        backend = plan.rl.model.backend if kind == "rl" else plan.sft.model.backend
        return t is not None and backend == "automodel" and t.mesh.ep > 1

    def asks_hsdp(plan: Plan) -> bool:
        t = trainer(plan)
        return t is not None and t.mesh.dp_replicate > 1

    test = (
        "tests/runtime/models/test_expert_parallel.py" if kind == "rl" else "tests/runtime/test_sft_expert_parallel.py"
    )
    return (
        Capability(
            f"{kind}-trainer-hsdp-cuda",
            kind,
            "actor.mesh.dp_replicate",
            "HSDP (replicated FSDP2 shards) in the trainer on GPUs (NCCL)",
            asks_hsdp,
            "actor.mesh.dp_replicate: 1 on GPUs",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run="HSDP over NCCL: FSDP2's (dp_replicate, dp_shard) mesh, on 4 gloo CPU ranks only "
            "(tests/runtime/models/test_expert_parallel.py)",
            tracked="issue 27: run on gloo ranks, not yet on several GPUs",
        ),
        Capability(
            f"{kind}-trainer-ep-cuda",
            kind,
            "actor.mesh.ep",
            "expert parallelism in the trainer on GPUs (NCCL)",
            asks_ep,
            "actor.mesh.ep: 1 on GPUs",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run="nemo-automodel's expert parallelism over NCCL on several GPUs: the same parallelizer, token "
            "dispatch and weight sync as the gloo CPU ranks run, on no multi-GPU machine yet "
            "(tests/gpu/check_expert_parallel.py is the check to run on one)",
            tracked=f"issue 27: run on gloo ranks ({test}), not yet on several GPUs",
        ),
    )


_DEEPEP_DISPATCHERS = ("deepep", "hybridep", "uccl_ep")


_DISPATCHER_NOT_RUN = (
    "nemo-automodel's DeepEP / UCCL-EP token dispatch in this trainer (no multi-GPU machine lent, and deep_ep / uccl "
    "are not installed on the one-GPU machine)"
)
_SELECTIVE_NOT_RUN = (
    "selective checkpointing of nemo-automodel's layers on CUDA (checked against full checkpointing on CPU only)"
)
_COMPILE_NOT_RUN = (
    "nemo-automodel's decoder layers under torch.compile on CUDA (compiled and checked against eager on CPU only; "
    "transformers' layers were measured compiled on the H200)"
)


def _automodel_rows() -> tuple[Capability, ...]:
    """What the automodel backend (runtime/models/automodel.py) does not do, on any device: settings only the hf
    backend implements, and nemo-automodel's DeepEP token dispatchers."""

    def row(
        id_: str, key: str, what: str, asks: Callable[[Plan], bool], instead: str, why: str, **written: object
    ) -> Capability:
        def on_automodel(p: Plan) -> bool:
            return p.rl.trainer is not None and p.rl.model.backend == "automodel" and asks(p)

        return Capability(id_, "rl", key, what, on_automodel, instead, tracked=f"issue 16: {why}", **written)  # type: ignore[arg-type]

    return (
        *attention_rows("rl", row),
        row(
            "rl-automodel-compile",
            "model.compile_layers",
            "compiled decoder layers on the automodel backend",
            lambda p: p.rl.model.compile_layers,
            "model.compile_layers: false",
            "hf.compile_layers on nemo-automodel's layers (their MoE blocks eager): gradients equal eager on CPU "
            "(tests/runtime/models/test_automodel.py; at ep 2 under routing replay tests/runtime/models/"
            "test_expert_parallel.py)",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run=_COMPILE_NOT_RUN,
        ),
        row(
            "rl-automodel-selective",
            "model.gradient_checkpoint",
            "selective (per-op) activation checkpointing on the automodel backend",
            lambda p: p.rl.model.gradient_checkpoint == "selective",
            "model.gradient_checkpoint: full (or none)",
            "per-op checkpointing with FSDP2's hook ops out of the replay (runtime/models/automodel.py); gradients "
            "equal full checkpointing on CPU (tests/runtime/models/test_automodel.py)",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run=_SELECTIVE_NOT_RUN,
        ),
        row(
            "rl-automodel-dispatcher",
            "model.moe_dispatcher",
            "a DeepEP token dispatcher (deepep, hybridep, uccl_ep) for a trainer of more than one rank",
            lambda p: (
                (p.rl.model.moe_dispatcher or "") in _DEEPEP_DISPATCHERS
                and p.rl.trainer is not None
                and p.rl.trainer.world > 1
            ),
            "model.moe_dispatcher: torch",
            "nemo-automodel's DeepEP dispatchers are CUDA kernels (at world 1 it keeps its local grouped experts); "
            "on CUDA the plan's dispatcher goes to its BackendConfig and the job stops at start when the package "
            "does not import (runtime/models/automodel.py `backend_config`)",
            unverified=frozenset({"cuda"}),
            not_run=_DISPATCHER_NOT_RUN,
        ),
    )


def _offload_rows() -> tuple[Capability, ...]:
    """CPU offload (runtime/fsdp.py): both levels run on CPUs by tests/runtime/test_offload.py (FSDP2's
    CPUOffloadPolicy code path and the host optimizer step, equal to no offload, a checkpoint resumes exactly);
    `optimizer` ran on an H200 (tests/gpu/check_memory.py: a Qwen3-8B shape, a checkpoint resume), so only `full`
    is written and not run on CUDA."""

    def asks(kind: str) -> Callable[[Plan], bool]:
        def check(plan: Plan) -> bool:
            trainer = plan.rl.trainer if kind == "rl" else plan.sft.trainer
            return trainer is not None and trainer.offload == "full"

        return check

    return tuple(
        Capability(
            f"{kind}-offload-full",
            kind,
            "actor.offload",
            "CPU offload of the parameters (actor.offload: full)",
            asks(kind),
            "actor.offload: optimizer",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run="FSDP2's CPUOffloadPolicy on CUDA: the per-unit device-host copies, pinned shards and the "
            "cuda:nccl,cpu:gloo process group (the CPU test runs the same code with host and device one memory; "
            "actor.offload: optimizer ran on an H200)",
            tracked="issue 28 (a multi-GPU run with actor.offload: full)",
        )
        for kind in ("rl", "sft")
    )


def _sft_automodel_rows() -> tuple[Capability, ...]:
    """What SFT on the automodel backend does not do (runtime/sft.py builds through `models.backend`: the build and
    FSDP2 mesh of RL, packing included; tests/runtime/test_sft_automodel.py): as for RL (`_automodel_rows`), the
    settings only the hf backend implements and the DeepEP dispatchers."""

    def row(
        id_: str, key: str, what: str, asks: Callable[[Plan], bool], instead: str, why: str, **written: object
    ) -> Capability:
        def on_automodel(p: Plan) -> bool:
            return p.sft.model.backend == "automodel" and asks(p)

        return Capability(id_, "sft", key, what, on_automodel, instead, tracked=f"issue 28: {why}", **written)  # type: ignore[arg-type]

    return (
        *attention_rows("sft", row),
        row(
            "sft-automodel-compile",
            "model.compile_layers",
            "compiled decoder layers on the automodel backend",
            lambda p: p.sft.model.compile_layers,
            "model.compile_layers: false",
            "the RL build's (rl-automodel-compile)",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run=_COMPILE_NOT_RUN,
        ),
        row(
            "sft-automodel-selective",
            "model.gradient_checkpoint",
            "selective (per-op) activation checkpointing on the automodel backend",
            lambda p: p.sft.model.gradient_checkpoint == "selective",
            "model.gradient_checkpoint: full (or none)",
            "per-op checkpointing with FSDP2's hook ops out of the replay (runtime/models/automodel.py); gradients "
            "equal full checkpointing on CPU (tests/runtime/models/test_automodel.py)",
            devices=frozenset({"cpu"}),
            unverified=frozenset({"cuda"}),
            not_run=_SELECTIVE_NOT_RUN,
        ),
        row(
            "sft-automodel-dispatcher",
            "model.moe_dispatcher",
            "a DeepEP token dispatcher (deepep, hybridep, uccl_ep) for a trainer of more than one rank",
            lambda p: (p.sft.model.moe_dispatcher or "") in _DEEPEP_DISPATCHERS and p.sft.trainer.world > 1,
            "model.moe_dispatcher: torch",
            "the RL build's (rl-automodel-dispatcher): SFT loads through the same `automodel.load`, whose "
            "`check_dispatcher` stops the job at start off CUDA or without the package",
            unverified=frozenset({"cuda"}),
            not_run=_DISPATCHER_NOT_RUN,
        ),
    )


CAPABILITIES: tuple[Capability, ...] = (
    # ---------------------------------------------------------------------------------------------------- RL
    Capability(
        "rl-colocated-vllm",
        "rl",
        "rollout.placement",
        "a vLLM engine sharing the trainer's GPU",
        lambda p: _colocated(p) and p.rl.engines.kind == "vllm",
        "rollout.engine: hf (or placement: separate)",
        devices=frozenset({"cpu"}),
        tracked="issue 18 (CUDA vLLM does not install on the H200 test machines: "
        "its sleep mode and a CUDA IPC refit are untested)",
    ),
    Capability(
        "rl-colocated-wide",
        "rl",
        "rollout.engines",
        "colocated engines beyond trainer rank 0's GPU",
        lambda p: _colocated(p) and (p.rl.engines.count > 1 or p.cluster.nodes > 1),
        "rollout.engines: 1 on one node (the CUDA IPC sender is trainer rank 0), or placement: separate",
        devices=frozenset({"cpu"}),
        tracked="issue 21 (multi-GPU)",
    ),
    *tp_rows("rl", lambda p: p.rl.trainer, Capability),
    *cp_rows("rl", lambda p: p.rl.trainer, Capability),
    *_ep_rows("rl"),
    Capability(
        "rl-routing-replay",
        "rl",
        "train.routing_replay",
        "MoE routing replay (R3) from vLLM engines",
        lambda p: p.rl.trainer is not None and p.rl.trainer.routing_replay and p.rl.engines.kind == "vllm",
        "rollout.engine: hf (it records the routing itself), or train.routing_replay: false",
        devices=frozenset({"cpu"}),
        tracked="issue 27: on CPU Molt's vLLM worker extension captures the routing (runtime/engines/"
        "vllm_routing.py; tests/runtime/test_vllm_routing.py); on GPUs vLLM returns it itself",
        unverified=frozenset({"cuda"}),
        not_run="vLLM's own routed-experts output (enable_return_routed_experts, Model Runner V2 with Triton) and "
        "its MoE-layer rows kept by runtime/engines/vllm_engine.py: CUDA vLLM does not install on the H200 machines",
    ),
    Capability(
        "rl-compile-replay",
        "rl",
        "model.compile_layers",
        "compiled transformers' MoE decoder layers (model.backend: hf) under MoE routing replay",
        lambda p: (
            p.rl.model.compile_layers
            and p.rl.model.backend == "hf"
            and p.rl.trainer is not None
            and p.rl.trainer.routing_replay
        ),
        "model.backend: automodel (its compiled layers replay), or model.compile_layers: false",
        tracked="issue 27: compiled layers run their MoE block eager, replay included (runtime/models/hf.py "
        "compile_layers): run on nemo-automodel's layers at ep 1 and 2 (tests/runtime/models/test_expert_parallel.py), "
        "not on transformers' MoE layers",
    ),
    Capability(
        "rl-chat-images",
        "rl",
        "data.max_images_per_prompt",
        "image prompts for a chat agent (ChatAgentRunner)",
        lambda p: p.rl.agent.chat and p.rl.data.image_key is not None,
        "a step agent (StepEnvRunner) for image prompts: it takes them, and Result.images joins the next turn",
        tracked="issue 17 (the chat server keeps no image parts yet)",
    ),
    Capability(
        "rl-critic-images",
        "rl",
        "critic",
        "a critic (value model) for image prompts",
        lambda p: p.rl.critic is not None and p.rl.data.max_images_per_prompt > 0,
        "a critic-free estimator (grpo, rloo, reinforce_baseline, ...) for a VLM, or data.max_images_per_prompt: 0 "
        "(the value model loads as a text-only token classifier and never sees the images)",
        tracked="issue 14",
    ),
    *_automodel_rows(),
    *_offload_rows(),
    Capability(
        "rl-muon",
        "rl",
        "actor.optimizer.name",
        "the Muon optimizer",
        lambda p: p.rl.trainer is not None and p.rl.trainer.optimizer.name != "adam",
        "actor.optimizer.name: adam",
        tracked="issue 15",
    ),
    Capability(
        "rl-full-determinism",
        "rl",
        "train.full_determinism",
        "deterministic kernels and seeding",
        lambda p: p.rl.trainer is not None and p.rl.trainer.full_determinism,
        "train.full_determinism: false",
        tracked="issue 13",
    ),
    Capability(
        "rl-warm-resume",
        "rl",
        "ckpt.warm_resume_rollouts",
        "restoring untrained rollouts on resume",
        lambda p: p.rl.ckpt.warm_resume_rollouts,
        "ckpt.warm_resume_rollouts: false",
        tracked="issue 13",
    ),
    # ---------------------------------------------------------------------------------------------------- SFT
    *tp_rows("sft", lambda p: p.sft.trainer, Capability),
    *cp_rows("sft", lambda p: p.sft.trainer, Capability),
    *_ep_rows("sft"),
    Capability(
        "sft-muon",
        "sft",
        "actor.optimizer.name",
        "the Muon optimizer",
        lambda p: p.sft.trainer.optimizer.name != "adam",
        "actor.optimizer.name: adam",
        tracked="issue 15",
    ),
    *_sft_automodel_rows(),
)
"""Every row, RL first, then SFT. `ids` are stable; a row that is implemented everywhere is deleted."""


def device_of(plan: Plan) -> str:
    section = plan.rl if plan.kind == "rl" else plan.sft
    return section.device


def unimplemented(plan: Plan) -> list[Capability]:
    """The rows `plan` asks for that this build does not implement on the plan's device kind."""
    device = device_of(plan)
    return [c for c in CAPABILITIES if c.kind == plan.kind and device not in c.devices | c.unverified and c.asks(plan)]


def unverified(plan: Plan) -> list[Capability]:
    """The rows `plan` asks for whose code is written for the plan's device kind but was not run there."""
    device = device_of(plan)
    return [c for c in CAPABILITIES if c.kind == plan.kind and device in c.unverified and c.asks(plan)]
