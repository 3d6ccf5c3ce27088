"""Recipe v1: the public YAML interface of Molt recipes.

Every field carries an attribute docstring; pydantic copies it into the JSON Schema (`molt-compile schema`),
so editors show it on hover and `molt-compile explain` prints it. Units live in names (`*_s`, `*_gb`,
`*_per_gpu`). Every section forbids unknown keys; the loader turns that into a did-you-mean diagnostic.

Defaults follow Molt's CLI (`reference/molt_rules.md` §1) with two deliberate exceptions, both about making
hidden switches explicit:
- a reference model exists only when the `ref:` section is present (Molt builds one whenever
  `--algo.kl.init_coef > 0`, and that coefficient defaults to 0.01);
- the vLLM executor is `auto`, which the compiler derives and reports (Molt derives it silently in the engine).

No cross-field checks live here: those are compiler rules with ids (`molt_compile/rules/`), so that each
one reports a position, a reason and a fix.

Why one module of ~880 lines: it is the public recipe format, section by section in the order a recipe is written,
and its attribute docstrings are read from this one file (`_attribute_docstrings`) into the JSON Schema and
`explain`; most of the lines are those docstrings.
"""

import re
import sys
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveFloat, field_validator

RECIPE_VERSION = 1
NAME_PATTERN = r"^[a-z0-9][a-z0-9-]*$"


@cache
def _attribute_docstrings(module_file: str) -> dict[str, dict[str, str]]:
    """Class name -> field name -> the string literal written right below the field.

    pydantic's `use_attribute_docstrings` does the same, but re-parses the module once per class
    (`inspect.getsource`), which made importing this module the slowest part of a cold compile.
    One parse here is ~5 ms, and only when a docstring is asked for (`field_docs`).
    """
    import ast
    import inspect

    with open(module_file, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for stmt, following in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                fields[stmt.target.id] = inspect.cleandoc(following.value.value)
    return docs


def field_docs(model: type[BaseModel]) -> dict[str, str]:
    """YAML key -> the docstring of that field, for a model of this module (bases first, so a subclass's own
    docstring wins). Read on demand (`molt-compile schema`, `explain`, a schema error's help), not at import: a
    compile that reports nothing about a key never parses this file."""
    docs = _attribute_docstrings(sys.modules[__name__].__file__ or "")
    out: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        for name, doc in docs.get(klass.__name__, {}).items() if klass.__module__ == __name__ else ():
            field = model.model_fields.get(name)
            if field is not None:
                out[field.alias or name] = doc
    return out


def _describe_fields(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The field docstrings as the JSON Schema's descriptions (pydantic calls this when it writes the schema)."""
    properties = schema.get("properties", {})
    for key, doc in field_docs(model).items():
        if key in properties:
            properties[key]["description"] = doc


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, docstrings become schema descriptions."""

    # defer_build: the validator is built on first use (a compile builds the recipe's, once).
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True, json_schema_extra=_describe_fields)


def section(model: type[BaseModel], *, alias: str | None = None, **values: Any) -> Any:
    """A nested section that defaults to its own defaults (with `values` in place of some). A factory, not an
    instance, and one that does not validate: an instance built while this module is imported, or a section left out
    of a recipe and filled in by `model()`, would build that model's own validator (on top of the recipe's, which
    holds it), in every compile. `model_construct` gives the equal object: pydantic validates no defaults, and the
    `values` are constants of this file. The JSON Schema still shows the default."""

    def default() -> BaseModel:
        return model.model_construct(**values)

    def schema_default(schema: dict[str, Any]) -> None:
        schema["default"] = model(**values).model_dump(mode="json", by_alias=True)

    return Field(default_factory=default, alias=alias, json_schema_extra=schema_default)


PositiveInt = Annotated[int, Field(ge=1)]
NonNegInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0.0, le=1.0)]
Cadence = Annotated[int, Field(ge=-1)]
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
EnvName = Annotated[str, Field(pattern=ENV_NAME_PATTERN)]
"""An environment variable name as POSIX shells accept it: `export A=B` and Ray's env_vars need no more, and a
key holding `=` or a space cannot be exported (it used to compile and then fail at `--submit`)."""


def _no_nul(value: str) -> str:
    if "\0" in value:
        raise ValueError(
            "an environment variable cannot hold a NUL byte (\\0): the process that starts the job could not pass it on"
        )
    return value


EnvValue = Annotated[str, AfterValidator(_no_nul)]
"""An environment variable value: any text but a NUL byte (it used to compile and then fail at `--submit`)."""
DatasetSpec = Annotated[str, Field(pattern=r"[^,\s]")]
"""Comma-separated dataset sources: at least one that is not blank (`" , "` named none and crashed the lowering)."""
"""A step cadence: N > 0 means every N steps, -1 means never. 0 is caught by rule CKPT001/EVAL001."""


# --------------------------------------------------------------------------------------------------- cluster
MAX_NODES = 16_384
MAX_DEVICES_PER_NODE = 256
"""Bounds on the counts that size the plan's lists (one entry per node, device, engine): past any real cluster, and a
typo such as 2**63 fails validation instead of having the compiler build lists until memory runs out."""


class Cluster(Section):
    nodes: Annotated[int, Field(ge=1, le=MAX_NODES)] = 1
    """Number of nodes the job gets (Slurm `--nodes`, or Ray nodes)."""
    gpus_per_node: Annotated[int, Field(ge=0, le=MAX_DEVICES_PER_NODE)] = 8
    """GPUs on each node. With `gpu: cpu` this counts CPU 'device slots' that roles are placed on."""
    gpu: str = "h100-80gb"
    """GPU model, a key of the GPU catalog (`schemas/catalog.py`), or `cpu` to run every role on CPUs."""
    cpus_per_node: PositiveInt | None = None
    """CPU cores per node available to Ray. None: taken from the GPU catalog's node profile."""


# --------------------------------------------------------------------------------------------------- model
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "prompt-mean-token-mean"]
AttnImpl = Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "te", "flex", "tilelang"]
Dtype = Literal["bf16", "fp16", "fp32"]
MoeDispatcher = Literal["torch", "deepep", "hybridep", "uccl_ep"]


