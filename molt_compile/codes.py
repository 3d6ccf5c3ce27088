"""The catalog of diagnostic codes: one record type (`Code`), one diagnostic builder (`Code.diagnostic`).

Every code the compiler emits has one row, written once: the loader's and the schema validator's (below), the
rule catalog's (`molt_compile/rules/__init__.py`, `ALL_RULES`), the lowering's placement codes (PLACE1xx, below) and
the capability pass's (CAP001, below). `molt_compile.rules.catalog()` is all of them, sorted by code (beside the rule
table, which imports this module for `Code`); `molt-compile rules` walks it.
Codes are never reused.

    YAML...    the file could not be read as plain YAML data              (blockers: exit status 2)
    LOAD...    files, `extends` and `--set`                               (blockers)
    SCHEMA...  the merged data does not match Recipe v1 (`schemas/recipe.py`) (errors: the key is dropped and the
               other passes run on the rest; exit status 1)
    INTERNAL.. a pass of the compiler itself failed                       (blocker)
    rules      ASYNC, BATCH, EST, ... (molt_compile/rules/)               (error | warning | info)
    PLACE1xx   per-node placement in lowering (molt_compile/lower/)
    CAP001     the plan against the runtime's capability table (molt_compile/capability.py)
    CAP002     a capability row written for the plan's device kind but not run there (warning)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from molt_compile.diagnostics import Diagnostic, Related, Severity

if TYPE_CHECKING:
    from molt_compile.source import Pos, SourceMap

Check = Callable[..., Iterable[Diagnostic]]
"""A rule's check: `check(recipe, derived, source) -> Iterable[Diagnostic]` (see `molt_compile/rules/_base.py`)."""


@dataclass(frozen=True)
class Code:
    """One diagnostic code. A rule's row has its `check` (whose docstring is the documentation page) and the recipe
    `kinds` it applies to; every other row has its documentation in `text`."""

    code: str
    name: str
    severity: Severity
    check: Check | None = None
    kinds: tuple[str, ...] = ("rl",)
    """Recipe kinds a rule applies to."""
    blocker: bool = False
    """Input the compiler cannot go on with: exit status 2 instead of 1."""
    text: str = ""
    appendix: Callable[[], str] | None = None
    """A generated Markdown section after the page (CAP001: the capability table)."""

    @classmethod
    def blocking(cls, code: str, name: str, text: str) -> Code:
        """A loader, schema or internal code: always an error that stops the compile."""
        return cls(code, name, "error", blocker=True, text=text)

    @classmethod
    def schema(cls, code: str, name: str, text: str) -> Code:
        """A schema code: an error in the recipe (exit 1) that the compile recovers from (see validate.py)."""
        return cls(code, name, "error", text=text)

    def findings(self, *args: Any, **kwargs: Any) -> Iterable[Diagnostic]:
        """What a rule's check finds (only the rows of the rule catalog have a check)."""
        if self.check is None:
            raise TypeError(f"{self.code} is not a rule")
        return self.check(*args, **kwargs)

    @property
    def doc(self) -> str:
        import inspect  # only for documentation: a compile never reads it

        if self.check is not None:
            return inspect.getdoc(self.check) or ""
        return inspect.cleandoc(self.text)

    @property
    def area(self) -> str:
        """Which pass emits it: loader (and schema and internal), rule, placement or capability."""
        if self.check is not None:
            return "rule"
        if self.blocker or self.code.startswith("SCHEMA"):
            return "loader"
        return "capability" if self.code.startswith("CAP") else "placement"

    @property
    def summary(self) -> str:
        """The first sentence of what a code checks (a rule's "What it checks", another code's text): the `rules`
        table's column, a whole sentence, never a line cut where the docstring wrapped."""
        import re

        paragraph: list[str] = []
        for ln in self.doc.splitlines():
            if ln.startswith("#") or not ln.strip():
                if paragraph:
                    break
                continue
            paragraph.append(ln.strip())
        text = " ".join(paragraph)
        return re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", text, maxsplit=1)[0]

    def diagnostic(
        self,
        message: str,
        *,
        pos: Pos | None = None,
        path: str = "",
        help: str = "",
        related: Iterable[Related] = (),
    ) -> Diagnostic:
        """The diagnostic builder: this code's name, severity and blocker flag, at `pos` (where the value was
        written; its layer becomes `origin` when it was not written in a file), with the other keys involved."""
        return Diagnostic(
            code=self.code,
            severity=self.severity,
            message=message,
            path=path,
            file=pos.file if pos else None,
            line=pos.line if pos else None,
            col=pos.col if pos else None,
            help=help,
            related=tuple(related),
            name=self.name,
            blocker=self.blocker,
            origin="" if pos is None or pos.layer == "file" else pos.layer,
        )

    def at(
        self,
        source: SourceMap,
        path: str,
        message: str,
        help: str = "",
        related: Iterable[str | tuple[str, str]] = (),
    ) -> Diagnostic:
        """A diagnostic at recipe key `path`; `related` are other keys (`"a.b"` or `("a.b", "note")`)."""
        return self.diagnostic(
            message, pos=source.pos(path), path=path, help=help, related=related_keys(source, related)
        )


