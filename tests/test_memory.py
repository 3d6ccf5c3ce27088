"""The memory estimate, checked against hand-computed numbers (formulas: molt_compile/memory.py)."""

from __future__ import annotations

from pathlib import Path

from molt_compile import memory
from molt_compile.compile import compile_recipe
from schemas.catalog import GPUS, MODELS

BASE = Path(__file__).parent / "rules" / "_base_rl.yaml"
GIB = 2**30


def test_fsdp_estimate_of_the_base_recipe_by_hand():
    r = compile_recipe(BASE, lower=False)
    report = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"])
    (group,) = report.fsdp_groups
    (actor,) = group.roles
    n, world, layers = 8_190_735_360, 4, 36
    assert abs(actor.params - (4 * n / world + 2 * 2 * n / layers)) < 1   # fp32 master shard + 2 bf16 layers
    assert abs(actor.grads - 4 * n / world) < 1                          # fp32 gradient shard
    assert abs(actor.optimizer - 8 * n / world) < 1                      # AdamW: 2 fp32 states
    tokens, h, vocab = 1 * 2048, 4096, 151936                            # micro 1 × max_len 2048, cp 1
    q, kv, mlp = 32 * 128, 8 * 128, 12288                                # heads × head_dim, kv heads × head_dim
    kept = 2 * tokens * h * layers                                       # checkpointed layer inputs, bf16
    working = (16 * h + 8 * mlp + 12 * q + 12 * kv) * tokens             # one layer recomputed
    logits = 3.5 * 4 * 1024 * vocab                                      # fp32 (chunk x vocab) tensors alive
    assert abs(actor.activations - (kept + working + logits)) < 1
    assert abs(group.total - (1.1 * actor.static + actor.activations + 2 * GIB)) < 1  # 10 % allocator slack
    assert 39.0 < group.total / GIB < 40.0                                # 39.6 GiB of 79.1


# Peak reserved memory of this project's trainer rank (FSDP2 world 1, fp32 master weights, bf16 compute, fused AdamW,
# two optimizer steps of two micro-batches), measured on one H200 by `tests/gpu/check_memory.py` on 2026-12-01 (selective: in a later run that day):
# (model shape, rows per micro-batch, sequence length, gradient_checkpoint, measured GiB).
H200_PEAKS = [
    ("qwen3-1.7b", 4, 4096, "full", 37.27),
    ("qwen3-1.7b", 2, 4096, "full", 34.30),
    ("qwen3-1.7b", 1, 8192, "full", 34.29),
    ("qwen3-1.7b", 2, 2048, "none", 45.04),
    ("qwen3-0.6b", 8, 2048, "full", 15.98),
    ("qwen3-0.6b", 2, 2048, "none", 21.56),
    ("qwen3-4b", 2, 4096, "full", 72.02),
    ("qwen3-1.7b", 4, 4096, "selective", 56.28),
    ("qwen3-1.7b", 2, 2048, "selective", 38.33),
    ("qwen3-0.6b", 8, 2048, "selective", 28.02),
    ("qwen3-4b", 2, 4096, "selective", 92.58),
]
SHAPES = {  # the random models the script trained (Qwen3 config.json fields; vocabulary 151,936, tied)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8),
    "qwen3-4b": (2560, 9728, 36, 32, 8),
}


def test_the_estimate_holds_against_peaks_measured_on_an_h200(tmp_path):
    import json

    ratios = []
    for shape, rows, seq, ckpt, measured in H200_PEAKS:
        h, inter, layers, heads, kv = SHAPES[shape]
        model = tmp_path / shape
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": h,
            "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 128, "tie_word_embeddings": True}))
        sets = [f"model.path={model}", f"train.micro_batch_size={rows}", f"data.max_len={seq}",
                f"model.gradient_checkpoint={ckpt}", "rollout.max_new_tokens=16",
                "actor.packing=false", "model.attn=sdpa"]  # the padded rows x sequence layout the peaks were measured in
        r = compile_recipe(Path(__file__).parents[1] / "recipes" / "demo_gpu.yaml", sets, lower=False)
        assert r.recipe is not None, r.diagnostics
        from molt_compile.memory import memory_report

        (group,) = memory_report(r.recipe, r.derived, r.loaded.source).fsdp_groups
        ratios.append((shape, rows, seq, ckpt, round(group.total / GIB / measured, 3)))
    assert all(0.9 <= ratio <= 1.25 for *_, ratio in ratios), ratios


def test_the_compiler_chunks_logits_and_the_host_step_as_the_runtime_does():
    from runtime.fsdp import HOST_STEP_CHUNK_BYTES
    from runtime.logprobs import LOGPROB_CHUNK_TOKENS

    assert memory.LOGPROB_CHUNK_TOKENS == LOGPROB_CHUNK_TOKENS
    assert memory.HOST_STEP_CHUNK_BYTES == HOST_STEP_CHUNK_BYTES