class Model(Section):
    path: str
    """Policy checkpoint: a local directory or a hub name. Also the default for the reference model and critic."""
    arch: str | None = None
    """Architecture key of the model catalog. None: read `<path>/config.json` when the path is a local directory, else
    the catalog row whose hub id the path is (`Qwen/Qwen3-8B`); neither: MODEL005 names the checks that are off."""
    backend: Literal["automodel", "hf"] = "automodel"
    """Training backend: NVIDIA AutoModel custom implementation, or plain HF transformers (the fallback)."""
    attn: AttnImpl = "flash_attention_2"
    """Attention implementation of the FSDP models (Molt `--fsdp.attn_implementation`)."""
    param_dtype: Dtype = "bf16"
    """FSDP2 compute dtype. Master weights stay fp32."""
    gradient_checkpoint: Literal["full", "selective", "none"] = "full"
    """Activation checkpointing of the trained models. The reference model never checkpoints."""
    compile_layers: bool | None = None
    """Run each decoder layer's forward under `torch.compile` (inductor fuses the norms, rotary, activation and
    casts around the matmuls) in the trained and reference models. An extension of Molt recipes (Molt has no such
    flag). Compiles once, at the first step, for every batch shape; the numbers are those of the eager forward.
    None: derived (`explain` says why): on for a dense text model on the hf backend on GPUs, the path measured on
    the H200 (the trainer step 1.4x to 1.6x the eager one), off elsewhere."""
    router_dtype: Dtype = "fp32"
    """Compute dtype of the MoE routers (gates) under mixed precision (Molt `MOLT_GATE_PRECISION`, default
    float32): top-k choices are made in this precision. Their master weights are fp32 either way."""
    moe_dispatcher: MoeDispatcher = "torch"
    """Token dispatcher of the automodel backend's MoE layers under expert parallelism (Molt's env
    `MOLT_MOE_DISPATCHER`, default hybridep; here a recipe key). `torch`: nemo-automodel's DTensor all-gather /
    reduce-scatter, runs on any device and across nodes. `deepep`, `hybridep`: DeepEP's NVLink/RDMA kernels (CUDA,
    the `deep_ep` package; intra-node, rule MOE006); `uccl_ep`: UCCL-EP (CUDA, the `uccl` package)."""
    disable_fast_tokenizer: bool = False
    """Load the slow tokenizer."""


# --------------------------------------------------------------------------------------------------- meshes
class FsdpMesh(Section):
    tp: PositiveInt = 1
    """Tensor-parallel degree."""
    cp: PositiveInt = 1
    """Context-parallel degree (sequence sharding)."""
    ep: PositiveInt = 1
    """Expert-parallel degree (a separate MoE mesh). Must be > 1 for MoE checkpoints."""
    pp: PositiveInt = 1
    """Pipeline-parallel degree. Molt's trainers support only 1."""
    dp_replicate: PositiveInt = 1
    """HSDP: replicas of the data-parallel ranks (nemo-automodel's `dp_replicate` axis; not in Molt). FSDP2
    shards each parameter over dp / dp_replicate ranks and keeps dp_replicate copies of the shards, gradients
    averaged across them: less gathering traffic across nodes, more memory per GPU. Expert parallelism is unchanged
    (the experts shard over ep and world / ep)."""


class RolloutMesh(Section):
    tp: PositiveInt = 1
    """vLLM tensor-parallel size per engine."""
    pp: PositiveInt = 1
    """vLLM pipeline-parallel size per engine (needs the ray executor)."""
    dp: PositiveInt = 1
    """vLLM data-parallel size per engine (needs the mp executor, one node)."""


# --------------------------------------------------------------------------------------------------- optimizer
class Muon(Section):
    lr: float = Field(0.02, gt=0)
    """Learning rate of the Muon 2-D weight group."""
    momentum: float = Field(0.95, ge=0, lt=1)
    """Muon momentum (mu)."""
    weight_decay: float | None = None
    """Muon-group weight decay. None: use `optimizer.weight_decay`."""
    ns_steps: PositiveInt = 5
    """Newton-Schulz steps. AutoModel/Dion supports only 5 (rule OPTIM003)."""
    nesterov: bool = True
    """Nesterov momentum."""


Scheduler = str


