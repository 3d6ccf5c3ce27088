"""Pass 1, load: a recipe file -> plain data + a SourceMap, with `extends` and `--set` resolved.

Reading is defensive because a recipe is untrusted text: the size cap is checked before the file is read, bytes
must be UTF-8, and each file's YAML becomes plain data with positions in `yaml_tree.py` (composed only, no
constructors; duplicate keys, tags and alias bombs refused there).

`extends` (a path or a list, relative to the file that says it) is resolved depth-first; later layers win;
mappings merge key by key, lists and scalars replace. A base reached twice (a diamond) is applied once, at its
first position. `extends` reads only `.yaml`/`.yml` files inside the recipe roots (the root recipe's repository
and the directories the user names, `recipe_roots`), checked on real paths before a target is opened, and only a
recipe's lines are kept for carets: a hostile recipe cannot make the diagnostics print another file.
`--set dotted.key=value` is applied last; its value is read as YAML and its key is checked against Recipe v1.
Every problem is a Diagnostic (codes in `codes.py`), never an exception.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.diagnostics import Diagnostic, Related
from molt_compile.source import Pos, SourceMap
from molt_compile.yaml_tree import Layer, diagnostic, parse_layer, parse_value

MAX_FILE_BYTES = 1 << 20
"""Size cap of one recipe file (1 MiB); recipes are a few KiB. Checked with stat() before reading."""


@dataclass
class Loaded:
    """The result of loading: the merged data (None when the file could not be read), where every value came
    from, and what went wrong."""

    data: dict[str, Any] | None
    source: SourceMap
    diagnostics: list[Diagnostic] = field(default_factory=list)
    key_positions: dict[str, Pos] = field(default_factory=dict)
    """Dotted path -> position of the *key* (the value's position is in `source`); for unknown-key carets."""
    overridden: dict[str, list[Pos]] = field(default_factory=dict)
    """Dotted path -> earlier positions of the same key in the bases that this value replaced."""
    files: list[str] = field(default_factory=list)
    """Every file read: the recipe first, then its bases in the order they were reached (display paths)."""
    extends_targets: list[Path] = field(default_factory=list)
    """Absolute paths of every base file reached through `extends`."""
    own_keys: frozenset[str] = frozenset()
    """Top-level keys written in the recipe file itself (not inherited)."""
    path: Path | None = None

    @property
    def ok(self) -> bool:
        return self.data is not None and not any(d.blocker for d in self.diagnostics)

    @property
    def is_fragment(self) -> bool:
        """Lives under a `base/` directory: a base fragment, not a job. (`lint` also treats a file that another
        recipe extends and that lacks `kind` or `name` as one; that needs the other files.)"""
        return self.path is not None and "base" in Path(os.path.abspath(self.path)).parts[:-1]


RECIPE_SUFFIXES = (".yaml", ".yml")
"""A recipe file's name ends so; only such files are read through `extends` and shown in diagnostics."""
ROOTS_ENV = "MOLT_RECIPE_ROOTS"
"""Extra recipe roots, separated by os.pathsep (`:`), added to `--recipe-root` and the project root."""


def find_project(path: Path | str) -> Path | None:
    """The root recipe's repository: its nearest ancestor directory holding `.git` or `pyproject.toml`, or None.
    Found from the path as given (not through symbolic links), so a link cannot move it."""
    start = Path(os.path.abspath(path)).parent
    for directory in (start, *start.parents):
        if (directory / ".git").exists() or (directory / "pyproject.toml").is_file():
            return directory
    return None


def project_root(path: Path | str) -> Path:
    """The recipe's repository (`find_project`), else the recipe's own directory."""
    return find_project(path) or Path(os.path.abspath(path)).parent


def recipe_roots(path: Path | str, extra: Sequence[Path | str] = ()) -> tuple[Path, ...]:
    """Directories whose recipes `extends` may read: the project root of `path`, the `extra` roots (the CLI's
    `--recipe-root`) and those in $MOLT_RECIPE_ROOTS. Resolved (real paths), because targets are compared resolved."""
    named = [*extra, *(p for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p.strip())]
    roots = [project_root(path), *(Path(p).expanduser() for p in named)]
    return tuple(dict.fromkeys(Path(os.path.realpath(r)) for r in roots))


def _inside(real: Path, roots: Sequence[Path]) -> bool:
    return any(real == r or real.is_relative_to(r) for r in roots)


def display_path(path: Path) -> str:
    """The path as diagnostics show it: relative to the working directory when inside it."""
    absolute = Path(os.path.abspath(path))
    try:
        return absolute.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return absolute.as_posix()


def _read_file(
    path: Path, file: str, diags: list[Diagnostic], at: Diagnostic | None, lines: dict[str, list[str]] | None = None
) -> str | None:
    """Read a recipe file's text with every check that can fail before parsing. `at` is the extends
    diagnostic template (position of the `extends` entry) when this is a base, None for the recipe itself."""
    try:
        st = path.stat()
    except OSError:
        if at is not None:
            diags.append(at)
        else:
            diags.append(
                diagnostic(
                    "LOAD001",
                    f"recipe file `{file}` does not exist",
                    file=file,
                    help="check the path; recipes live under recipes/",
                )
            )
        return None
    import stat

    if not stat.S_ISREG(st.st_mode):
        if at is not None:
            diags.append(at)
        else:
            what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            diags.append(
                diagnostic(
                    "LOAD002",
                    f"`{file}` is {what}, not a recipe file",
                    file=file,
                    help=f"to check every recipe under it: molt-compile lint {file}"
                    if stat.S_ISDIR(st.st_mode)
                    else "pass a .yaml recipe file",
                )
            )
        return None
    if st.st_size > MAX_FILE_BYTES:
        diags.append(
            diagnostic(
                "YAML007",
                f"`{file}` is {st.st_size:,} bytes; the recipe size cap is {MAX_FILE_BYTES:,} bytes",
                file=file,
                help="a recipe is a few KiB; is this the right file?",
            )
        )
        return None
    try:
        raw = path.read_bytes()[: MAX_FILE_BYTES + 1]
    except OSError as e:
        diags.append(diagnostic("LOAD001", f"cannot read `{file}`: {e.strerror}", file=file))
        return None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if lines is not None:
            lines[file] = raw.decode("utf-8", "replace").splitlines()  # only to show the line with a caret
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        diags.append(
            diagnostic(
                "YAML006",
                f"byte 0x{raw[e.start]:02x} at offset {e.start} is not valid UTF-8",
                file=file,
                line=line,
                col=col,
                help="save the file as UTF-8",
            )
        )
        return None


class _Tree:
    """Loads a recipe and its bases depth-first into layers, detecting cycles."""

    def __init__(self, diags: list[Diagnostic], source: SourceMap, roots: Sequence[Path]):
        self.diags = diags
        self.source = source
        self.roots = tuple(roots)
        self.layers: list[Layer] = []
        self.done: set[Path] = set()
        self.targets: list[Path] = []
        self.files: list[str] = []

    def load(self, path: Path, stack: tuple[tuple[Path, str], ...], at: Diagnostic | None) -> Layer | None:
        real = Path(os.path.realpath(path))
        file = display_path(path)
        # os.path's checks answer False, not OSError, for a name over NAME_MAX (an `extends` of 300 characters).
        if at is None and os.path.exists(real) and not _inside(real, self.roots):
            # The recipe itself is a symbolic link out of its repository (a planted recipes/x.yaml -> /etc/shadow).
            self.diags.append(
                diagnostic(
                    "LOAD011",
                    f"`{file}` links to a file outside the recipe roots; it was not read",
                    file=file,
                    help="compile the file it links to, inside its own repository, or "
                    f"name that directory with --recipe-root DIR or {ROOTS_ENV}=DIR",
                )
            )
            return None
        is_recipe = real.suffix in RECIPE_SUFFIXES
        text = _read_file(path, file, self.diags, at, self.source.lines if is_recipe else None)
        if text is None:
            return None
        self.done.add(real)
        self.files.append(file)
        if is_recipe:  # only a recipe's lines are ever shown under a diagnostic
            self.source.lines[file] = text.splitlines()
        layer, diags = parse_layer(text, file)
        self.diags.extend(diags)
        if layer is None:
            return None
        self._bases(layer, real, stack + ((real, file),))
        self.layers.append(layer)
        return layer

    def _bases(self, layer: Layer, real: Path, stack: tuple[tuple[Path, str], ...]) -> None:
        ext = layer.data.get("extends")
        if ext is None:
            return
        entries: list[tuple[str, str]]
        if isinstance(ext, str):
            entries = [("extends", ext)]
        elif isinstance(ext, list) and all(isinstance(x, str) for x in ext):
            entries = [(f"extends.{i}", x) for i, x in enumerate(ext)]
        else:
            p = layer.values.get("extends")
            self.diags.append(
                diagnostic(
                    "LOAD007",
                    "`extends` must be a path or a list of paths",
                    file=layer.file,
                    line=p.line if p else None,
                    col=p.col if p else None,
                    path="extends",
                    help="extends: base/rl.yaml   or   extends: [base/rl.yaml, base/8gpu.yaml]",
                )
            )
            return
        for key, target in entries:
            p = layer.values.get(key) or layer.values.get("extends") or Pos(layer.file, None, None)

            def at_entry(
                code: str, message: str, help: str, related: tuple[Related, ...] = (), at: Pos = p
            ) -> Diagnostic:
                """A diagnostic at this `extends` entry."""
                return diagnostic(
                    code, message, file=layer.file, line=at.line, col=at.col, path="extends", help=help, related=related
                )

            if "\0" in target:  # no file name holds one (the OS refuses the path before looking)
                self.diags.append(
                    at_entry(
                        "LOAD006",
                        f"`extends` target {target!r} holds a NUL character: it cannot name a file",
                        "remove the `\\0` escape from the path",
                    )
                )
                continue
            target_path = real.parent / target
            target_real = Path(os.path.realpath(target_path))
            chain = [f for _, f in stack]
            if any(target_real == s for s, _ in stack):
                self.diags.append(
                    at_entry(
                        "LOAD005",
                        f"`extends: {target}` makes a cycle: {' -> '.join(chain + [display_path(target_path)])}",
                        "remove this entry, or move the shared keys into a base that extends nothing",
                        related=tuple(Related("extends", f, None, None, "in the chain") for f in chain[:-1]),
                    )
                )
                continue
            if target_real in self.done:
                continue  # a diamond: the base was applied already, at its first position
            outside = not _inside(target_real, self.roots)
            # Checked before the file is opened; outside the roots not even its existence reaches the output.
            if outside or (target_real.suffix not in RECIPE_SUFFIXES and os.path.isfile(target_real)):
                why = (
                    "is outside the recipe roots (" + ", ".join(f"`{r}`" for r in self.roots) + ")"
                    if outside
                    else "is not a `.yaml` recipe file"
                )
                self.diags.append(
                    at_entry("LOAD011", f"`extends` target `{target}` {why}; it was not read", _ROOTS_HELP)
                )
                continue
            missing = at_entry(
                "LOAD006",
                f"`extends` target `{target}` is not a file (looked for `{display_path(target_path)}`)",
                "paths in `extends` are relative to the file that contains them",
            )
            self.targets.append(target_real)
            self.load(target_path, stack, missing)


_ROOTS_HELP = (
    f"extend recipes of this repository, or name another directory of trusted recipes with "
    f"--recipe-root DIR or {ROOTS_ENV}=DIR"
)


# ------------------------------------------------------------------------------------------------ merging
def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    """Later wins; mappings merge key by key, lists and scalars replace."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = _copy(value)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _paths(value: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        p = f"{prefix}.{k}" if prefix else str(k)
        out.add(p)
        out |= _paths(v, p)
    return out


# ------------------------------------------------------------------------------------------------ --set
def _recipe_type(data: dict[str, Any]) -> Any:
    from schemas.recipe import Recipe, RlRecipe, SftRecipe

    kind = data.get("kind")
    return {"rl": RlRecipe, "sft": SftRecipe}.get(kind, Recipe) if isinstance(kind, str) else Recipe


def _apply_set(
    item: str, data: dict[str, Any], values: dict[str, Pos], keys: dict[str, Pos], diags: list[Diagnostic]
) -> None:
    from molt_compile import schema_walk as sw

    key, eq, raw = item.partition("=")
    key = key.strip()
    segments: list[str | int] = [int(s) if s.isdigit() else s for s in key.split(".")] if key else []
    if not eq or not key or any(s == "" for s in segments):
        diags.append(
            diagnostic(
                "LOAD008",
                f"`--set {item}` is not of the form dotted.key=value",
                origin="--set",
                help="for example: --set train.async.queue_size=2",
            )
        )
        return
    root = _recipe_type(data)
    types, bad = sw.type_at(root, segments)
    if types is None:
        parent = ".".join(map(str, segments[:bad]))
        parent_types, _ = sw.type_at(root, segments[:bad])
        candidates = sw.keys_of(parent_types[0]) if parent_types and len(parent_types) == 1 else None
        for extra in (parent_types or [])[1:]:
            more = sw.keys_of(extra) or []
            candidates = (candidates or []) + [k for k in more if k not in (candidates or [])]
        wrong = str(segments[bad])
        guess = sw.closest(wrong, candidates or []) if candidates else None
        if guess:
            fixed = ".".join([*map(str, segments[:bad]), guess, *map(str, segments[bad + 1 :])])
            hint = f"did you mean `{fixed}`?"
        else:
            elsewhere = sw.sections_with_key(root, wrong)
            hint = (
                (f"`{wrong}` is a key of " + ", ".join(f"`{s}`" for s in elsewhere))
                if elsewhere
                else (f"`{parent or 'the recipe'}` has: " + ", ".join(candidates or []) if candidates else "")
            )
        where = f"`{parent}`" if parent else "the recipe"
        diags.append(
            diagnostic("LOAD009", f"`--set {key}`: {where} has no key `{wrong}`", path=key, origin="--set", help=hint)
        )
        return
    value, sink = parse_value(raw)
    if sink:
        reason = sink[0].message.removeprefix("YAML syntax error: ")
        diags.append(
            diagnostic(
                "LOAD010",
                f"`--set {item}`: the value is not valid YAML ({reason})",
                path=key,
                origin="--set",
                help=f"quote it if it is a string: --set {key}='\"{raw}\"'",
            )
        )
        return
    if not _assign(data, segments, value):
        parent = ".".join(map(str, segments[:-1]))
        diags.append(
            diagnostic(
                "LOAD009",
                f"`--set {key}`: `{parent}` has no item {segments[-1]} to set",
                path=key,
                origin="--set",
                help=f"set the whole list instead: --set {parent}=[...]",
            )
        )
        return
    for p in [p for p in values if p == key or p.startswith(key + ".")]:
        del values[p]
    for p in [p for p in keys if p == key or p.startswith(key + ".")]:
        del keys[p]
    values[key] = Pos(None, None, None, "--set")
    for p in _paths(value, key):
        values[p] = Pos(None, None, None, "--set")


def _assign(data: dict[str, Any], segments: list[str | int], value: Any) -> bool:
    """Set `value` at `segments`, creating missing mappings below the deepest existing collection. A list item
    must already exist. Returns False, and changes nothing, when the path cannot be made."""
    target: Any = data
    depth = 0
    while depth < len(segments) - 1:
        seg = segments[depth]
        present = (isinstance(target, dict) and seg in target) or (
            isinstance(target, list) and isinstance(seg, int) and seg < len(target)
        )
        if not present or not isinstance(target[seg], (dict, list)):
            break
        target = target[seg]
        depth += 1
    first, *created = segments[depth:]
    if any(isinstance(seg, int) for seg in created):
        return False  # an index into a list that is not there
    if isinstance(first, int) != isinstance(target, list) or (isinstance(first, int) and first >= len(target)):
        return False
    for seg in reversed(created):
        value = {seg: value}
    target[first] = value
    return True


# ------------------------------------------------------------------------------------------------ entry point
def load_recipe(path: Path | str, sets: Sequence[str] = (), roots: Sequence[Path | str] = ()) -> Loaded:
    """Load `path` with its bases and `--set` overrides. Never raises on bad input: see `Loaded.diagnostics`.
    `extends` reads only `.yaml` files inside `recipe_roots(path, roots)`."""
    path = Path(path)
    diags: list[Diagnostic] = []
    project = find_project(path)
    source = SourceMap(root_file=display_path(path), job_root=str(project) if project else None)
    tree = _Tree(diags, source, recipe_roots(path, roots))
    root = tree.load(path, (), None)
    loaded = Loaded(
        data=None, source=source, diagnostics=diags, files=tree.files, extends_targets=tree.targets, path=path
    )
    if root is None:
        return loaded
    loaded.own_keys = frozenset(root.data)

    data: dict[str, Any] = {}
    values: dict[str, Pos] = {}
    keys: dict[str, Pos] = {}
    for layer in tree.layers:
        own = {k: v for k, v in layer.data.items() if k != "extends"}
        for p in layer.values:
            if p in values and not p.startswith("extends"):
                loaded.overridden.setdefault(p, []).append(values[p])
        _merge(data, own)
        values.update(layer.values)
        keys.update(layer.keys)
    if "extends" in root.data:
        data["extends"] = _copy(root.data["extends"])
    present = _paths(data)
    values = {p: v for p, v in values.items() if p in present and (not p.startswith("extends") or v.file == root.file)}
    keys = {p: v for p, v in keys.items() if p in values}
    loaded.overridden = {p: v for p, v in loaded.overridden.items() if p in values}
    if not any(d.blocker for d in diags):
        for item in sets:
            _apply_set(item, data, values, keys, diags)
    source.positions = values
    loaded.key_positions = keys
    loaded.data = data
    return loaded