def related_keys(source: SourceMap, keys: Iterable[str | tuple[str, str]]) -> tuple[Related, ...]:
    """Other recipe keys of a diagnostic with where each was set."""
    out = []
    for item in keys:
        path, note = (item, "") if isinstance(item, str) else item
        pos = source.pos(path)
        out.append(Related(path, pos.file, pos.line, pos.col, note))
    return tuple(out)


LOADER_CODES: tuple[Code, ...] = (
    Code.blocking(
        "YAML001",
        "yaml-syntax-error",
        """The file is not valid YAML (an unclosed bracket or quote, `a: b: c`, several
documents in one file, an undefined alias). The caret points where the parser gave up; the mistake is often on
the line before.""",
    ),
    Code.blocking(
        "YAML002",
        "tab-indentation",
        """A tab character is used for indentation. YAML forbids tabs there; indent with
spaces.""",
    ),
    Code.blocking(
        "YAML003",
        "duplicate-key",
        """The same key appears twice in one mapping. YAML parsers disagree on which one wins,
so a recipe must say it once. The diagnostic points at the second occurrence and names the first.""",
    ),
    Code.blocking(
        "YAML004",
        "unsupported-tag",
        """A YAML tag other than the plain data tags (`!!str`, `!!int`, `!!float`,
`!!bool`, `!!null`, `!!map`, `!!seq`), for example `!!python/object:...` or `!include`. Recipes are plain data:
nothing is constructed or executed while loading. Also reported when a tagged value cannot be read as its tag
(`!!int abc`).""",
    ),
    Code.blocking(
        "YAML005",
        "alias-expansion-too-large",
        """Anchors and aliases (`&a`, `*a`) expand to more nodes than the
loader's budget, or an alias refers to itself. This is the "billion laughs" attack; the loader counts expanded nodes
and stops, so loading stays bounded in time and memory.""",
    ),
    Code.blocking(
        "YAML006",
        "not-utf8",
        """The file contains bytes that are not UTF-8. Recipes are UTF-8 text; the caret
points at the first bad byte. Also reported for a `\\uD800`-`\\uDFFF` escape in a quoted string that is not half of
a pair (JSON's way to write a character past U+FFFF): it is no character.""",
    ),
    Code.blocking(
        "YAML007",
        "file-too-large",
        """The file is larger than the loader's size cap (1 MiB). A recipe is a few
kilobytes; the cap is checked before anything is parsed.""",
    ),
    Code.blocking(
        "YAML008",
        "nesting-too-deep",
        """Mappings and lists are nested deeper than the loader allows (64 levels).
No recipe key is more than a few levels deep.""",
    ),
    Code.blocking(
        "YAML009",
        "non-string-key",
        """A mapping key is not a string (`1: x`, `null: x`, `[a, b]: x`). Recipe keys are
names; quote the key if a number is meant as a name.""",
    ),
    Code.blocking(
        "LOAD001",
        "file-not-found",
        """The recipe file does not exist (or cannot be read). The path on the command
line is relative to the working directory; `extends` targets have their own code, LOAD006.""",
    ),
    Code.blocking(
        "LOAD002",
        "not-a-file",
        """The path names a directory or another non-regular file. `molt-compile lint DIR`
checks every recipe under a directory.""",
    ),
    Code.blocking("LOAD003", "empty-recipe", """The file holds no YAML document (it is empty or only comments)."""),
    Code.blocking(
        "LOAD004",
        "top-level-not-a-mapping",
        """The document is a list or a scalar; a recipe is a mapping of sections
(`version: 1`, `name: ...`, `kind: ...`).""",
    ),
    Code.blocking(
        "LOAD005",
        "extends-cycle",
        """A recipe extends itself, directly or through its bases. The diagnostic points at
the `extends` entry that closes the cycle and lists the chain.""",
    ),
    Code.blocking(
        "LOAD006",
        "extends-target-missing",
        """An `extends` entry names a file that does not exist (or is not a
file). Paths in `extends` are relative to the file that contains them.""",
    ),
    Code.blocking("LOAD007", "extends-bad-value", """`extends` must be a path or a list of paths."""),
    Code.blocking("LOAD008", "set-syntax", """A `--set` override is not of the form `dotted.key=value`."""),
    Code.blocking(
        "LOAD009",
        "set-unknown-key",
        """A `--set` override names a key that Recipe v1 does not have. The help suggests the
closest key.""",
    ),
    Code.blocking(
        "LOAD010",
        "set-bad-value",
        """The value of a `--set` override is not a valid YAML value (`--set a.b=[1,`).
Quote strings that contain YAML syntax.""",
    ),
    Code.blocking(
        "LOAD011",
        "extends-outside-recipe-roots",
        """An `extends` entry (or the recipe itself, through a symbolic
link) names a file outside the recipe roots, or a file that is not a `.yaml`/`.yml` recipe. The loader does not
read it, so a recipe from an untrusted pull request cannot make the compiler print another file's lines. The recipe
roots are the root recipe's repository (its nearest ancestor directory holding `.git` or `pyproject.toml`, else its
own directory) and every directory named with `--recipe-root DIR` or in `MOLT_RECIPE_ROOTS` (separated by `:`).""",
    ),
    Code.schema(
        "SCHEMA001",
        "unknown-key",
        """A key that this section does not have (usually a typo). The help suggests the
closest key in the section, or the section where a key of that name lives.""",
    ),
    Code.schema(
        "SCHEMA002", "wrong-type", """A value of the wrong type (`nodes: eight`, a mapping where a list is expected)."""
    ),
    Code.schema(
        "SCHEMA003",
        "out-of-range",
        """A number outside its allowed range (`nodes: 0`, `gpu_memory_utilization: 1.5`),
or a list of the wrong length (`clip: [0.2]`).""",
    ),
    Code.schema("SCHEMA004", "missing-key", """A required key is missing (`model.path`, `data.prompts`, `kind`)."""),
    Code.schema(
        "SCHEMA005",
        "bad-enum-value",
        """A value that is not one of the allowed choices (`estimator: grpo2`). The help
lists the choices and suggests the closest one.""",
    ),
    Code.schema(
        "SCHEMA006",
        "bad-version",
        """`version` is missing or is not a version this compiler reads (1). Add
`version: 1` at the top of the recipe.""",
    ),
    Code.blocking(
        "INTERNAL001",
        "internal-error",
        """A later pass (derive, rules, lower) raised an exception on a recipe that passed
the schema. That is a bug in molt-compile, not in the recipe; the message names the pass and the exception.
Set `MOLT_COMPILE_DEBUG=1` to get the traceback instead of this diagnostic.""",
    ),
    Code.schema(
        "SCHEMA007",
        "invalid-value",
        """A value of the right type that is still not allowed (a job name with capitals or
underscores, a string too long).""",
    ),
)