class Optimizer(Section):
    name: Literal["adam", "muon"] = "adam"
    """Optimizer family. `adam` is AdamW; `muon` comes from AutoModel/Dion (AdamW for the non-2-D group)."""
    lr: float = Field(1.0e-6, gt=0)
    """AdamW learning rate (under Muon: the aux-AdamW group's)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = Field(1.0e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_norm: float = 1.0
    """Gradient-clip norm. <= 0 disables clipping."""
    scheduler: Scheduler = "constant"
    """Name passed to `transformers.get_scheduler`. Safe with Molt: constant, constant_with_warmup, cosine_with_min_lr."""
    warmup_ratio: float = Field(0.03, ge=0, le=1)
    """Warmup steps = ceil(total optimizer steps x ratio)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Floor of the LR as a fraction of `lr` (scheduler kwarg `min_lr_rate`)."""
    muon: Muon = section(Muon)
    """Muon settings; used only with `name: muon`."""


# --------------------------------------------------------------------------------------------------- actor
class Loss(Section):
    mode: Literal["ppo", "cispo", "gspo"] = "ppo"
    """Policy surrogate."""
    clip: tuple[float, float] = (0.2, 0.2)
    """PPO clip band (low, high) as offsets from 1. Under cispo the high value is an absolute ratio ceiling (>= 1)."""
    dual_clip: float | None = None
    """Dual-clip bound for negative advantages; > 1 and only with ppo. None: off."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient subtracted from the loss. 0: entropy is not computed."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """MoE load-balancing loss coefficient (active above 1e-8)."""
    router_z_loss_coef: float = Field(0.0, ge=0)
    """MoE router z-loss coefficient (ST-MoE: mean squared logsumexp of the router logits); 0: off."""
    agg_mode: LossAggMode = "token-mean"
    """How the policy-gradient term is averaged over one optimizer step's window, on all data-parallel ranks
    (Molt 0.2.1 `--actor.loss_agg_mode`): `token-mean` divides by the window's action tokens; `seq-mean-token-mean`
    averages each row over its tokens, then over the window's rows; `prompt-mean-token-mean` averages each prompt
    group over its tokens, then over the window's prompts. The KL loss and the entropy term stay token-mean."""


class Lora(Section):
    dim: int = 0
    """LoRA rank (Molt 0.2.1 `--actor.lora_dim` / `--model.lora_dim`). 0: full fine-tuning; a negative rank is
    rejected (LORA001: Molt silently treats it as off)."""
    alpha: int = 32
    """LoRA alpha; the adapter's scale is alpha / dim."""
    target_modules: list[str] | None = None
    """Wildcards matched against **full** module names (`*.q_proj`, `model.layers.*.mlp.down_proj`). None or empty:
    every linear layer. A bare leaf name such as `q_proj` matches nothing (LORA002)."""


class Freeze(Section):
    moe_router: bool = False
    """Freeze MoE router (gate) parameters."""
    visual_encoder: bool = False
    """VLM: train only the language model and the LM head."""


class Actor(Section):
    nodes: PositiveInt = 1
    """Nodes of the policy FSDP group (also sizes the critic)."""
    gpus_per_node: PositiveInt = 8
    """GPUs per node of the policy FSDP group (also sizes the critic)."""
    mesh: FsdpMesh = section(FsdpMesh)
    """FSDP2 / AutoModel parallel mesh. dp = world / (tp x cp) is derived."""
    sequence_parallel: bool = False
    """Sequence parallelism inside the TP region (illegal with the critic)."""
    packing: bool = False
    """Pack sequences without padding (THD / varlen)."""
    offload: Literal["none", "optimizer", "full"] = "none"
    """CPU offload: `optimizer` runs AdamW on CPU; `full` also offloads parameters."""
    optimizer: Optimizer = section(Optimizer)
    """Policy optimizer and LR schedule."""
    loss: Loss = section(Loss)
    """Policy loss."""
    freeze: Freeze = section(Freeze)
    """Parameters that are not trained."""
    freezing_steps: NonNegInt = 0
    """With gae only: no policy update during the first N steps while the critic warms up."""
    lora: Lora = section(Lora)
    """LoRA adapters on the policy (Molt 0.2.1): the adapter trains, the base stays frozen, each weight sync merges
    `W + scale·B@A` into the weights the engines get, and the HF export is a PEFT adapter directory."""


# --------------------------------------------------------------------------------------------------- ref / critic
class Ref(Section):
    path: str | None = None
    """Reference (KL-to-init) model, or the teacher for on_policy_distill. None: `model.path`."""
    placement: Literal["colocate", "separate"] = "colocate"
    """`colocate` shares the actor's GPUs (time-sliced); `separate` gets its own GPUs."""
    nodes: PositiveInt | None = None
    """Nodes of a separate reference group. None: the actor's."""
    gpus_per_node: PositiveInt | None = None
    """GPUs per node of a separate reference group. None: the actor's."""


class Critic(Section):
    path: str | None = None
    """Initial weights of the value model (the LM head becomes a scalar head). None: `model.path`."""
    placement: Literal["colocate", "separate"] = "colocate"
    """`colocate` shares the actor's GPUs; `separate` gets an actor-sized group of its own."""
    value_clip: float = Field(0.2, gt=0)
    """PPO value-clip range."""
    max_epochs: PositiveInt | None = None
    """Critic epochs per RL step. None: `train.max_epochs`."""
    optimizer: Optimizer = section(Optimizer, lr=5.0e-6)
    """Critic optimizer."""
    freeze_moe_router: bool = False
    """Freeze the critic's router (also frozen when `actor.freeze.moe_router`)."""


