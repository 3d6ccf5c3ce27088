"""`extends` reads only recipes inside the recipe roots, and no diagnostic prints a line of a file that is not a
recipe (issue 13.4: `/etc/passwd` and a planted secret appeared in text, JSON and GitHub annotations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from molt_compile.cli import cli
from molt_compile.load import ROOTS_ENV, load_recipe, project_root, recipe_roots

SECRET = "s3cr3t-token-do-not-print"


def run(*args: str):
    return CliRunner().invoke(cli, list(args), prog_name="molt-compile", catch_exceptions=False)


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp/repo (a git repository) with r.yaml, and tmp/outside with a secret in a YAML file and a plain file."""
    monkeypatch.delenv(ROOTS_ENV, raising=False)
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "recipes").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    # Both fail to parse as a recipe, so that a loader that read them would show their first line.
    (outside / "secret.yaml").write_text(f"- {SECRET}\n")
    (outside / "passwd").write_text(f"root:x:0:0:{SECRET}:/root:/bin/bash\n")
    (repo / ".env").write_text(f"TOKEN={SECRET}\n")
    return repo


def _recipe(repo: Path, target: str) -> Path:
    path = repo / "recipes" / "r.yaml"
    path.write_text(f"version: 1\nname: r\nkind: rl\nextends: {target}\n")
    return path


def _outputs(*args: str) -> list[str]:
    return [run(*args, "--format", fmt).output for fmt in ("text", "json", "github")]


@pytest.mark.parametrize("target", ["../../outside/passwd", "../../outside/secret.yaml", "/etc/passwd",
                                    "../.env", "../../outside/../outside/secret.yaml"])
def test_extends_outside_the_roots_or_not_a_recipe_is_refused_unread(layout, target):
    recipe = _recipe(layout, target)
    loaded = load_recipe(recipe)
    assert [(d.code, d.line, d.col) for d in loaded.diagnostics] == [("LOAD011", 4, 10)]
    assert loaded.files == [loaded.source.root_file]  # nothing but the recipe was read
    for out in _outputs(str(recipe)):
        assert "LOAD011" in out
        assert SECRET not in out and "root:x:0:0" not in out


def test_a_symbolic_link_out_of_the_repository_is_refused(layout):
    link = layout / "recipes" / "base.yaml"
    link.symlink_to(layout.parent / "outside" / "secret.yaml")
    recipe = _recipe(layout, "base.yaml")
    assert [d.code for d in load_recipe(recipe).diagnostics] == ["LOAD011"]
    # The recipe itself as a link (a planted recipes/x.yaml -> a secret) is not read either.
    for out in _outputs(str(link)):
        assert "LOAD011" in out and SECRET not in out


def test_named_roots_allow_a_base_outside_the_repository(layout, monkeypatch):
    shared = layout.parent / "shared"
    shared.mkdir()
    (shared / "b.yaml").write_text("cluster: {nodes: 2}\n")
    recipe = _recipe(layout, "../../shared/b.yaml")
    assert [d.code for d in load_recipe(recipe).diagnostics] == ["LOAD011"]
    assert load_recipe(recipe, roots=[shared]).data["cluster"] == {"nodes": 2}
    monkeypatch.setenv(ROOTS_ENV, f"/nonexistent:{shared}")
    assert load_recipe(recipe).data["cluster"] == {"nodes": 2}
    monkeypatch.delenv(ROOTS_ENV)
    result = run(str(recipe), "--recipe-root", str(shared), "--format", "json")
    assert "LOAD011" not in result.output


def test_a_base_inside_the_repository_still_shows_its_lines(layout):
    (layout / "base").mkdir()
    (layout / "base" / "b.yaml").write_text("cluster: !!python/object {nodes: 2}\n")
    out = run(str(_recipe(layout, "../base/b.yaml"))).output
    assert "YAML004" in out and "1 | cluster: !!python/object {nodes: 2}" in out


def test_a_file_that_is_not_a_recipe_is_never_shown(layout):
    """Named on the command line, a non-YAML file is parsed (the user chose it) but its lines are not printed."""
    for out in _outputs(str(layout.parent / "outside" / "passwd")):
        assert "LOAD004" in out and SECRET not in out


def test_project_root_is_the_nearest_repository_else_the_recipe_directory(tmp_path):
    (tmp_path / "proj" / "a" / "b").mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text("")
    assert project_root(tmp_path / "proj" / "a" / "b" / "r.yaml") == tmp_path / "proj"
    (tmp_path / "loose").mkdir()
    assert project_root(tmp_path / "loose" / "r.yaml") == tmp_path / "loose"
    assert recipe_roots(tmp_path / "loose" / "r.yaml", [tmp_path / "x", tmp_path / "x"]) == (
        tmp_path / "loose", tmp_path / "x")


def test_json_output_of_a_refused_base_is_positioned(layout):
    doc = json.loads(run(str(_recipe(layout, "/etc/passwd")), "--format", "json").output)
    (d,) = doc["diagnostics"]
    assert (d["code"], d["line"], d["path"], doc["summary"]["exit_status"]) == ("LOAD011", 4, "extends", 2)
