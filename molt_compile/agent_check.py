"""Static checks of an agent file, without importing it (user code never runs at compile time).

`inspect_agent(path)` parses the file with `ast` and reports what the runtime's `load_agent_runner` would find
(molt_rules.md L1, L4-L6, §6.1). Accepted ways to define the runner, at module level:

1. `AgentRunner = StepEnvRunner(MyEnv)` / `ChatAgentRunner(MyAgent)` (also `agents.StepEnvRunner(...)`, an
   annotated assignment, or a call of a module-level class that derives from a runner class);
2. `class AgentRunner(StepEnvRunner | ChatAgentRunner | Runner)`, directly or through module-level classes
   (`class Base(StepEnvRunner)`, `class AgentRunner(Base)`), bases written as names or dotted attributes;
3. `AgentRunner = Other`, where `Other` is a module-level class or runner instance as in 1 or 2;
4. `from some.module import AgentRunner` (or `import ... as AgentRunner`): defined elsewhere, not verifiable here,
   accepted.

Anything else bound to `AgentRunner` (a literal, a lambda, a class with no runner base among resolvable bases) is
"not a runner". A call of an unknown or imported function, or a class with an imported base we cannot see, is
accepted (not verifiable statically). A chat-style runner (ChatAgentRunner, or `PRERENDER_PROMPT = False` in the
class body) needs `data.apply_chat_template` (L1). `StepEnvRunner(X)` / `ChatAgentRunner(X)` with `X` a
module-level class that does not derive from `Env` / `ChatAgent` is reported (L5, L6).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

RUNNER_BASES = {"Runner": "runner", "StepEnvRunner": "step", "ChatAgentRunner": "chat"}
ENV_BASES = {"StepEnvRunner": "Env", "ChatAgentRunner": "ChatAgent"}
AGENT_API = frozenset({"Env", "ChatAgent", "Runner", "StepEnvRunner", "ChatAgentRunner", "Result", "Trajectory"})
"""Names of the public agent API (`runtime.agents`): their bases are known even though they are imported."""


@dataclass(frozen=True)
class AgentInfo:
    """What the static inspection found. `problem`/`*_line` describe the first thing wrong, if any."""

    path: str
    exists: bool = True
    is_python: bool = True
    syntax_error: str | None = None
    syntax_line: int | None = None
    runner: str | None = None
    """'step', 'chat', 'runner' (a Runner subclass of unknown style), 'external' (imported/unverifiable), or None
    when `AgentRunner` is not defined at module level."""
    runner_line: int | None = None
    not_a_runner: str | None = None
    """Why the `AgentRunner` binding is not a runner (None when it is, or cannot be told)."""
    wrong_env: str | None = None
    """Why the class given to StepEnvRunner/ChatAgentRunner is not an Env/ChatAgent."""
    wrong_env_line: int | None = None

    @property
    def chat_style(self) -> bool:
        return self.runner == "chat"


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Module:
    def __init__(self, tree: ast.Module):
        self.classes: dict[str, ast.ClassDef] = {}
        self.assigns: dict[str, ast.Assign | ast.AnnAssign] = {}
        self.imported: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.assigns[target.id] = node
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self.assigns[node.target.id] = node
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    self.imported.add(alias.asname or alias.name.split(".")[0])

    def class_kind(self, name: str, seen: frozenset[str] = frozenset()) -> str | None:
        """Runner kind of a class name: via RUNNER_BASES, module classes (transitively), 'external', or None."""
        if name in RUNNER_BASES:
            return RUNNER_BASES[name]
        if name in seen or name not in self.classes:
            return "external" if name in self.imported else None
        cls = self.classes[name]
        kinds = [self.class_kind(b, seen | {name}) for b in (_name(base) for base in cls.bases) if b]
        for preferred in ("chat", "step", "runner", "external"):
            if preferred in kinds:
                if preferred == "runner" and _prerender_false(cls):
                    return "chat"
                return preferred
        return None

    def derives_from(self, name: str, base: str, seen: frozenset[str] = frozenset()) -> bool | None:
        """True/False when class `name` does/does not derive from `base`; None when a base is not visible here."""
        if name == base:
            return True
        if name == "object" or (name in AGENT_API and name != base):
            return False
        if name not in self.classes or name in seen:
            return None
        results = [
            self.derives_from(b, base, seen | {name}) if b else None
            for b in (_name(x) for x in self.classes[name].bases)
        ]
        if True in results:
            return True
        return None if None in results else False


def _prerender_false(cls: ast.ClassDef) -> bool:
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(_name(t) == "PRERENDER_PROMPT" for t in node.targets):
            return isinstance(node.value, ast.Constant) and node.value.value is False
    return False


def inspect_agent(path: str) -> AgentInfo:
    """Inspect the agent file at `path` (already resolved against the recipe's directory).

    Cached per (path, modification time), so a long-lived process sees edits."""
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError:
        stamp = None
    return _inspect(path, stamp)


@lru_cache(maxsize=32)
def _inspect(path: str, stamp: int | None) -> AgentInfo:
    p = Path(path)
    if not p.is_file():
        return AgentInfo(path, exists=False)
    if p.suffix != ".py":
        return AgentInfo(path, is_python=False)
    try:
        tree = ast.parse(p.read_text(encoding="utf-8"), filename=str(p))
    except (SyntaxError, ValueError, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        return AgentInfo(path, syntax_error=getattr(exc, "msg", str(exc)), syntax_line=line)
    mod = _Module(tree)
    if "AgentRunner" in mod.classes:
        cls = mod.classes["AgentRunner"]
        kind = mod.class_kind("AgentRunner")
        why = None if kind else "class AgentRunner does not derive from Runner, StepEnvRunner or ChatAgentRunner"
        return AgentInfo(path, runner=kind, runner_line=cls.lineno, not_a_runner=why)
    if "AgentRunner" in mod.assigns:
        node = mod.assigns["AgentRunner"]
        return _from_value(path, mod, node.value, node.lineno)
    if "AgentRunner" in mod.imported:
        return AgentInfo(path, runner="external")
    return AgentInfo(path)


inspect_agent.cache_clear = lambda: _inspect.cache_clear()  # type: ignore[attr-defined]


def _from_value(path: str, mod: _Module, value: ast.AST | None, line: int, depth: int = 0) -> AgentInfo:
    if isinstance(value, ast.Call):
        callee = _name(value.func)
        kind = mod.class_kind(callee) if callee else None
        if kind is None or callee is None:
            return AgentInfo(path, runner="external", runner_line=line)  # a factory we cannot see: trusted
        env = _wrong_env(mod, callee, value)
        return AgentInfo(path, runner=kind, runner_line=line, wrong_env=env, wrong_env_line=line if env else None)
    if isinstance(value, (ast.Name, ast.Attribute)) and depth < 5:
        name = _name(value)
        if name in mod.classes or name in RUNNER_BASES:
            kind = mod.class_kind(name)
            why = None if kind else f"AgentRunner = {name}, a class that is not a Runner"
            return AgentInfo(path, runner=kind, runner_line=line, not_a_runner=why)
        if name in mod.assigns:
            return _from_value(path, mod, mod.assigns[name].value, line, depth + 1)
        return AgentInfo(path, runner="external", runner_line=line)
    what = type(value).__name__.lower()
    return AgentInfo(
        path,
        runner=None,
        runner_line=line,
        not_a_runner=f"AgentRunner is bound to a {what}, not a Runner class or instance",
    )


def _wrong_env(mod: _Module, callee: str, call: ast.Call) -> str | None:
    base = ENV_BASES.get(callee)
    if base is None or not call.args:
        return None
    arg = _name(call.args[0])
    if arg is None or arg not in mod.classes:
        return None
    if mod.derives_from(arg, base) is False:
        return f"{callee}({arg}): {arg} does not derive from {base}"
    return None
