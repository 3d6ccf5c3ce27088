"""What issue 32's 10,000-recipe fuzz campaign (`just fuzz`, tests/fuzz_recipes.py) found, each through the real
`molt-compile` entry point: a diagnostic and exit 1 or 2, never a traceback or a hang. The last test runs a few
dozen campaign recipes (each mutation family) in-process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from molt_compile.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def compile_text(tmp_path: Path, base: str, change: dict, *sets: str):
    """The shipped recipe `base` with `change` merged at the top level, written as JSON into the recipes folder's
    copy (its relative paths and `extends` still resolve)."""
    import shutil

    import yaml

    (tmp_path / ".git").mkdir(exist_ok=True)
    if not (tmp_path / "recipes").exists():
        shutil.copytree(ROOT / "recipes", tmp_path / "recipes", symlinks=True)
    doc = yaml.safe_load((ROOT / "recipes" / base).read_text())
    for key, value in change.items():
        node = doc
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    recipe = tmp_path / "recipes" / "fuzzed.yaml"
    recipe.write_text(json.dumps(doc) + "\n")  # ensure_ascii: characters past U+FFFF as \\u surrogate pairs
    return CliRunner().invoke(cli, [str(recipe), *(a for s in sets for a in ("--set", s))], prog_name="molt-compile",
                              catch_exceptions=False)


def test_a_blank_eval_dataset_is_a_schema_error_not_an_index_error(tmp_path):
    result = compile_text(tmp_path, "sft_qwen3_4b.yaml", {"eval.dataset": "\r\n"})  # was: IndexError in lowering
    assert result.exit_code == 1 and "eval.dataset" in result.output, result.output
    result = compile_text(tmp_path, "demo_math.yaml", {}, 'data.prompts=" , "')
    assert result.exit_code == 1 and "data.prompts" in result.output, result.output


def test_a_nul_byte_in_the_model_path_is_a_path_that_does_not_exist(tmp_path):
    result = compile_text(tmp_path, "demo_tool.yaml", {"model.path": "m\0odel"})  # was: ValueError in os.stat
    assert result.exit_code in (0, 1) and "model.path" in result.output, result.output  # DATA005: no weights


def test_a_nul_byte_in_an_extends_target_is_a_diagnostic(tmp_path):
    result = compile_text(tmp_path, "demo_math_distill.yaml", {"extends": "demo_math\0.yaml"})  # was: ValueError
    assert result.exit_code == 2 and "LOAD006" in result.output and "NUL" in result.output, result.output


def test_json_surrogate_pairs_are_characters_and_a_lone_half_is_a_diagnostic(tmp_path):
    result = compile_text(tmp_path, "demo_math.yaml", {"description": "grin \U0001f600"})
    assert result.exit_code == 0, result.output  # "\\ud83d\\ude00" in the JSON: one character
    result = compile_text(tmp_path, "demo_math_gae.yaml", {"extends": "\ud83d"})  # was: UnicodeEncodeError
    assert result.exit_code == 2 and "YAML006" in result.output and "surrogate" in result.output, result.output


@pytest.mark.parametrize("key", ["rollout.engines", "cluster.nodes", "cluster.gpus_per_node"])
def test_a_huge_count_is_a_schema_error_within_a_second(tmp_path, key):
    t0 = time.monotonic()
    result = compile_text(tmp_path, "demo_math.yaml", {}, f"{key}={2**63}")  # engines: was a list of 2**63 offsets
    assert result.exit_code == 1 and key in result.output, result.output
    assert time.monotonic() - t0 < 5


def test_a_step_count_past_float_range_is_counted_exactly(tmp_path):
    result = compile_text(tmp_path, "demo_sft.yaml", {}, f"train.max_epochs={2**1100}")  # was: OverflowError
    assert result.exit_code in (0, 1) and "Traceback" not in result.output, result.output


def test_a_few_campaign_recipes_give_no_traceback():
    from tests.fuzz_recipes import campaign

    found = campaign(60, seed=32, cli_every=20, subprocesses=0, quiet=True)
    assert found == {}, found
