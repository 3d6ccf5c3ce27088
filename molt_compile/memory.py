"""Per-GPU memory estimate of the FSDP roles and of the vLLM engines, against the GPU catalog.

An estimate, not a measurement: good enough to reject what cannot fit and to warn when a run is tight. Every term
is in the breakdown, so a reader can see which one dominates.

FSDP role on one GPU (world = nodes × gpus_per_node; FSDP2 shards over dp × cp, TP splits each weight, EP splits
the experts and FSDP2 shards them over the world / ep ranks of their ep_shard group — together every parameter lives
on exactly one rank of `world`, so static state is `bytes / world`; under HSDP (`actor.mesh.dp_replicate`) the
trainer keeps dp_replicate copies of the non-expert state, `bytes × dp_replicate / world`):
- parameters: fp32 master weights, 4 B/param (Molt loads fp32 masters for actor, ref and critic, B22), plus the
  bf16 (param_dtype) all-gathered copy of about two layers in flight (FSDP2 prefetch): 2 × 2 B × params/layers,
  split by tp and, for MoE, by ep.
- gradients: fp32, 4 B/param (trained roles only).
- optimizer: AdamW keeps 2 fp32 states, 8 B/param; Muon keeps one momentum buffer, ~4 B/param (estimate).
  `offload: optimizer` moves them to CPU (0 on the GPU); `offload: full` moves parameters, gradients and optimizer
  states to CPU (only the gathered bf16 layers stay).
- host memory (per rank, counted apart from the GPU's; `runtime/fsdp.py`): `offload: optimizer` keeps the
  optimizer states there (8 B/param for AdamW, over world) and the host step's four chunk buffers (two chunks'
  parameter and gradient copies of `HOST_STEP_CHUNK_BYTES`, at least the largest shard: the fp32 embedding over
  world); `offload: full` keeps FSDP2's parameter and gradient shards and the optimizer states (4 + 4 + 8
  B/param). A node holds `gpus_per_node` ranks of each trained role (actor, critic: counted as if on one node,
  an upper bound when a separate critic lands on other nodes), held against the node's RAM from the GPU catalog
  (MEM008). Model loading, Ray and the engines' host memory are not counted.
- the optimizer step adds nothing: the runtime's AdamW is fused on GPUs (the multi-tensor path would allocate an
  fp32 temporary of the parameters' size: 4 B/param more at the step, measured on the H200).
- activations for one micro-batch of T = micro_batch_size × max_len / cp tokens (dynamic batching:
  max_tokens_per_gpu; the critic and a separate reference run whole rows: their groups have no cp axis in the
  runtime, so T is cp times that), what autograd keeps per token and layer of a Qwen-style decoder in bf16 with fp32 RMSNorm
  upcasts (the norms, q/k/v, their per-head norms and rotary outputs, the attention output, the MLP's gate, up,
  activation and product): 16·h + 8·I + 12·(heads·head_dim) + 12·(kv_heads·head_dim) bytes, I the MLP width
  (MoE: experts_per_token × the expert width); under tp its 8·I + 12·(heads·head_dim) + 12·(kv_heads·head_dim)
  column / row-parallel part is divided by tp, its 16·h hidden-width part is not (without sequence parallelism
  every tp rank holds the whole hidden states);
    * gradient_checkpoint full: the layer inputs are kept (2·T·h per layer; divided by tp with
      sequence_parallel) plus one layer's working set while it is recomputed;
    * selective: the runtime keeps each layer's input and the outputs of its matmuls and attention kernel and
      recomputes the rest (norms, rotary, activation, residual adds): 2·(3h + 2·(heads·head_dim) +
      2·(kv_heads·head_dim) + 2I) bytes per token and layer, plus one layer's working set while it is recomputed;
    * none: every layer's working set;
    * the reference model runs forward only without grad: one layer's working set;
    * log-probs: the runtime computes the lm_head over chunks of `LOGPROB_CHUNK_TOKENS` positions
      (`runtime/logprobs.py`), so about 3.5 fp32 (chunk × vocab) tensors are alive at once (logits, their
      softmax, the recomputed chunk and its gradient), under tp too (the runtime gathers a chunk's vocabulary-
      parallel logits whole before the log-softmax).
- allocator slack: 10 % of the static state (the caching allocator's fragmentation around FSDP2's per-layer
  all-gather and reduce-scatter buffers: reserved minus allocated memory grew with the model, not the batch).
- runtime overhead: CUDA context and NCCL, 2 GiB (estimate).
The estimate is of the peak *reserved* memory (what out-of-memory is about), held against the measured peaks of
eleven configurations on an H200 (0.6B-4B Qwen3 shapes, 2k-16k tokens per micro-batch, full, selective and no
checkpointing): estimate / measured 0.97-1.03 (`tests/gpu/check_memory.py`; the table is `tests/test_memory.py`).
Colocated roles (ref/critic with `placement: colocate`) stay resident on the same GPUs and run one after another:
their static memory adds up, activations and temporaries count once (the largest). A reference model / teacher
whose architecture cannot be resolved here (a hub name or cluster path) is estimated with the policy's facts.

HF engine GPU (`rollout.engine: hf`): the whole model in the engine dtype (no memory share, no sharding); its KV
cache is not estimated.

vLLM engine GPU (`rollout.engine: vllm`): vLLM may use `gpu_memory_utilization × GPU memory`. Weights in the engine dtype are split by
tp × pp (experts also by dp with expert_parallel); about 1.5 GiB goes to activations and CUDA graphs (estimate); the
rest is KV cache, which must hold at least one `max_len` sequence (KV bytes/token from the catalog, KV heads split
over tp), else vLLM refuses to start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 2**30
FSDP_OVERHEAD_BYTES = 2 * GIB
ALLOCATOR_SLACK = 0.10
ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)
TIGHT_FRACTION = 0.9
LOGPROB_CHUNK_TOKENS = 1024
HOST_STEP_CHUNK_BYTES = 1 << 30  # runtime/fsdp.py: `offload: optimizer` steps the parameters in chunks of this size
"""Positions per lm_head chunk in the runtime's log-prob computation (`runtime/logprobs.py`; a test holds them equal)."""
LOGIT_TENSORS_ALIVE = 3.5
ENGINE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one GPU holds for one FSDP role, and what its rank keeps in host memory (CPU offload)."""

    role: str
    params: float
    grads: float
    optimizer: float
    activations: float
    host: float = 0.0
    """Host bytes of one rank: what `actor.offload` keeps there (0 without offload)."""
    ranks_per_node: int = 0
    """Ranks of this role on one node (their host bytes add up in the node's RAM)."""

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def largest_term(self) -> str:
        terms = {
            "parameters": self.params,
            "gradients": self.grads,
            "optimizer states": self.optimizer,
            "activations": self.activations,
        }
        return max(terms, key=terms.__getitem__)


@dataclass(frozen=True)
class GpuGroupMemory:
    """The FSDP roles that share one set of GPUs, summed."""

    roles: tuple[RoleMemory, ...]
    capacity: float

    @property
    def total(self) -> float:
        static = sum(r.static for r in self.roles)
        return static * (1 + ALLOCATOR_SLACK) + max(r.activations for r in self.roles) + FSDP_OVERHEAD_BYTES

    @property
    def slack(self) -> float:
        return ALLOCATOR_SLACK * sum(r.static for r in self.roles)

    @property
    def label(self) -> str:
        return " + ".join(r.role for r in self.roles)

    def breakdown(self) -> str:
        parts = [
            f"{r.role}: params {gib(r.params)}, grads {gib(r.grads)}, optimizer {gib(r.optimizer)}, "
            f"activations {gib(r.activations)}"
            for r in self.roles
        ]
        return "; ".join(parts) + f"; allocator slack {gib(self.slack)}; overhead {gib(FSDP_OVERHEAD_BYTES)}"


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
    hf_engine_weights: float | None = None
    """`rollout.engine: hf`: the whole model's weights in the engine dtype on each engine GPU (transformers
    generate shards nothing); its KV cache comes on top and is not estimated."""
    host_capacity: float | None = None
    """The node's RAM from the GPU catalog (None: not in the catalog)."""

    @property
    def host_per_node(self) -> float:
        """Host bytes the FSDP roles' offload keeps on one node."""
        return sum(r.host * r.ranks_per_node for g in self.fsdp_groups for r in g.roles)

    def host_breakdown(self) -> str:
        return "; ".join(
            f"{r.role}: {r.ranks_per_node} ranks x {gib(r.host)}" for g in self.fsdp_groups for r in g.roles if r.host
        )


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def memory_report(recipe: Any, derived: Any, source: Any) -> MemoryReport | None:
    """The estimate for a compiled recipe, as the MEM rules and the compile summary show it (None: the GPU has no
    catalog memory or the model's facts cannot be read)."""
    from molt_compile.model_facts import model_facts, role_facts
    from schemas.catalog import GPUS

    gpu = GPUS.get(recipe.cluster.gpu)
    facts = model_facts(recipe, source)
    if gpu is None or gpu.memory_gib <= 0 or facts is None:
        return None
    ref_facts = role_facts(recipe, source, "ref") if recipe.kind == "rl" and recipe.ref is not None else None
    return estimate(recipe, derived, facts, gpu, ref_facts)


def estimate(recipe: Any, derived: Any, facts: Any, gpu: Any, ref_facts: Any = None) -> MemoryReport:
    """Memory per GPU of every FSDP group and of one engine GPU. `facts`: ModelFacts; `gpu`: GpuSpec."""
    capacity = gpu.memory_gib * GIB
    roles = _fsdp_roles(recipe, derived)
    groups: list[GpuGroupMemory] = []
    colocated = [
        _role_memory(recipe, derived, r, ref_facts if r == "ref" and ref_facts else facts)
        for r, together in roles
        if together
    ]
    if colocated:
        groups.append(GpuGroupMemory(tuple(colocated), capacity))
    for role, together in roles:
        if not together:
            mem = _role_memory(recipe, derived, role, ref_facts if role == "ref" and ref_facts else facts)
            groups.append(GpuGroupMemory((mem,), capacity))
    vllm = recipe.kind == "rl" and recipe.rollout.engine == "vllm"
    engine = _engine_memory(recipe, facts, gpu) if vllm else None
    hf = recipe.kind == "rl" and recipe.rollout.engine == "hf"
    hf_weights = ENGINE_DTYPE_BYTES.get(recipe.rollout.dtype, 2) * facts.params_total if hf else None
    host = getattr(gpu, "host_memory_gib", None)
    return MemoryReport(tuple(groups), engine, hf_weights, None if host is None else host * GIB)


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
    # HSDP (the trainer's dp_replicate): the state shards over world / dp_replicate ranks, but for the experts
    # under ep > 1, which shard over every rank still (ep x ep_shard)
    replicate = a.mesh.dp_replicate if role == "actor" else 1
    experts = _expert_params(facts) if facts.is_moe and ep > 1 else 0.0
    per_rank = ((n - experts) * replicate + experts) / world  # parameters this rank holds a shard of
    params = gathered + (0 if offload == "full" else 4 * per_rank)
    grads = 4 * per_rank if trains and offload != "full" else 0.0
    opt_bytes = 4 if a.optimizer.name == "muon" else 8
    optimizer = opt_bytes * per_rank if trains and offload == "none" else 0.0
    # offloaded: the optimizer states, and FSDP2's parameter and gradient shards under full; under optimizer the
    # host step's four chunk buffers instead (at least the largest shard: the embedding's, fp32, over the world)
    host = 0.0
    if trains and offload == "full":
        host = (4 + 4 + opt_bytes) * per_rank
    elif trains and offload == "optimizer":
        embedding = 4 * facts.vocab * facts.hidden_size * replicate / world
        host = opt_bytes * per_rank + 4 * max(HOST_STEP_CHUNK_BYTES, embedding)
    # the actor's mesh splits sequences over cp; a separate reference or a critic builds without it
    cp = a.mesh.cp if role == "actor" or (role == "ref" and _value(derived, "ref.colocated", False)) else 1
    return RoleMemory(role, params, grads, optimizer, _activations(recipe, role, facts, cp), host, a.gpus_per_node)


def _expert_params(facts: Any) -> float:
    """The routed experts' share of the parameters (gate, up and down matrices of each; the engine estimate's)."""
    return min(
        0.97 * facts.params_total, facts.layers * facts.experts * 3 * facts.hidden_size * facts.intermediate_size
    )


def _widths(facts: Any) -> tuple[int, int, int, int]:
    """A decoder layer's hidden, MLP (MoE: experts per token x expert width), q and kv widths."""
    mlp = facts.intermediate_size * (facts.experts_per_token if facts.is_moe and facts.experts_per_token else 1)
    return facts.hidden_size, mlp, facts.heads * facts.head_dim, facts.kv_heads * facts.head_dim


def _layer_bytes_per_token(facts: Any, tp: int = 1) -> float:
    """What autograd keeps per token for one decoder layer of a tp rank (bf16, fp32 norm upcasts; see the module
    docstring): the hidden-width tensors whole, the attention and MLP widths split over tp."""
    h, mlp, q, kv = _widths(facts)
    return 16 * h + (8 * mlp + 12 * q + 12 * kv) / tp


def _selective_bytes_per_token(facts: Any) -> float:
    """What selective checkpointing keeps per token for one decoder layer: its bf16 input and matmul/attention
    outputs (q, k, v, o, gate, up, down projections and the attention core)."""
    h, mlp, q, kv = _widths(facts)
    return 2 * (3 * h + 2 * q + 2 * kv + 2 * mlp)


def _activations(recipe: Any, role: str, facts: Any, cp: int) -> float:
    """One micro-batch's activations per GPU of `role`, its sequences split over `cp` ranks."""
    a, t = recipe.actor, recipe.train
    tp = a.mesh.tp
    dyn = getattr(t, "dynamic_batch", None)
    # the token budget is per data-parallel rank (max_tokens_per_gpu x cp x tp, G9), split over cp
    tokens = (dyn.max_tokens_per_gpu * a.mesh.cp if dyn is not None else t.micro_batch_size * recipe.data.max_len) / cp
    h, layers = facts.hidden_size, facts.layers
    layer_set = _layer_bytes_per_token(facts, tp) * tokens
    if role == "ref":
        acts = layer_set
    elif recipe.model.gradient_checkpoint == "full":
        kept = 2 * tokens * h * layers / (tp if a.sequence_parallel else 1)
        acts = kept + layer_set
    elif recipe.model.gradient_checkpoint == "selective":
        acts = _selective_bytes_per_token(facts) * tokens * layers / tp + layer_set
    else:
        acts = layer_set * layers
    chunk = min(tokens, LOGPROB_CHUNK_TOKENS)
    logits = 0.0 if role == "critic" else LOGIT_TENSORS_ALIVE * 4 * chunk * facts.vocab
    return acts + logits


def _engine_memory(recipe: Any, facts: Any, gpu: Any) -> EngineMemory:
    ro = recipe.rollout
    m = ro.mesh
    dtype_bytes = ENGINE_DTYPE_BYTES.get(ro.dtype, 2)
    n = facts.params_total
    expert = _expert_params(facts) if facts.is_moe else 0.0
    ep_split = m.dp if ro.expert_parallel else 1
    weights = dtype_bytes * ((n - expert) / (m.tp * m.pp) + expert / (m.tp * m.pp * ep_split))
    capacity = gpu.memory_gib * GIB
    kv_split = min(m.tp, max(facts.kv_heads, 1))
    kv_per_seq = facts.kv_bytes_per_token * recipe.data.max_len / kv_split / m.pp
    return EngineMemory(weights, ro.gpu_memory_utilization * capacity, kv_per_seq, capacity)
