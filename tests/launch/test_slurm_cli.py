"""`molt-compile RECIPE --slurm FILE`: the script is written with a hint to submit it; a value no Slurm script can
carry is a clear error (exit 2, the key named), never a traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from click.testing import CliRunner

from molt_compile.cli import cli

from .conftest import ROOT


def _run(args: list[str]) -> object:
    return CliRunner().invoke(cli, args, prog_name="molt-compile", catch_exceptions=False)


def test_slurm_flag_writes_a_script_and_says_how_to_submit_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "job.sbatch"
    result = _run(["recipes/demo_math.yaml", "--slurm", str(out)])
    assert result.exit_code == 0, result.output
    assert f"Slurm script written to {out}" in result.output
    assert f"sbatch {out}" in result.output
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    assert "#SBATCH --nodes=1" in out.read_text()


def test_without_slurm_installed_the_script_is_written_and_the_hint_says_so(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch on PATH
    out = tmp_path / "job.sbatch"
    result = _run(["recipes/demo_math.yaml", "--slurm", str(out)])
    assert result.exit_code == 0, result.output
    assert out.exists() and "sbatch is not installed on this machine" in result.output


def test_a_newline_in_an_sbatch_option_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    recipe = tmp_path / "bad.yaml"
    data = ROOT / "recipes" / "data" / "demo_math"
    recipe.write_text(json.dumps({
        "extends": str(ROOT / "recipes" / "demo_math.yaml"), "model": {"path": str(data / "model")},
        "agent": {"path": str(ROOT / "recipes" / "agents" / "demo_math.py")},
        "data": {"prompts": str(data / "train.jsonl")}, "eval": {"dataset": str(data / "eval.jsonl")},
        "launch": {"slurm": {"partition": "gpu\ntouch /tmp/pwned"}}}))
    out = tmp_path / "job.sbatch"
    result = CliRunner().invoke(cli, [str(recipe), "--slurm", str(out), "--recipe-root", str(ROOT)], prog_name="molt-compile")
    # Refused at compile time (LAUNCH003, at the key) rather than when the script is rendered.
    assert result.exit_code == 1, result.output
    assert "LAUNCH003" in result.output and "launch.slurm.partition holds a control character" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_a_script_without_account_or_partition_says_the_cluster_defaults_apply(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    out = tmp_path / "job.sbatch"
    result = _run(["recipes/demo_math.yaml", "--slurm", str(out)])
    assert "warning: launch.slurm.account and launch.slurm.partition are unset" in result.output
    result = _run(["recipes/demo_math.yaml", "--slurm", str(out), "--set", "launch.slurm.account=a",
                   "--set", "launch.slurm.partition=p"])
    assert result.exit_code == 0 and "are unset" not in result.output and "is unset" not in result.output
