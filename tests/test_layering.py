"""Import directions (DESIGN §2): compiling never imports torch, ray, vllm or transformers; `schemas` imports nothing
of ours but itself; `runtime` never imports `molt_compile`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "vllm", "transformers", "datasets", "pyarrow")


def _imports(tree: ast.AST, module_level_only: bool) -> list[tuple[str, int]]:
    """(top-level package, line) of every import; with `module_level_only`, skip imports inside functions and
    under `if TYPE_CHECKING:`."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if module_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if module_level_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name.split(".")[0], child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], child.lineno))
            visit(child)

    visit(tree)
    return found


def _modules(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return files


def test_compiler_and_schemas_import_nothing_heavy_at_module_level():
    offenders = []
    for package in ("schemas", "molt_compile"):
        for path in _modules(package):
            for name, line in _imports(ast.parse(path.read_text()), module_level_only=True):
                if name in HEAVY:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert offenders == []


def test_schemas_import_only_themselves():
    ours = {"molt_compile", "runtime", "tests", "recipes"}
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {name}"
                 for p in _modules("schemas") for name, line in _imports(ast.parse(p.read_text()), False)
                 if name in ours]
    assert offenders == []


def test_runtime_never_imports_the_compiler():
    offenders = [f"{p.relative_to(ROOT)}:{line}"
                 for p in _modules("runtime") for name, line in _imports(ast.parse(p.read_text()), False)
                 if name == "molt_compile"]
    assert offenders == []


def test_the_import_walker_sees_what_it_should():
    tree = ast.parse("import torch\nfrom ray import air\ndef f():\n    import vllm\n"
                     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import transformers\n")
    assert [n for n, _ in _imports(tree, True)] == ["torch", "ray", "typing"]
    assert [n for n, _ in _imports(tree, False)] == ["torch", "ray", "vllm", "typing", "transformers"]


_PROBE = """
import json, sys
from molt_compile.cli import main
recipe = sys.argv[1]
for args in ([recipe], [recipe, "--format", "json"], ["explain", recipe], ["lint", recipe]):
    sys.argv = ["molt-compile", *args]
    try:
        main()
    except SystemExit:
        pass
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {heavy})
print("HEAVY=" + json.dumps(heavy))
"""


def test_compiling_imports_no_heavy_module():
    recipe = ROOT / "recipes" / "glm5_ep256.yaml"
    if not recipe.exists():
        recipe = ROOT / "tests" / "data" / "good" / "rl_min.yaml"
    probe = _PROBE.replace("{heavy}", repr(set(HEAVY)))
    proc = subprocess.run([sys.executable, "-c", probe, str(recipe)], capture_output=True, text=True, cwd=ROOT)
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("HEAVY=")]
    assert marker, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(marker[0][len("HEAVY="):]) == []
    assert "checked 1 recipe" in proc.stdout  # the probe really compiled (lint ran last)
