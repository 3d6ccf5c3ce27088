"""Per-GPU memory estimate of the FSDP roles and of the vLLM engines, against the GPU catalog.

An estimate, not a measurement: good enough to reject what cannot fit and to warn when a run is tight. Every term
is in the breakdown, so a reader can see which one dominates.

FSDP role on one GPU (world = nodes × gpus_per_node; FSDP2 shards over dp × cp, TP splits each weight, EP splits
the experts — together every parameter lives on exactly one rank of `world`, so static state is `bytes / world`):
- parameters: fp32 master weights, 4 B/param (Molt loads fp32 masters for actor, ref and critic, B22), plus the
  bf16 (param_dtype) all-gathered copy of about two layers in flight (FSDP2 prefetch): 2 × 2 B × params/layers,
  split by tp and, for MoE, by ep.
- gradients: fp32, 4 B/param (trained roles only).
- optimizer: AdamW keeps 2 fp32 states, 8 B/param; Muon keeps one momentum buffer, ~4 B/param (estimate).
  `offload: optimizer` moves them to CPU (0 on the GPU); `offload: full` moves parameters, gradients and optimizer
  states to CPU (only the gathered bf16 layers stay).
- activations for one micro-batch of T = micro_batch_size × max_len / cp tokens (dynamic batching:
  max_tokens_per_gpu), bf16, after Korthikanti et al. 2022 ("Reducing activation recomputation", eq. 2 with
  flash attention, i.e. without the a·s/h attention-score term): 34·T·h bytes per layer, divided by tp.
    * gradient_checkpoint full: the layer inputs are kept (2·T·h per layer; divided by tp with
      sequence_parallel) plus one layer's full working set (34·T·h / tp) while it is recomputed;
    * none or selective: 34·T·h / tp per layer (selective recomputes only the attention core, which flash attention
      does not store anyway — estimate);
    * the reference model runs forward only without grad: one layer's working set;
    * logits in fp32 plus their log-softmax: 2 × 4 B × T × vocab / tp (not for the critic's scalar head).
- runtime overhead: CUDA context, NCCL and allocator slack, 2 GiB (estimate).
Colocated roles (ref/critic with `placement: colocate`) stay resident on the same GPUs and run one after another:
their static memory adds up, activations count once (the largest). A reference model / teacher whose architecture
cannot be resolved here (a hub name or cluster path) is estimated with the policy's facts.

vLLM engine GPU (`rollout.engine: vllm` only; the HF engine has no memory share): vLLM may use `gpu_memory_utilization × GPU memory`. Weights in the engine dtype are split by
tp × pp (experts also by dp with expert_parallel); about 1.5 GiB goes to activations and CUDA graphs (estimate); the
rest is KV cache, which must hold at least one `max_len` sequence (KV bytes/token from the catalog, KV heads split
over tp), else vLLM refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30
FSDP_OVERHEAD_BYTES = 2 * GIB
ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)
TIGHT_FRACTION = 0.9
ACT_BYTES_PER_TOKEN_HIDDEN = 34
ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one GPU holds for one FSDP role."""

    role: str
    params: float
    grads: float
    optimizer: float
    activations: float

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class GpuGroupMemory:
    """The FSDP roles that share one set of GPUs, summed."""

    roles: tuple[RoleMemory, ...]
    capacity: float

    @property
    def total(self) -> float:
        return sum(r.static for r in self.roles) + max(r.activations for r in self.roles) + FSDP_OVERHEAD_BYTES

    @property
    def label(self) -> str:
        return " + ".join(r.role for r in self.roles)

    def breakdown(self) -> str:
        parts = [f"{r.role}: params {gib(r.params)}, grads {gib(r.grads)}, optimizer {gib(r.optimizer)}, "
                 f"activations {gib(r.activations)}" for r in self.roles]
        return "; ".join(parts) + f"; overhead {gib(FSDP_OVERHEAD_BYTES)}"


@dataclass(frozen=True)
class EngineMemory:
    """One vLLM engine GPU."""

    weights: float
    share: float
    kv_per_sequence: float
    capacity: float

    @property
    def kv_room(self) -> float:
        return self.share - self.weights - ENGINE_OVERHEAD_BYTES


