"""Stable codes of the diagnostics that the loader and the schema validator emit (the rule catalog has its own).

One explicit table, one docstring per code: `molt-compile rules YAML003` prints it. Codes are never reused; all of
them are blockers (exit status 2), because nothing after an unreadable or schema-invalid recipe can run.

    YAML...    the file could not be read as plain YAML data
    LOAD...    files, `extends` and `--set`
    SCHEMA...  the merged data does not match Recipe v1 (`schemas/recipe.py`)
    INTERNAL.. a pass of the compiler itself failed
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code:
    code: str
    name: str
    doc: str


LOADER_CODES: tuple[Code, ...] = (
    Code("YAML001", "yaml-syntax-error", """The file is not valid YAML (an unclosed bracket or quote, `a: b: c`, several
documents in one file, an undefined alias). The caret points where the parser gave up; the mistake is often on
the line before."""),
    Code("YAML002", "tab-indentation", """A tab character is used for indentation. YAML forbids tabs there; indent with
spaces."""),
    Code("YAML003", "duplicate-key", """The same key appears twice in one mapping. YAML parsers disagree on which one wins,
so a recipe must say it once. The diagnostic points at the second occurrence and names the first."""),
    Code("YAML004", "unsupported-tag", """A YAML tag other than the plain data tags (`!!str`, `!!int`, `!!float`,
`!!bool`, `!!null`, `!!map`, `!!seq`), for example `!!python/object:...` or `!include`. Recipes are plain data:
nothing is constructed or executed while loading. Also reported when a tagged value cannot be read as its tag
(`!!int abc`)."""),
    Code("YAML005", "alias-expansion-too-large", """Anchors and aliases (`&a`, `*a`) expand to more nodes than the
loader's budget, or an alias refers to itself. This is the "billion laughs" attack; the loader counts expanded nodes
and stops, so loading stays bounded in time and memory."""),
    Code("YAML006", "not-utf8", """The file contains bytes that are not UTF-8. Recipes are UTF-8 text; the caret
points at the first bad byte."""),
    Code("YAML007", "file-too-large", """The file is larger than the loader's size cap (1 MiB). A recipe is a few
kilobytes; the cap is checked before anything is parsed."""),
    Code("YAML008", "nesting-too-deep", """Mappings and lists are nested deeper than the loader allows (64 levels).
No recipe key is more than a few levels deep."""),
    Code("YAML009", "non-string-key", """A mapping key is not a string (`1: x`, `null: x`, `[a, b]: x`). Recipe keys are
names; quote the key if a number is meant as a name."""),
    Code("LOAD001", "file-not-found", """The recipe file does not exist (or cannot be read). The path on the command
line is relative to the working directory; `extends` targets have their own code, LOAD006."""),
    Code("LOAD002", "not-a-file", """The path names a directory or another non-regular file. `molt-compile lint DIR`
checks every recipe under a directory."""),
    Code("LOAD003", "empty-recipe", """The file holds no YAML document (it is empty or only comments)."""),
    Code("LOAD004", "top-level-not-a-mapping", """The document is a list or a scalar; a recipe is a mapping of sections
(`version: 1`, `name: ...`, `kind: ...`)."""),
    Code("LOAD005", "extends-cycle", """A recipe extends itself, directly or through its bases. The diagnostic points at
the `extends` entry that closes the cycle and lists the chain."""),
    Code("LOAD006", "extends-target-missing", """An `extends` entry names a file that does not exist (or is not a
file). Paths in `extends` are relative to the file that contains them."""),
    Code("LOAD007", "extends-bad-value", """`extends` must be a path or a list of paths."""),
    Code("LOAD008", "set-syntax", """A `--set` override is not of the form `dotted.key=value`."""),
    Code("LOAD009", "set-unknown-key", """A `--set` override names a key that Recipe v1 does not have. The help suggests the
closest key."""),
    Code("LOAD010", "set-bad-value", """The value of a `--set` override is not a valid YAML value (`--set a.b=[1,`).
Quote strings that contain YAML syntax."""),
    Code("LOAD011", "extends-outside-recipe-roots", """An `extends` entry (or the recipe itself, through a symbolic
link) names a file outside the recipe roots, or a file that is not a `.yaml`/`.yml` recipe. The loader does not
read it, so a recipe from an untrusted pull request cannot make the compiler print another file's lines. The recipe
roots are the root recipe's repository (its nearest ancestor directory holding `.git` or `pyproject.toml`, else its
own directory) and every directory named with `--recipe-root DIR` or in `MOLT_RECIPE_ROOTS` (separated by `:`)."""),
    Code("SCHEMA001", "unknown-key", """A key that this section does not have (usually a typo). The help suggests the
closest key in the section, or the section where a key of that name lives."""),
    Code("SCHEMA002", "wrong-type", """A value of the wrong type (`nodes: eight`, a mapping where a list is expected)."""),
    Code("SCHEMA003", "out-of-range", """A number outside its allowed range (`nodes: 0`, `gpu_memory_utilization: 1.5`),
or a list of the wrong length (`clip: [0.2]`)."""),
    Code("SCHEMA004", "missing-key", """A required key is missing (`model.path`, `data.prompts`, `kind`)."""),
    Code("SCHEMA005", "bad-enum-value", """A value that is not one of the allowed choices (`estimator: grpo2`). The help
lists the choices and suggests the closest one."""),
    Code("SCHEMA006", "bad-version", """`version` is missing or is not a version this compiler reads (1). Add
`version: 1` at the top of the recipe."""),
    Code("INTERNAL001", "internal-error", """A later pass (derive, rules, lower) raised an exception on a recipe that passed
the schema. That is a bug in molt-compile, not in the recipe; the message names the pass and the exception.
Set `MOLT_COMPILE_DEBUG=1` to get the traceback instead of this diagnostic."""),
    Code("SCHEMA007", "invalid-value", """A value of the right type that is still not allowed (a job name with capitals or
underscores, a string too long)."""),
)

CODES: dict[str, Code] = {c.code: c for c in LOADER_CODES}
"""Code -> its row, for `molt-compile rules CODE` and the renderer's `name`."""


def name_of(code: str) -> str:
    return CODES[code].name if code in CODES else ""
