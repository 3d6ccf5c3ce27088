"""Rules never crash: random combinations of the settings the rules read compile to diagnostics, never to an
internal error (a crashing check is turned into an 'internal error' diagnostic by run_rules, which fails here)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from fuzz_support import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from molt_compile import schema_walk as sw
from molt_compile.compile import compile_recipe
from schemas.catalog import MODELS
from schemas.recipe import RlRecipe

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


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(override=rl_override)
def test_random_rl_recipes_never_crash_a_rule(tmp_path_factory, override):
    tmp = tmp_path_factory.mktemp("fuzz")
    for sub in ("agents", "data", "models"):
        shutil.copytree(RULES_DIR / sub, tmp / sub)
    shutil.copy(RULES_DIR / "_base_rl.yaml", tmp / "_base_rl.yaml")
    recipe = tmp / "r.yaml"
    recipe.write_text("extends: _base_rl.yaml\n" + "\n".join(f"{k}: {json.dumps(v)}" for k, v in override.items()))
    result = compile_recipe(recipe, lower=False)
    crashed = [d.message for d in result.diagnostics if "internal error" in d.message]
    assert not crashed, crashed
    assert result.recipe is not None, [(d.code, d.message) for d in result.diagnostics]


# Any shape at any key: the 2 tracebacks of issue 13's 2,000-recipe campaign were `kind: []` and `kind: {}`, and an
# `env:` key holding `=` compiled and then crashed `--submit`. Values here are any JSON (lists, mappings, odd strings),
# written at real recipe paths (and at `kind`, `version`, the env mappings), in the file and through `--set`.
_PATHS = sorted({"kind", "version", "env", "agent.env", "extends", "model", "rollout", "train.async",
                 *sw.all_leaf_paths(RlRecipe)})
_ODD_TEXT = st.text(alphabet=st.sampled_from(list("aZ_09=- .:$[]{}'\"\\\n\x00é")), max_size=6)
_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**40), st.floats(allow_nan=True), _ODD_TEXT,
                    st.sampled_from(["rl", "sft", "auto", "1d", "2d", "00:10:00", "cpu"]))
_ANY = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_ODD_TEXT, inner, max_size=3),
                    max_leaves=6)
_ENV_KEYS = st.dictionaries(st.sampled_from(["env", "agent.env"]),
                            st.dictionaries(_ODD_TEXT, st.text(max_size=3), min_size=1, max_size=2), max_size=1)


def _nest(overrides: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for path, value in overrides.items():
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = value
    return doc


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("shapes")
    for sub in ("agents", "data", "models"):
        shutil.copytree(RULES_DIR / sub, tmp / sub)
    shutil.copy(RULES_DIR / "_base_rl.yaml", tmp / "_base_rl.yaml")
    return tmp


@settings(max_examples=examples(80), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(in_file=st.dictionaries(st.sampled_from(_PATHS), _ANY, max_size=3), env=_ENV_KEYS,
       kind=st.one_of(st.sampled_from(["(inherited)", "sft"]), _ANY),
       sets=st.lists(st.tuples(st.sampled_from(["kind", *_PATHS]), _ANY), max_size=2))
def test_any_value_shape_gives_diagnostics_never_a_traceback(fuzz_dir, in_file, env, kind, sets):
    recipe = fuzz_dir / "r.yaml"
    doc = {"extends": "_base_rl.yaml", **_nest(in_file)}
    if kind != "(inherited)":
        doc["kind"] = kind
    for key, value in env.items():
        _nest_into(doc, key, value)
    recipe.write_text(json.dumps(doc) + "\n")  # JSON is YAML
    set_args = [f"{k}={json.dumps(v)}" for k, v in sets]
    result = compile_recipe(recipe, set_args)  # raises on any traceback outside the rule catalog
    crashed = [d.message for d in result.diagnostics if d.code == "INTERNAL001" or "internal error" in d.message]
    assert not crashed, crashed
    assert result.exit_status in (0, 1, 2) and (result.exit_status == 0 or result.plan is None)
    if result.plan is not None:  # what compiles can be exported: every env name is a POSIX name
        plan = json.loads(result.plan.to_json())
        names = [k for e in _env_mappings(plan) for k in e]
        assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in names), names


def _nest_into(doc: dict[str, Any], path: str, value: Any) -> None:
    node = doc
    *parents, last = path.split(".")
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[last] = value


def _env_mappings(value: Any) -> list[dict[str, Any]]:
    """Every mapping under a key named `env` or `env_vars` in the plan."""
    found: list[dict[str, Any]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        if key in ("env", "env_vars") and isinstance(child, dict):
            found.append(child)
        found.extend(_env_mappings(child))
    return found