@dataclass(frozen=True)
class MemoryReport:
    fsdp_groups: tuple[GpuGroupMemory, ...]
    engine: EngineMemory | None


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def estimate(recipe: Any, derived: Any, facts: Any, gpu: Any, ref_facts: Any = None) -> MemoryReport:
    """Memory per GPU of every FSDP group and of one engine GPU. `facts`: ModelFacts; `gpu`: GpuSpec."""
    capacity = gpu.memory_gib * GIB
    roles = _fsdp_roles(recipe, derived)
    groups: list[GpuGroupMemory] = []
    colocated = [_role_memory(recipe, derived, r, ref_facts if r == "ref" and ref_facts else facts)
                 for r, together in roles if together]
    if colocated:
        groups.append(GpuGroupMemory(tuple(colocated), capacity))
    for role, together in roles:
        if not together:
            mem = _role_memory(recipe, derived, role, ref_facts if role == "ref" and ref_facts else facts)
            groups.append(GpuGroupMemory((mem,), capacity))
    vllm = recipe.kind == "rl" and recipe.rollout.engine == "vllm"
    engine = _engine_memory(recipe, facts, gpu) if vllm else None
    return MemoryReport(tuple(groups), engine)


def _value(derived: Any, name: str, default: Any = None) -> Any:
    try:
        return derived.value(name, default)
    except Exception:  # a partial Derived (tests, explain) must not crash the estimate
        return default


def _fsdp_roles(recipe: Any, derived: Any) -> list[tuple[str, bool]]:
    """(role, shares the actor's GPUs) for the built FSDP roles."""
    if recipe.kind == "sft":
        return [("actor", True)]
    if recipe.eval.only:
        return []
    out = [("actor", True)]
    for role in ("ref", "critic"):
        if _value(derived, f"{role}.exists", False):
            out.append((role, bool(_value(derived, f"{role}.colocated", False))))
    return out


def _role_memory(recipe: Any, derived: Any, role: str, facts: Any) -> RoleMemory:
    a = recipe.actor
    world = _value(derived, f"{role}.world") or a.nodes * a.gpus_per_node
    tp, ep = a.mesh.tp, a.mesh.ep
    n = facts.params_total
    trains = role != "ref"
    offload = a.offload if trains else "none"
    layer_params = n / max(facts.layers, 1) / tp / (ep if facts.is_moe else 1)
    gathered = 2 * 2 * layer_params
    params = gathered + (0 if offload == "full" else 4 * n / world)
    grads = 4 * n / world if trains and offload != "full" else 0.0
    opt_bytes = 4 if a.optimizer.name == "muon" else 8
    optimizer = opt_bytes * n / world if trains and offload == "none" else 0.0
    return RoleMemory(role, params, grads, optimizer, _activations(recipe, role, facts))


def _activations(recipe: Any, role: str, facts: Any) -> float:
    a, t = recipe.actor, recipe.train
    tp, cp = a.mesh.tp, a.mesh.cp
    dyn = getattr(t, "dynamic_batch", None)
    tokens = dyn.max_tokens_per_gpu if dyn is not None else t.micro_batch_size * recipe.data.max_len / cp
    h, layers = facts.hidden_size, facts.layers
    layer_set = ACT_BYTES_PER_TOKEN_HIDDEN * tokens * h / tp
    if role == "ref":
        acts = layer_set
    elif recipe.model.gradient_checkpoint == "full":
        kept = 2 * tokens * h * layers / (tp if a.sequence_parallel else 1)
        acts = kept + layer_set
    else:
        acts = layer_set * layers
    logits = 0.0 if role == "critic" else 2 * 4 * tokens * facts.vocab / tp
    return acts + logits


def _engine_memory(recipe: Any, facts: Any, gpu: Any) -> EngineMemory:
    ro = recipe.rollout
    m = ro.mesh
    dtype_bytes = ENGINE_DTYPE_BYTES.get(ro.dtype, 2)
    n = facts.params_total
    expert = 0.0
    if facts.is_moe:
        expert = min(0.97 * n, facts.layers * facts.experts * 3 * facts.hidden_size * facts.intermediate_size)
    ep_split = m.dp if ro.expert_parallel else 1
    weights = dtype_bytes * ((n - expert) / (m.tp * m.pp) + expert / (m.tp * m.pp * ep_split))
    capacity = gpu.memory_gib * GIB
    kv_split = min(m.tp, max(facts.kv_heads, 1))
    kv_per_seq = facts.kv_bytes_per_token * recipe.data.max_len / kv_split / m.pp
    return EngineMemory(weights, ro.gpu_memory_utilization * capacity, kv_per_seq, capacity)