def test_offload_and_colocation_change_the_sum(tmp_path):
    (tmp_path / "r.yaml").write_text(f"extends: {BASE}\nactor: {{offload: optimizer}}\n"
                                     "algo: {kl: {coef: 0.001, estimator: k2, use_loss: true}}\n"
                                     "ref: {placement: colocate}\n")
    r = compile_recipe(tmp_path / "r.yaml", lower=False, roots=[BASE.parent])
    report = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"])
    (group,) = report.fsdp_groups
    actor, ref = group.roles
    assert (actor.role, ref.role) == ("actor", "ref")
    assert actor.optimizer == 0                                          # AdamW states on CPU
    assert ref.grads == 0 and ref.optimizer == 0                         # the reference model never trains
    assert abs(ref.params - actor.params) < 1                            # fp32 masters for the ref too (B22)
    assert abs(group.total - (1.1 * (actor.static + ref.static) + max(actor.activations, ref.activations)
                              + 2 * GIB)) < 1


def test_engine_share_weights_and_kv_by_hand():
    r = compile_recipe(BASE, lower=False)
    eng = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"]).engine
    assert eng.weights == 2 * 8_190_735_360                               # bf16, tp 1
    assert abs(eng.share - 0.95 * 79.1 * GIB) < 1
    assert eng.kv_per_sequence == 2 * 36 * 8 * 128 * 2 * 2048             # K,V × layers × kv heads × dim × bf16


def test_offload_moves_bytes_to_the_host_estimate(tmp_path):
    """GPU and host memory apart: offloaded shards and optimizer states leave the GPU sum and land on the host (AdamW:
    full 16 B per parameter over the world; optimizer 8 B plus the host step's four chunk buffers), times the ranks
    of a node (held against the node's RAM, MEM008)."""
    n, world, layers = 8_190_735_360, 4, 36
    totals = {}
    for level in ("none", "optimizer", "full"):
        (tmp_path / f"{level}.yaml").write_text(f"extends: {BASE}\nactor: {{offload: {level}}}\n")
        r = compile_recipe(tmp_path / f"{level}.yaml", lower=False, roots=[BASE.parent])
        report = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"])
        (group,) = report.fsdp_groups
        (actor,) = group.roles
        totals[level] = group.total
        assert report.host_capacity == 2048 * GIB                       # DGX H100's RAM, from the catalog
        chunks = 4 * max(memory.HOST_STEP_CHUNK_BYTES, 4 * 151_936 * 4096 / world)  # the host step's buffers
        expected_host = {"none": 0, "optimizer": 8 * n / world + chunks, "full": 16 * n / world}[level]
        assert abs(actor.host - expected_host) < 1
        assert abs(report.host_per_node - 4 * actor.host) < 1           # the actor's 4 ranks of the node
        if level == "full":
            assert abs(actor.params - 2 * 2 * n / layers) < 1 and actor.grads == 0 and actor.optimizer == 0
    assert totals["none"] > totals["optimizer"] > totals["full"]


def test_hsdp_keeps_dp_replicate_copies_of_the_state(tmp_path):
    """HSDP (actor.mesh.dp_replicate 2 of the base's 4 ranks): gradients and AdamW states shard over 2 ranks, not 4."""
    n, world = 8_190_735_360, 4
    (tmp_path / "r.yaml").write_text(f"extends: {BASE}\nactor: {{mesh: {{dp_replicate: 2}}}}\n")
    r = compile_recipe(tmp_path / "r.yaml", lower=False, roots=[BASE.parent])
    (group,) = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"]).fsdp_groups
    (actor,) = group.roles
    assert abs(actor.grads - 4 * n * 2 / world) < 1 and abs(actor.optimizer - 8 * n * 2 / world) < 1


def test_tensor_parallel_splits_the_state_and_the_attention_and_mlp_widths(tmp_path):
    """TP 2 over the base's 4 ranks (dp 2): the fp32 state shards over all 4 ranks (tp x dp), a gathered layer is
    half a layer, the hidden-width activations stay whole on each tp rank, q/k/v and MLP widths halve, and the
    log-prob chunk's logits are gathered whole (runtime/logprobs.py)."""
    n, world, layers = 8_190_735_360, 4, 36
    (tmp_path / "r.yaml").write_text(f"extends: {BASE}\nactor: {{mesh: {{tp: 2}}}}\n")
    r = compile_recipe(tmp_path / "r.yaml", lower=False, roots=[BASE.parent])
    (group,) = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"]).fsdp_groups
    (actor,) = group.roles
    assert abs(actor.params - (4 * n / world + 2 * 2 * n / layers / 2)) < 1
    assert abs(actor.grads - 4 * n / world) < 1 and abs(actor.optimizer - 8 * n / world) < 1
    tokens, h, vocab = 1 * 2048, 4096, 151936
    q, kv, mlp = 32 * 128, 8 * 128, 12288
    kept = 2 * tokens * h * layers                                       # no sequence parallelism: whole
    working = (16 * h + (8 * mlp + 12 * q + 12 * kv) / 2) * tokens
    logits = 3.5 * 4 * 1024 * vocab
    assert abs(actor.activations - (kept + working + logits)) < 1