PLACE_CODES: tuple[Code, ...] = (
    Code(
        "PLACE100",
        "cannot-lower",
        "error",
        text="""A value the plan needs could not be derived (for example dp when the world
size is not divisible by tp x cp, or no agent). The rule that explains why is reported too; fix that first.""",
    ),
    Code(
        "PLACE101",
        "bundle-larger-than-node",
        "error",
        text="""One Ray bundle needs more GPUs than any node has: an mp or uni
vLLM engine (tp x dp GPUs in one bundle) or a role on nodes with too few GPUs. Ray would wait forever for the
placement group (Molt I6/I7). Use the ray executor for engines that span nodes, lower tp x dp, or use bigger nodes.""",
    ),
    Code(
        "PLACE102",
        "cluster-full",
        "error",
        text="""A placement group does not fit in what the groups created before it left
free. Groups are placed in Molt's order (engines, then the FSDP groups), first-fit per node; the message gives the
GPUs needed and free per node. Add nodes, fewer engines, or colocate the ref/critic.""",
    ),
    Code(
        "PLACE103",
        "cpus-exhausted",
        "error",
        text="""A CPU-only actor (router, agent runner) finds no node with a free CPU
after the FSDP bundles (1 CPU each) took theirs. Lower rollout.runners or raise cluster.cpus_per_node.""",
    ),
    Code(
        "PLACE104",
        "group-split-across-nodes",
        "warning",
        text="""An EP or CP x TP group of consecutive ranks lands on two nodes
although its size divides the node size: earlier groups left a node partly used. Intra-node dispatch (hybridep,
deep_ep) across nodes fails with illegal memory access (§3.3). Give the FSDP group whole nodes (fewer or
differently sized engines).""",
    ),
    Code(
        "PLACE105",
        "sft-layout-exceeds-cluster",
        "error",
        text="""The SFT torchrun layout (actor.nodes x actor.gpus_per_node)
needs more nodes or GPUs per node than the cluster has.""",
    ),
)


