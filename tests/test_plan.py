"""Plan v1: canonical JSON, fingerprint, round trip, immutability, and determinism across processes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from plan_support import PLAN_DATA, ROOT, lowered
from pydantic import ValidationError

from schemas.plan import Plan

RECIPES = ["rl_omni3_30b", "rl_qwen3_4b_slurm", "rl_glm5_ep256", "rl_distill_omni3_30b", "sft_qwen3_6_35b"]


@pytest.mark.parametrize("name", RECIPES)
def test_json_round_trip(name: str) -> None:
    plan, _ = lowered(PLAN_DATA / f"{name}.yaml")
    text = plan.to_json()
    back = Plan.from_json(text)  # full validation of every field
    assert back == plan
    assert back.to_json() == text
    assert back.fingerprint == plan.fingerprint == back.compute_fingerprint()


def test_fingerprint_is_sha256_of_canonical_json_without_it() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    data = json.loads(plan.to_json())
    assert data.pop("fingerprint") == plan.fingerprint
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(canonical.encode()).hexdigest() == plan.fingerprint
    assert list(data) == sorted(data)  # keys sorted


def test_edited_plan_is_rejected() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    data = json.loads(plan.to_json())
    data["rl"]["queue"]["size"] = 7
    with pytest.raises(ValueError, match="fingerprint does not match"):
        Plan.from_json(json.dumps(data))


def test_unknown_key_and_wrong_version_are_rejected() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    data = json.loads(plan.to_json())
    with pytest.raises(ValidationError, match="extra"):
        Plan.model_validate({**data, "surprise": 1})
    with pytest.raises(ValidationError):
        Plan.model_validate({**data, "schema_version": 2})


def test_plan_is_frozen() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    with pytest.raises(ValidationError):
        plan.name = "x"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        plan.rl.queue.size = 3  # type: ignore[misc]


def test_lookups() -> None:
    plan, _ = lowered(PLAN_DATA / "rl_omni3_30b.yaml")
    assert plan.role("actor").count == 16
    assert plan.derived_value("actor.dp") == 2
    assert plan.placement_group("rollout").strategy == "PACK"
    with pytest.raises(KeyError, match="roles: rollout.engine, router"):
        plan.role("critic")


_COMPILE = """
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from plan_support import lowered
for name in sys.argv[1:]:
    plan, _ = lowered(Path("tests/data/plan") / (name + ".yaml"))
    sys.stdout.write(plan.to_json())
"""


def test_two_processes_give_byte_identical_plans() -> None:
    """Different hash seeds change set/dict iteration order; the JSON must not change."""
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", _COMPILE, *RECIPES], cwd=ROOT, env=env, capture_output=True,
                             check=True)
        outs.append(res.stdout)
    assert outs[0] == outs[1] and len(outs[0]) > 10_000


def test_every_plan_field_is_documented() -> None:
    """Each field of every plan model is followed by its attribute docstring (the plan's documentation)."""
    import ast

    import schemas.plan as mod

    tree = ast.parse(open(mod.__file__).read())
    undocumented = []
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str) and nxt.value.value.strip()):
                    undocumented.append(f"{cls.name}.{node.target.id}")
    assert undocumented == []
