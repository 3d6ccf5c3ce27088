"""No import cycle in `molt_compile/`, `schemas/` or `runtime/` (issue 31).

Static analysis with `ast`, no import is executed. An edge A -> B is any import in module A of module B: at module
level and inside functions alike (a function-level import only moves the cycle to call time; it still couples the
two modules both ways). Not edges: imports under `if TYPE_CHECKING:` (never executed), and the package part of
`from pkg import submodule` (the submodule is the edge; Python has always started importing a module's own
ancestors before the module). `from pkg import Name` with `Name` defined in `pkg/__init__.py` is an edge to `pkg`.
A cycle is a strongly connected set of two or more modules; the test is one case per package so that a package's
case names its own cycles.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("molt_compile", "schemas", "runtime")


def _module_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            parts = list(file.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = file
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(module: str, file: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.level:  # relative: from the module's package (a package's __init__ is its own package)
        package = module.split(".") if file.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
    names_from_base = len(submodules) < len(node.names)
    return submodules | ({base} if names_from_base else set())


@cache
def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (see the module docstring for what counts)."""
    modules = _module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, file in modules.items():

        def visit(node: ast.AST, module: str = module, file: Path = file) -> None:
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    graph[module] |= {m for m in _imported(module, file, child, modules) if m in modules} - {module}
                visit(child)

        visit(ast.parse(file.read_text(), str(file)))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected sets of two or more modules (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_analysis_finds_a_cycle():
    """The detector itself: a two-module cycle, a three-module one, and an acyclic chain."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"g"}, "g": set()}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_function_level_imports_are_edges():
    graph = import_graph()
    assert "molt_compile.compile" in graph["molt_compile.cli"]  # imported inside `compile_cmd` only


@pytest.mark.parametrize(
    "package",
    [
        "molt_compile",
        "schemas",
        "runtime",
    ],
)
def test_no_import_cycle(package):
    found = [c for c in cycles(import_graph()) if any(m == package or m.startswith(package + ".") for m in c)]
    assert not found, f"import cycles through {package}: {found}"
