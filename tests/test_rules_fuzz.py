"""Rules never crash: random combinations of the settings the rules read compile to diagnostics, never to an
internal error (a crashing check is turned into an 'internal error' diagnostic by run_rules, which fails here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_compile.compile import compile_recipe
from schemas.catalog import MODELS

RULES_DIR = Path(__file__).parent / "rules"
small = st.sampled_from([1, 2, 3, 4, 8, 16])

rl_override = st.fixed_dictionaries({
    "cluster": st.fixed_dictionaries({"nodes": st.sampled_from([1, 2, 4]), "gpus_per_node": st.sampled_from([4, 8]),
                                      "gpu": st.sampled_from(["h100-80gb", "l40s-48gb", "cpu", "h200-141gb"])}),
    "model": st.fixed_dictionaries({"arch": st.sampled_from(sorted(MODELS) + [None]),
                                    "path": st.sampled_from(["Qwen/Qwen3-8B", "./models/tiny-moe-mtp",
                                                             "./models/vlm-no-cp-hook", "/lustre/x"]),
                                    "backend": st.sampled_from(["automodel", "hf"]),
                                    "attn": st.sampled_from(["sdpa", "flash_attention_2", "te", "tilelang"])}),
    "actor": st.fixed_dictionaries({"nodes": st.sampled_from([1, 2]), "gpus_per_node": small,
                                    "packing": st.booleans(), "sequence_parallel": st.booleans(),
                                    "offload": st.sampled_from(["none", "optimizer", "full"]),
                                    "mesh": st.fixed_dictionaries({"tp": small, "cp": small, "ep": small,
                                                                   "pp": st.sampled_from([1, 2])}),
                                    "optimizer": st.fixed_dictionaries({"name": st.sampled_from(["adam", "muon"])})}),
    "rollout": st.fixed_dictionaries({"engines": small, "batch_size": small, "n_samples_per_prompt": small,
                                      "executor": st.sampled_from(["auto", "uni", "mp", "ray"]),
                                      "engine": st.sampled_from(["vllm", "hf"]),
                                      "mesh": st.fixed_dictionaries({"tp": small, "pp": st.sampled_from([1, 2]),
                                                                     "dp": st.sampled_from([1, 2])})}),
    "algo": st.fixed_dictionaries({"estimator": st.sampled_from(["reinforce", "grpo", "gae", "on_policy_distill",
                                                                 "rloo"]),
                                   "kl": st.fixed_dictionaries({"coef": st.sampled_from([0.0, 0.001]),
                                                                "use_loss": st.booleans()}),
                                   "is_correction": st.fixed_dictionaries({
                                       "level": st.sampled_from(["off", "token", "geo"]),
                                       "mode": st.sampled_from(["mask", "clip"])})}),
    "train": st.fixed_dictionaries({"batch_size": st.sampled_from([1, 8, 64, 100]), "force_on_policy": st.booleans(),
                                    "async": st.fixed_dictionaries({"queue_size": st.sampled_from([1, 2])})}),
    "ref": st.one_of(st.none(), st.fixed_dictionaries({"placement": st.sampled_from(["colocate", "separate"])})),
    "critic": st.one_of(st.none(), st.just({"placement": "colocate"})),
    "eval": st.fixed_dictionaries({"only": st.booleans(), "every": st.sampled_from([-1, 0, 5])}),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(override=rl_override)
def test_random_rl_recipes_never_crash_a_rule(tmp_path_factory, override):
    tmp = tmp_path_factory.mktemp("fuzz")
    for sub in ("agents", "data", "models"):
        shutil.copytree(RULES_DIR / sub, tmp / sub)
    shutil.copy(RULES_DIR / "_base_rl.yaml", tmp / "_base_rl.yaml")
    recipe = tmp / "r.yaml"
    recipe.write_text("extends: _base_rl.yaml\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in override.items()))
    result = compile_recipe(recipe, lower=False)
    assert not result.skipped_passes
    crashed = [d.message for d in result.diagnostics if "internal error" in d.message]
    assert not crashed, crashed
    assert result.recipe is not None, [(d.code, d.message) for d in result.diagnostics]
