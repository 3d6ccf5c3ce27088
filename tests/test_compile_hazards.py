"""Issue 32, item 8 (the compile-time part), through the real `molt-compile` entry point: inputs that used to end
in a traceback end in a diagnostic (exit 1 or 2). DATA005 (a model path without weights, an absolute one that does
not exist) and DATA011 (rows past the 4 MiB scan) have their cases in tests/rules/."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from molt_compile.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str):
    return CliRunner().invoke(cli, list(args), prog_name="molt-compile", catch_exceptions=False)


def test_an_extends_name_over_255_characters_is_a_diagnostic(tmp_path, monkeypatch):
    (tmp_path / ".git").mkdir()
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nname: r\nkind: rl\nextends: {'a' * 300}\n")
    monkeypatch.chdir(tmp_path)
    result = run(str(recipe))  # was: OSError: [Errno 36] File name too long
    assert result.exit_code in (1, 2) and "LOAD006" in result.output


def test_a_nul_byte_in_an_env_value_stops_submit_at_compile(monkeypatch):
    monkeypatch.chdir(ROOT)
    result = run("recipes/demo_math.yaml", "--set", 'env.TOKEN="a\\0b"', "--submit")
    assert result.exit_code == 1 and "env.TOKEN" in result.output and "NUL byte" in result.output
    result = run("recipes/demo_math.yaml", "--set", 'agent.env.TOKEN="a\\0b"', "--submit")
    assert result.exit_code == 1 and "agent.env.TOKEN" in result.output and "NUL byte" in result.output
