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
    kept = 2 * tokens * h * layers                                       # checkpointed layer inputs, bf16
    working = 34 * tokens * h                                            # one layer recomputed (Korthikanti)
    logits = 2 * 4 * tokens * vocab                                      # fp32 logits + log-softmax
    assert abs(actor.activations - (kept + working + logits)) < 1
    assert abs(group.total - (actor.static + actor.activations + 2 * GIB)) < 1
    assert 36.0 < group.total / GIB < 37.0                                # 36.5 GiB of 79.1


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
    assert group.total == actor.static + ref.static + max(actor.activations, ref.activations) + 2 * GIB


def test_engine_share_weights_and_kv_by_hand():
    r = compile_recipe(BASE, lower=False)
    eng = memory.estimate(r.recipe, r.derived, MODELS["qwen3-8b"], GPUS["h100-80gb"]).engine
    assert eng.weights == 2 * 8_190_735_360                               # bf16, tp 1
    assert abs(eng.share - 0.95 * 79.1 * GIB) < 1
    assert eng.kv_per_sequence == 2 * 36 * 8 * 128 * 2 * 2048             # K,V × layers × kv heads × dim × bf16