def _capability_table() -> str:
    """The capability table as a Markdown section (for `molt-compile rules CAP001` and REFERENCE.md)."""
    from schemas.capabilities import CAPABILITIES  # only for documentation

    rows = ["| id | kind | recipe key | what | implemented on | write instead |", "|---|---|---|---|---|---|"]
    rows += [f"| {c.id} | {c.kind} | `{c.key}` | {c.what} | {_on(c)} | {c.instead} |" for c in CAPABILITIES]
    return "## The capability table\n\n" + "\n".join(rows)


def _on(cap) -> str:
    on = ", ".join(sorted(cap.devices)) or "none"
    return on + "".join(f"; {d} written, not run (CAP002)" for d in sorted(cap.unverified))


CAPABILITY = Code(
    "CAP001",
    "not-implemented-by-runtime",
    "error",
    kinds=("rl", "sft"),
    text="""## What it checks
A setting that this build of the runtime does not implement on the recipe's device kind (`cluster.gpu: cpu` runs
on CPUs, any GPU type on CUDA). The settings are the rows of the runtime's capability table,
`schemas/capabilities.py`; `molt-compile rules CAP001` lists them. The check runs on the lowered plan, after every
other rule, so it fires only for recipes that are otherwise valid.

## Why it matters
Molt supports these settings, so the other rules accept them; but a plan that asks for one would start, take its
allocation and Ray cluster, and then fail or silently train something else. The compiler says so before any GPU
is allocated, at the line that asks.

## Example
```yaml
actor: {mesh: {cp: 2}}
```

## Use instead
What the row's `instead` says, here `actor.mesh.cp: 1` — or a build of the runtime that implements it.

## References
schemas/capabilities.py; DESIGN.md §6 (capability table)
""",
    appendix=_capability_table,
)


CAPABILITY_UNVERIFIED = Code(
    "CAP002",
    "written-not-run-on-device",
    "warning",
    kinds=("rl", "sft"),
    text="""## What it checks
A setting whose runtime code is written for the recipe's device kind but that no test of this project has run on
it: a capability row's `unverified` device kinds (`schemas/capabilities.py`; the table of `molt-compile rules
CAP001` marks them "written, not run"). The warning names what was not run. Typically a CUDA path that the CPU
tests exercise with host and device one memory.

## Why it matters
The plan compiles and the runtime takes the path, but the first run on that device is its first test: read its
first steps' logs and numbers with care.

## Example
```yaml
cluster: {gpu: h200-141gb}
actor: {offload: optimizer}
```

## Use instead
The same recipe (the warning does not block), or what the row's `instead` says to stay on tested paths.

## References
schemas/capabilities.py; DESIGN.md §6 (capability table)
""",
)


BUILTIN: dict[str, Code] = {c.code: c for c in (*LOADER_CODES, *PLACE_CODES, CAPABILITY, CAPABILITY_UNVERIFIED)}
"""The codes of every pass but the rules, by code (importable without the rule catalog)."""
