"""Model-shape divisibility: a tensor-parallel degree must split the model's heads (issue 19).

Only exact catalog facts or config.json facts are used: a catalog field marked as an estimate (`ModelSpec.estimated`)
is never checked for divisibility. Expert counts against `actor.mesh.ep` are MOE003's; MoE checkpoints with
`actor.mesh.tp > 1` are MOE002's.
"""

from __future__ import annotations

from collections.abc import Iterator

from molt_compile.derive import Derived
from molt_compile.diagnostics import Diagnostic
from molt_compile.model_facts import model_facts, role_facts
from molt_compile.rules._base import diag, dv, fsdp_roles
from molt_compile.source import SourceMap
from schemas.recipe import RlRecipe, SftRecipe

VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`), then splits the padded rows over tp."""


def _exact(facts, *fields: str) -> bool:
    return all(f not in facts.estimated for f in fields)


def _divisors(n: int, limit: int = 16) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _vllm_shape_problem(heads: int, kv_heads: int, vocab: int, tp: int) -> str | None:
    """Why vLLM cannot shard a model of this shape over `tp` GPUs, or None. vLLM's own checks:
    `ModelConfig.verify_with_parallel_config` (heads % tp), `QKVParallelLinear` (kv_heads % tp when tp < kv_heads,
    else tp % kv_heads: KV heads are replicated), `VocabParallelEmbedding` (padded vocab % tp)."""
    if heads % tp:
        return f"its {heads} attention heads are not divisible by tp {tp}"
    if tp < kv_heads and kv_heads % tp:
        return f"its {kv_heads} KV heads are not divisible by tp {tp}"
    if tp >= kv_heads and tp % kv_heads:
        return f"tp {tp} is not a multiple of its {kv_heads} KV heads (vLLM replicates KV heads only evenly)"
    padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if vocab and padded % tp:
        return f"its vocabulary ({vocab}, padded to {padded}) is not divisible by tp {tp}"
    return None


def rollout_tp_does_not_split_the_model(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    With the vLLM engine, `rollout.mesh.tp` divides the policy's attention heads; it divides the KV heads when
    smaller than them, or is a multiple of them when larger (KV heads replicated); and it divides the vocabulary
    padded to a multiple of 64.

    ## Why it matters
    vLLM checks these when each engine starts: "Total number of attention heads (32) must be divisible by tensor
    parallel size (3)", and `QKVParallelLinear` / `VocabParallelEmbedding` assert the KV-head and vocabulary splits.
    The recipe compiles with only an idle-GPU warning otherwise, and every engine dies at start-up.

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}   # 32 heads, 8 KV heads
    rollout: {engines: 1, mesh: {tp: 3}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    rollout: {engines: 1, mesh: {tp: 4}}   # 1, 2, 4, 8, 16 or 32
    ```

    ## References
    vLLM 0.32: vllm/config/model.py `verify_with_parallel_config`; vllm/model_executor/layers/linear.py `QKVParallelLinear`;
    vllm/model_executor/layers/vocab_parallel_embedding.py; issue 19
    """
    tp = recipe.rollout.mesh.tp
    facts = model_facts(recipe, source)
    if recipe.rollout.engine != "vllm" or tp == 1 or facts is None or not _exact(facts, "heads", "kv_heads"):
        return
    vocab = facts.vocab if _exact(facts, "vocab") else 0
    problem = _vllm_shape_problem(facts.heads, facts.kv_heads or facts.heads, vocab, tp)
    if problem:
        good = [
            d
            for d in _divisors(facts.heads, 64)
            if _vllm_shape_problem(facts.heads, facts.kv_heads or facts.heads, vocab, d) is None
        ]
        yield diag(
            source,
            "rollout.mesh.tp",
            f"vLLM cannot shard {facts.key} over tp {tp}: {problem}",
            f"choose rollout.mesh.tp among {', '.join(map(str, good))}",
            ["model.arch", "model.path"],
        )


def actor_tp_does_not_split_the_model(
    recipe: RlRecipe | SftRecipe, derived: Derived, source: SourceMap
) -> Iterator[Diagnostic]:
    """## What it checks
    `actor.mesh.tp` divides the attention heads and the KV heads of every dense FSDP role's checkpoint (policy,
    reference/teacher, critic).

    ## Why it matters
    The trainer's tensor-parallel plan shards the q, k and v projections column-wise by heads: each rank holds
    `heads / tp` query and `kv_heads / tp` KV heads. Unlike vLLM, it has no KV-head replication, so an uneven split
    fails when the model's attention reshapes its projections (or computes with the wrong heads). MoE checkpoints
    need tp 1 anyway (MOE002).

    ## Example
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}   # 32 heads, 8 KV heads
    actor: {nodes: 1, gpus_per_node: 4, mesh: {tp: 16}}
    ```

    ## Use instead
    ```yaml
    model: {path: Qwen/Qwen3-8B, arch: qwen3-8b}
    actor: {nodes: 1, gpus_per_node: 4, mesh: {tp: 4}}   # a divisor of 8
    ```

    ## References
    molt_rules.md §2.G, H9 (AutoModel tensor-parallel plans; the HF fallback has no TP, PAR004); torch.distributed.tensor.parallel ColwiseParallel; issue 19
    """
    tp = recipe.actor.mesh.tp
    if tp == 1:
        return
    seen = set()
    for role in fsdp_roles(recipe, derived):
        facts = role_facts(recipe, source, role)
        if facts is None or facts.is_moe or facts.key in seen or not _exact(facts, "heads", "kv_heads"):
            continue
        seen.add(facts.key)
        kv = facts.kv_heads or facts.heads
        bad = [f"{n} {what}" for n, what in ((facts.heads, "attention heads"), (kv, "KV heads")) if n % tp]
        if bad:
            good = [d for d in _divisors(kv, 64) if facts.heads % d == 0]
            yield diag(
                source,
                "actor.mesh.tp",
                f"{role} model {facts.key}: its {' and '.join(bad)} are not divisible by actor.mesh.tp {tp}",
                f"choose actor.mesh.tp among {', '.join(map(str, good))}",
                ["model.arch" if role == "actor" else f"{role}.path"],
            )


def max_len_beyond_model_positions(recipe: RlRecipe, derived: Derived, source: SourceMap) -> Iterator[Diagnostic]:
    """## What it checks
    `data.max_len` (vLLM's `max_model_len`, B16) against the longest sequence the checkpoint's config.json allows,
    derived as vLLM derives it: the smallest of its position keys (`max_position_embeddings`, `n_positions`,
    `max_seq_len`, ..., `model_max_length` when present), times the RoPE scaling factor (not for yarn, llama3 or
    longrope, whose `max_position_embeddings` is already the scaled length), and no more than the tokenizer's
    `model_max_length`. Only where the config.json is readable: a catalog row does not say.

    ## Why it matters
    vLLM refuses to start: "User-specified max_model_len (X) is greater than the derived max_model_len" — after the
    job has its nodes, at step 0. Its override, `VLLM_ALLOW_LONG_MAX_MODEL_LEN`, gives NaNs for RoPE positions past
    the trained range. The hf engine and the trainer would compute those positions without a word, on the same
    untrained range.

    ## Example
    ```yaml
    # config.json: max_position_embeddings 4096, rope_scaling {rope_type: linear, factor: 2.0}: 8192 for vLLM
    model: {path: ./models/positions-4096-linear-x2, arch: null, attn: sdpa}
    rollout: {max_new_tokens: 1024}
    data: {max_len: 16384}
    ```

    ## Use instead
    ```yaml
    model: {path: ./models/positions-4096-linear-x2, arch: null, attn: sdpa}
    rollout: {max_new_tokens: 1024}
    data: {max_len: 8192}
    ```

    ## References
    vLLM `vllm/config/model.py` `_get_and_verify_max_len`; `model_arch_config_convertor.py`
    `derive_max_model_len_and_key`; molt_compile/model_facts.py `max_positions`
    """
    facts = model_facts(recipe, source)
    max_len = dv(derived, "rollout.max_model_len")
    if recipe.rollout.engine != "vllm" or facts is None or not facts.max_positions or not isinstance(max_len, int):
        return
    if max_len > facts.max_positions:
        yield diag(
            source,
            "data.max_len",
            f"vLLM serves {facts.key} ({facts.source}) up to {facts.max_positions} positions, and data.max_len "
            f"{max_len} asks for more: the engines refuse to start",
            f"set data.max_len: {facts.max_positions} or less, or train a checkpoint whose config.json allows the "
            "length (its max_position_embeddings, or RoPE scaling such as yarn)",
            ["model.path", "rollout.engine"],
        )