# --------------------------------------------------------------------------------------------------- rollout
class Rollout(Section):
    engine: Literal["vllm", "hf"] = "vllm"
    """Rollout engine: vLLM's async engine, or transformers generate (for machines without vLLM)."""
    engines: Annotated[int, Field(ge=1, le=MAX_NODES * MAX_DEVICES_PER_NODE)] = 1
    """Number of rollout engines."""
    placement: Literal["separate", "colocate"] = "separate"
    """`separate`: engines on GPUs of their own (Molt). `colocate`: engine i shares actor rank i's GPU (a hybrid
    engine, for one-GPU machines): one bundle holds both, weights reach the engine through CUDA IPC on GPUs (gloo
    on CPU), and the engine's `gpu_memory_utilization` is its share of that GPU."""
    mesh: RolloutMesh = section(RolloutMesh)
    """Parallel mesh of each engine; an engine uses tp x pp x dp GPUs."""
    expert_parallel: bool = False
    """vLLM TP+EP hybrid (EP = tp x dp per engine)."""
    executor: Literal["auto", "uni", "mp", "ray"] = "auto"
    """vLLM distributed executor. `auto`: uni for one GPU, mp when dp > 1, else ray (derived and reported)."""
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    """Engine dtype."""
    gpu_memory_utilization: Fraction = 0.95
    """Fraction of each engine GPU's memory vLLM may use."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    prefix_caching: bool = False
    """vLLM prefix KV cache (Molt turns vLLM's default off)."""
    chunked_prefill: bool | None = None
    """Chunked prefill. None: vLLM decides."""
    async_scheduling: bool | None = None
    """vLLM async scheduling. None: vLLM decides."""
    max_num_batched_tokens: PositiveInt | None = None
    """vLLM scheduler token budget. None: vLLM decides."""
    block_size: PositiveInt | None = None
    """KV block size. None: vLLM decides."""
    attention_backend: str | None = None
    """vLLM attention backend (FLASH_ATTN, FLASHINFER, TRITON_ATTN, FLEX_ATTENTION, ...). None: vLLM picks."""
    mm_encoder_attn_backend: str | None = None
    """Attention backend of the vision encoder (e.g. TORCH_SDPA)."""
    gdn_prefill_backend: Literal["flashinfer", "triton"] | None = None
    """GDN (linear-attention) prefill backend."""
    mamba_ssm_cache_dtype: Literal["auto", "float32", "float16"] | None = None
    """Recurrent-state cache dtype for hybrid models."""
    disable_custom_all_reduce: bool = False
    """Use NCCL instead of vLLM's custom all-reduce."""
    decode_context_parallel_size: PositiveInt = 1
    """vLLM decode context parallelism."""
    mtp_speculative_tokens: NonNegInt = 0
    """MTP speculative decoding tokens (needs an MTP head). 0: off."""
    router_policy: Literal["consistent_hash", "cache_aware", "round_robin", "power_of_two", "random"] = "cache_aware"
    """How requests are routed to engines (Molt 0.2.1's default: cache_aware, token-prefix affinity with a shortest-
    queue fallback when unbalanced). consistent_hash keeps a multi-turn rollout on one engine's KV cache."""
    router_balance_abs: NonNegInt = 10
    """cache_aware stays sticky until `max_inflight - min_inflight > abs` (and the ratio below) (Molt 0.2.1)."""
    router_balance_rel: float = Field(1.2, ge=1.0)
    """cache_aware: the ratio half of the rebalance trigger, `max_inflight > rel x min_inflight` (Molt 0.2.1)."""
    moe_backend: str | None = None
    """vLLM fused-MoE kernel backend (triton, flashinfer_trtllm, flashinfer_cutlass). None: vLLM picks. Passed to
    the engine only when set."""
    batch_size: PositiveInt = 1024
    """Prompt groups per training step."""
    generate_batch_size: PositiveInt | None = None
    """Prompt groups kept in flight by the streaming generator. None: `batch_size`."""
    n_samples_per_prompt: PositiveInt = 1
    """Rollouts per prompt (group size)."""
    max_new_tokens: PositiveInt | None = None
    """Per-turn generation cap. None: whatever context is left."""
    min_new_tokens: NonNegInt = 0
    """Tokens each turn generates before an end-of-sequence token may be sampled (vLLM's `min_tokens`; cut to the
    turn's cap). 0: off. Equal to `max_new_tokens` it makes every response full length, for throughput benchmarks;
    in training it changes what is sampled (SAMP002). Eval never uses it."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trained models divide their logits by it too."""
    top_p: Fraction = 1.0
    """Nucleus sampling. Must be 1.0 when IS correction is on."""
    runners: PositiveInt = 2
    """Agent runner processes (1 CPU each, spread over nodes)."""
    micro_batch_size: PositiveInt | None = None
    """Dead in Molt (read only by one CLI assertion). Setting it is reported (DEAD001)."""
    max_tokens_per_gpu: PositiveInt | None = None
    """Dead in Molt (never read). Setting it is reported (DEAD001)."""


# --------------------------------------------------------------------------------------------------- agent
class Agent(Section):
    path: str
    """Python file that defines `AgentRunner` (relative to the recipe file)."""
    max_turns: PositiveInt = 1
    """Turn limit of an episode (exported to runners as MAX_AGENT_TURNS)."""
    env: dict[EnvName, EnvValue] = {}
    """Environment variables of the agent runner processes (tool timeouts, model paths, ...)."""
    step_timeout_s: PositiveFloat = 120.0
    """Longest one `Env.step` may take; a step past it drops its rollout (reason `step_timeout`), also when the step
    blocks (`time.sleep`, a synchronous call): steps run on their own thread, abandoned at the bound."""
    episode_timeout_s: PositiveFloat = 600.0
    """Longest one episode (reset, every turn, every step) may take; past it the rollout is dropped (reason
    `episode_timeout`). A group whose runner has not answered by then gets a "late" line; one more minute (or this
    bound, when shorter) without an answer and the group is dropped as `episode_timeout`, the runner restarted."""
    max_prompt_attempts: PositiveInt = 2
    """Times a prompt is sent to a runner whose process then dies under it; then it is dropped (reason
    `agent_crash`), so one prompt that crashes the agent cannot use up every runner's restarts."""


# --------------------------------------------------------------------------------------------------- algo
class Kl(Section):
    coef: float = Field(0.0, ge=0)
    """KL coefficient (initial coefficient when adaptive). 0 (Molt 0.2.1's default; 0.1.6 used 0.01): no KL term."""
    ref: Literal["model", "rollout"] | None = None
    """What the KL is measured against (Molt 0.2.1 `--algo.kl.ref`): `model`, a frozen reference model (needs a
    `ref:` section), or `rollout`, the rollout engine's own log-probs of the sampled tokens (no reference model is
    built). None: `rollout`, or `model` under on_policy_distill (reported as EST015)."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL approximation with r = log pi - log pi_ref: k1 = r, k2 = r^2 / 2, k3 = e^-r - 1 + r against a model and
    e^r - 1 - r against the rollout policy (the form whose gradient descends KL(rollout || policy))."""
    use_loss: bool = False
    """KL as a separate loss term (true) or folded into the per-token reward (false)."""
    target: float | None = None
    """Adaptive KL controller target. None: fixed coefficient."""
    horizon: PositiveInt = 10000
    """Adaptive controller horizon, in samples."""


class IsCorrectionSection(Section):
    level: Literal["off", "token", "seq", "geo"] = "off"
    """Granularity of the train/rollout importance ratio; seq and geo are rejection filters."""
    mode: Literal["mask", "clip", "trunc"] = "mask"
    """What happens to units outside the band (seq and geo allow only mask)."""
    threshold: float | list[float] = [0.5, 5.0]
    """[low, high] band on the gating statistic; a single value HIGH means [-inf, HIGH] (Molt 0.2.1)."""
    gating: Literal["ratio", "binary_kl", "tv"] = "ratio"
    """The statistic the band tests (Molt 0.2.1): `ratio` = pi_train / pi_rollout; `binary_kl` = the Bernoulli KL
    between the sampled token's probability under the sampler and under the trainer; `tv` = their absolute
    difference. The divergences take an upper bound only, with mode mask at level token or seq."""


class DynamicFiltering(Section):
    range: tuple[float, float] = (0.0, 1.0)
    """Open interval (lo, hi) that a group's mean score must fall inside to be trained on."""


Estimator = Literal[
    "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo", "gae", "on_policy_distill", "flash_reinforce"
]


class Algo(Section):
    estimator: Estimator = "reinforce"
    """Advantage estimator. gae needs a critic; on_policy_distill needs a teacher (`ref:`). flash_reinforce
    (Molt 0.2.1): each sample's reward minus the batch mean, no whitening, discount or KL reward."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount (reinforce and gae)."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda."""
    whiten: bool = True
    """Whiten advantages over the batch (reinforce, reinforce_baseline, gae)."""
    reward_clip: tuple[float, float] = (-10.0, 10.0)
    """Clamp on each rollout's reward before the estimator."""
    kl: Kl = section(Kl)
    """KL penalty to the reference model."""
    is_correction: IsCorrectionSection = section(IsCorrectionSection)
    """Importance-sampling correction between the trainer's and the rollout engine's log-probs."""
    dynamic_filtering: DynamicFiltering | None = None
    """DAPO-style group filter on the mean score. Absent: off."""
    score_centering_top_k: int = 0
    """Score centering on the sampler's top-k log-probs of each generated token (Molt 0.2.1): the engine returns k
    (id, log-prob) pairs per token, the loss adds a head correction that makes the expected gradient zero where the
    head and a tail model are exact. 0: off; k must be >= 2 (SC001)."""
    overlong_buffer_len: float | None = None
    """DAPO overlong penalty (Molt 0.2.1 `--reward.overlong_buffer_len`): a rollout whose longest context exceeds
    `data.max_len - B` loses up to `overlong_penalty_factor` linearly over the last B tokens, before `reward_clip`.
    None: off."""
    overlong_penalty_factor: float = 1.0
    """Largest overlong penalty (reached at data.max_len). No effect without `overlong_buffer_len`."""
    stop_properly_penalty_coef: float | None = None
    """ProRL stop-properly penalty (Molt 0.2.1 `--reward.stop_properly_penalty_coef`) on truncated rollouts, before
    `reward_clip`: C >= 0 scales their reward by C, a negative C replaces it. At most 1. None: off."""


# --------------------------------------------------------------------------------------------------- train
class AsyncCfg(Section):
    queue_size: PositiveInt = 1
    """Depth of the rollout queue: how many batches generation may run ahead of training."""
    partial_rollout: bool = False
    """Generation does not wait for weight sync: engines are paused and resumed around it."""
    force_sync: bool = False
    """Free the rollout slot only after the training step and its weight sync."""
    colocated_gpus: Literal["overlap", "alternate"] = "overlap"
    """How colocated engines (`rollout.placement: colocate`) share their GPUs with the trainer. `overlap`: the
    engines keep generating (the next batch, or the groups carried over between batches) while the trainer trains,
    the two processes time-slicing each GPU. `alternate`: each training step (experience, critic and policy steps,
    weight sync) takes the engine lock and pauses the engines (in-flight requests kept), so the trainer has the GPUs
    alone and a step is generation + training + sync; needs `force_sync`, so the next batch starts after the sync."""


class DynamicBatch(Section):
    max_tokens_per_gpu: PositiveInt = 16192
    """Token cap per micro-batch (multiplied by cp x tp). Needs `actor.packing`."""


class RlTrain(Section):
    batch_size: PositiveInt = 128
    """Global samples per optimizer step."""
    micro_batch_size: PositiveInt = 1
    """Per-GPU micro-batch."""
    max_epochs: PositiveInt = 1
    """PPO epochs over each rollout batch."""
    episodes: PositiveInt = 1
    """Passes over the prompt dataset."""
    seed: int = 42
    """Seed; vLLM engine i uses seed + i."""
    full_determinism: bool = False
    """`transformers.enable_full_determinism` (slow)."""
    async_: AsyncCfg = section(AsyncCfg, alias="async")
    """Asynchronous pipeline settings."""
    force_on_policy: bool = False
    """Treat the whole rollout batch as one optimizer step (needs max_epochs 1). With algo.kl.coef 0 and no `ref:`,
    π_old is the training forward itself (no separate log-prob pass; the PPO ratio is 1, IS against the engine's
    log-probs still applies; Molt B28)."""
    routing_replay: bool = False
    """R3: replay vLLM's MoE routing in the training forward."""
    dynamic_batch: DynamicBatch | None = None
    """Build micro-batches by token budget. Absent: off."""
    rollout_dump_dir: str | None = None
    """Save each rollout batch here."""
    rollout_replay_dir: str | None = None
    """Train on dumped batches instead of generating."""
    check_weight_update_equal: bool = False
    """After each weight sync, report engine parameters the sync did not assign (`weight_sync/unassigned_params` and
    a warning naming them; the run goes on)."""
    stall_timeout_s: PositiveFloat = 1800.0
    """Longest any phase of the loop (a rollout batch, a training step, a weight sync, a save) may go without
    finishing before the run is ended as stalled, naming the actor and phase it waited on."""
    stop_timeout_s: PositiveFloat = 60.0
    """After SIGINT/SIGTERM, how long the current phase may take to finish before the run is torn down anyway."""

    # YAML spells the key `async` (a Python keyword, hence the alias). Only the alias is accepted as input, so a
    # recipe cannot write `async_`; dumps use the alias too, so the plan's resolved recipe keeps YAML key names.
    model_config = ConfigDict(validate_by_name=False, validate_by_alias=True, serialize_by_alias=True)


class SftTrain(Section):
    batch_size: PositiveInt = 128
    """Global samples per optimizer step."""
    micro_batch_size: PositiveInt = 8
    """Per-GPU micro-batch."""
    max_epochs: PositiveInt = 2
    """Epochs over the dataset."""
    seed: int = 42
    """Seed."""
    full_determinism: bool = False
    """`transformers.enable_full_determinism` (slow)."""


# --------------------------------------------------------------------------------------------------- data
class RlData(Section):
    prompts: DatasetSpec
    """Prompt sources, comma-separated (jsonl/json/csv/parquet files, save_to_disk dirs). Relative to the recipe."""
    prompt_probs: list[float] | None = None
    """Interleave probabilities, one per source."""
    split: str = "train"
    """Split name when a source is a dataset dict."""
    input_key: str = "input"
    """Prompt column (a string or a list of chat messages)."""
    label_key: str | None = None
    """Ground-truth column passed to the agent."""
    tools_key: str | None = None
    """Column of OpenAI tool schemas."""
    image_key: str = "images"
    """Image column (VLM)."""
    max_images_per_prompt: NonNegInt = 0
    """vLLM `limit_mm_per_prompt`; > 0 marks a VLM run."""
    apply_chat_template: bool = False
    """Rows are chat messages rendered with the tokenizer's chat template."""
    max_len: PositiveInt = 2048
    """Total context budget (prompt + all turns); also vLLM's max_model_len."""
    max_samples: PositiveInt = 100_000_000
    """Cap on prompts per source and on the blend."""
    dataloader_num_workers: NonNegInt = 0
    """Prompt dataloader workers."""


class SftData(Section):
    dataset: DatasetSpec
    """Training sources, comma-separated. Relative to the recipe."""
    dataset_probs: list[float] | None = None
    """Interleave probabilities."""
    split: str = "train"
    """Split name."""
    input_key: str = "input"
    """Prompt column: messages or a string."""
    output_key: str | None = None
    """Reply column: messages, a dict or a string."""
    chat_template: str | None = None
    """A .jinja path or a literal chat template overriding the tokenizer's."""
    train_on_last_turn_only: bool = False
    """Supervise only the last assistant turn."""
    image_key: str | None = None
    """Image column; setting it makes this a VLM SFT run."""
    max_images_per_prompt: NonNegInt = 4
    """Rows with more images are dropped."""
    max_len: PositiveInt = 2048
    """Sequence length."""
    max_samples: PositiveInt = 1_000_000
    """Cap on samples."""
    dataloader_num_workers: NonNegInt = 0
    """Dataloader workers."""


# --------------------------------------------------------------------------------------------------- eval
class RlEval(Section):
    dataset: DatasetSpec | None = None
    """Eval prompts. None: no eval."""
    split: str = "train"
    """Eval split."""
    every: Cadence = -1
    """Eval every N steps; -1: never."""
    at_start: bool = False
    """Baseline eval at step 0 on fresh runs."""
    only: bool = False
    """Score the eval set once and exit (no training models are built)."""
    batch_size: PositiveInt | None = None
    """Prompt groups per eval round. None: `rollout.batch_size`."""
    n_samples_per_prompt: PositiveInt | None = None
    """None: `rollout.n_samples_per_prompt`."""
    temperature: float | None = None
    """None: `rollout.temperature`."""
    top_p: float | None = None
    """None: `rollout.top_p`."""
    max_new_tokens: PositiveInt | None = None
    """None: `rollout.max_new_tokens`."""


class SftEval(Section):
    dataset: DatasetSpec | None = None
    """Eval dataset. None: no eval."""
    split: str = "train"
    """Eval split."""
    every: Cadence = -1
    """Eval every N steps; -1: once per epoch."""


# --------------------------------------------------------------------------------------------------- ckpt, logging
class Ckpt(Section):
    dir: str = "ckpt/state"
    """Resumable (torch DCP) checkpoint root."""
    hf_dir: str = "ckpt/hf"
    """Final HF export directory."""
    every: Cadence = -1
    """Save every N steps; -1: never."""
    keep: int = 3
    """Checkpoints kept (<= 0 keeps all)."""
    dcp_keep: int | None = None
    """DCP-only retention. None: `keep`."""
    max_disk_gb: float | None = None
    """Disk budget for retained checkpoints. None: unlimited."""
    save_hf: bool = False
    """Also write an HF snapshot at each save."""
    resume: bool = False
    """Resume from the newest loadable checkpoint."""
    final_save: bool = True
    """Export HF weights at the end."""
    best_metric_key: str = ""
    """Eval metric for best-checkpoint saves (`<ckpt.dir>/best`, replaced when an eval improves it; never pruned).
    "": `eval/pass1` (Molt: the first `*_pass1`); "none": off. One of `eval/pass1`, `eval/reward_mean`, `eval/pass@k`."""
    warm_resume_rollouts: bool = False
    """Save finished-but-untrained rollout groups so a resumed run reuses them."""


class Wandb(Section):
    project: str | None = None
    """wandb project. None: molt_train_rl / molt_train_sft."""
    entity: str | None = None
    """wandb entity (organisation)."""
    group: str | None = None
    """wandb group."""
    run_name: str | None = None
    """Run name. None: the recipe name."""
    key: str = "${env:WANDB_API_KEY}"
    """API key, only as a reference to an environment variable: `${env:NAME}` (never the key itself)."""
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """`offline` writes the run under `<output>/wandb/` for a later `wandb sync` (no network, no key needed);
    `online` needs the key; `auto`: online when the key's variable is set, else offline (`WANDB_MODE` wins)."""

    @field_validator("key")
    @classmethod
    def _key_is_a_reference(cls, v: str) -> str:
        if not re.fullmatch(r"\$\{env:[A-Za-z_][A-Za-z0-9_]*\}", v):
            # The message must not echo the value: it may be the secret itself.
            raise ValueError("must be a reference ${env:NAME} to an environment variable, not the key itself")
        return v


class Logging(Section):
    every: PositiveInt = 1
    """Log every N steps."""
    tensorboard_dir: str | None = None
    """TensorBoard directory. None: off."""
    wandb: Wandb | None = None
    """wandb settings. Absent: off."""


# --------------------------------------------------------------------------------------------------- launch
class RayLaunch(Section):
    address: str | None = None
    """Ray Jobs address (http://HOST:8265). None: a local Ray cluster is started for the job."""
    runtime_env: dict[str, object] = {}
    """Extra Ray runtime_env entries (pip, env_vars, ...)."""


class SlurmLaunch(Section):
    account: str | None = None
    """Slurm account."""
    partition: str | None = None
    """Slurm partition."""
    qos: str | None = None
    """Slurm quality of service (`#SBATCH --qos`)."""
    constraint: str | None = None
    """Node features the job needs (`#SBATCH --constraint`, e.g. `h100&ib`)."""
    mem: str | None = None
    """Memory per node (`#SBATCH --mem`): a size such as `500G`, or `0` for all of it."""
    output: str | None = None
    """Path pattern of the job's stdout (`#SBATCH --output`, `%j` is the job id), relative to the submit directory."""
    error: str | None = None
    """Path pattern of the job's stderr (`#SBATCH --error`). None: with stdout."""
    exclusive: bool = True
    """Whole nodes for the job (`#SBATCH --exclusive`)."""
    sbatch_options: list[str] = []
    """Extra `#SBATCH` options the recipe owns, each `--name` or `--name=value` (LAUNCH003 checks them)."""
    srun_options: list[str] = []
    """Extra flags of every `srun` step, each one word such as `--mpi=none` (LAUNCH003 checks them)."""
    time: str = "04:00:00"
    """Wall-clock limit in an sbatch `--time` format: minutes, HH:MM:SS, D-HH, D-HH:MM:SS, UNLIMITED (LAUNCH001)."""
    requeue: bool = False
    """Checkpoint and requeue near the time limit (RL): Slurm signals the job `requeue_signal_s` before it
    (`#SBATCH --signal=B:USR1@N`), the RL loop saves a checkpoint after its current step and exits, and the job
    requeues itself into the same job id, which resumes from that checkpoint (needs `ckpt.resume: true`, LAUNCH004)."""
    requeue_signal_s: PositiveInt = 300
    """With `requeue`: seconds before the time limit that Slurm sends the signal; longer than a step plus a
    checkpoint save take."""
    container_image: str | None = None
    """Pyxis/enroot container image. None: run on the host."""
    mounts: list[str] = []
    """Container mounts `src:dst`."""
    setup: list[str] = []
    """Shell lines run on every node before Ray starts (module loads, venv activation)."""
    ray_port: int = Field(6379, ge=1024, le=65535)
    """GCS port of the Ray head."""
    dashboard_port: int = Field(8265, ge=1024, le=65535)
    """Ray dashboard / Jobs API port."""
    master_port: int = Field(29500, ge=1024, le=65535)
    """SFT only: torchrun rendezvous port on the head node (Molt's SFT scripts use 29500, sft_omni3 29511)."""
    ready_timeout_s: PositiveInt = 600
    """How long the readiness barrier waits for every node and GPU."""


class Launch(Section):
    ray: RayLaunch = section(RayLaunch)
    """Ray Jobs submission."""
    slurm: SlurmLaunch = section(SlurmLaunch)
    """Slurm script rendering."""


# --------------------------------------------------------------------------------------------------- recipes
class _Common(Section):
    version: Literal[1]
    """Recipe format version."""
    name: Annotated[str, Field(pattern=NAME_PATTERN, max_length=63)]
    """Job name: lowercase letters, digits and dashes."""
    extends: str | list[str] | None = None
    """Base recipe(s), relative to this file; later wins, maps merge, lists replace."""
    description: str | None = None
    """One line on what this recipe trains."""
    cluster: Cluster = section(Cluster)
    """The cluster the job runs on."""
    model: Model
    """The trained model."""
    ckpt: Ckpt = section(Ckpt)
    """Checkpoints."""
    logging: Logging = section(Logging)
    """Metrics and logs."""
    env: dict[EnvName, EnvValue] = {}
    """Job-wide environment variables. Secrets only by reference: `${env:NAME}`."""
    launch: Launch = section(Launch)
    """How the job is launched."""
    ignore: dict[str, str] = {}
    """Per-rule suppressions `CODE: reason`. An ignore that suppresses nothing is reported."""


class RlRecipe(_Common):
    """A reinforcement-learning recipe: vLLM rollout engines, agents, one FSDP2 trainer, an async queue."""

    kind: Literal["rl"]
    """rl: reinforcement learning on Ray."""
    actor: Actor = section(Actor)
    """The trained policy's FSDP group."""
    ref: Ref | None = None
    """Reference model (KL) or distillation teacher. Absent: none."""
    critic: Critic | None = None
    """Value model (gae only). Absent: none."""
    rollout: Rollout = section(Rollout)
    """Rollout engines and sampling."""
    agent: Agent | None = None
    """The agent that turns prompts into rewarded trajectories. on_policy_distill may omit it."""
    algo: Algo = section(Algo)
    """Advantages, KL, importance sampling and filtering."""
    train: RlTrain = section(RlTrain)
    """Optimizer steps, batching and the async pipeline."""
    data: RlData
    """Prompt dataset."""
    eval: RlEval = section(RlEval)
    """Evaluation."""


class SftActor(Section):
    nodes: PositiveInt = 1
    """Nodes (one torchrun per node)."""
    gpus_per_node: PositiveInt = 8
    """GPUs per node (torchrun --nproc-per-node)."""
    mesh: FsdpMesh = section(FsdpMesh)
    """FSDP2 / AutoModel parallel mesh."""
    sequence_parallel: bool = False
    """Sequence parallelism inside the TP region."""
    packing: bool = False
    """Pack sequences without padding."""
    offload: Literal["none", "optimizer", "full"] = "none"
    """CPU offload level."""
    optimizer: Optimizer = section(Optimizer, lr=5.0e-6)
    """Optimizer and LR schedule."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """MoE load-balancing loss coefficient."""
    freeze: Freeze = section(Freeze)
    """Parameters that are not trained."""
    lora: Lora = section(Lora)
    """LoRA adapters on the trained model (Molt 0.2.1 `--model.lora_*`); the HF export is a PEFT adapter directory."""


class SftRecipe(_Common):
    """A supervised fine-tuning recipe: one torchrun per node, no Ray."""

    kind: Literal["sft"]
    """sft: supervised fine-tuning with torchrun."""
    actor: SftActor = section(SftActor)
    """The trained model's FSDP group."""
    train: SftTrain = section(SftTrain)
    """Batching and epochs."""
    data: SftData
    """Training data."""
    eval: SftEval = section(SftEval)
    """Evaluation."""


Recipe = Annotated[RlRecipe | SftRecipe, Field(discriminator="kind")]
"""A recipe: `kind: rl` or `kind: sft`."""
