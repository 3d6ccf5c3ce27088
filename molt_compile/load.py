"""Pass 1, load: a recipe file -> plain data + a SourceMap, with `extends` and `--set` resolved.

Reading is defensive because a recipe is untrusted text: the size cap is checked before the file is read,
bytes must be UTF-8, the YAML is only *composed* (ruamel.yaml's safe composer, no constructors run), and plain
Python data is then built here from the node tree. The pure-Python parser is the reference; libyaml (ruamel.yaml.clib)
composes only text in a subset where the two agree (`_libyaml_agrees`: argued there, fuzzed in tests/test_load.py),
and anything libyaml refuses goes to the pure parser, so every diagnostic is the pure parser's. That is where the loader
- keeps `file:line:col` of every key and value (the SourceMap, dotted YAML paths like `train.async.queue_size`,
  list items as `algo.reward_clip.0`);
- rejects what plain data cannot hold: duplicate keys, non-string keys, `!!python/...` and other tags;
- counts nodes while expanding aliases, so an alias bomb stops at a budget instead of eating the machine.

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
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molt_compile.codes import BUILTIN
from molt_compile.diagnostics import Diagnostic, Related
from molt_compile.source import Pos, SourceMap

MAX_FILE_BYTES = 1 << 20
"""Size cap of one recipe file (1 MiB); recipes are a few KiB. Checked with stat() before reading."""
MAX_NODES = 10_000
"""Budget of YAML nodes built per file, aliases expanded; an alias bomb stops here. The largest shipped
recipe builds under 200."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""

_T = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = _T + "str", _T + "int", _T + "float", _T + "bool", _T + "null"
_MAP, _SEQ, _MERGE, _TIMESTAMP = _T + "map", _T + "seq", _T + "merge", _T + "timestamp"


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


def _diag(
    code: str,
    message: str,
    *,
    file: str | None = None,
    line: int | None = None,
    col: int | None = None,
    path: str = "",
    help: str = "",
    related: tuple[Related, ...] = (),
    origin: str = "",
) -> Diagnostic:
    pos = Pos(file, line, col, origin or "file")
    return BUILTIN[code].diagnostic(message, pos=pos, path=path, help=help, related=related)


class _Abort(Exception):
    """Stops building one file's data (budget exceeded, too deep, recursive alias)."""

    def __init__(self, diag: Diagnostic):
        self.diag = diag


@dataclass
class _Layer:
    """One file's own data and positions, before merging."""

    file: str
    data: dict[str, Any]
    values: dict[str, Pos]
    keys: dict[str, Pos]


class _Builder:
    """Builds plain Python data from a composed ruamel node tree, recording positions and rejecting non-data."""

    def __init__(self, file: str | None, diags: list[Diagnostic], record: bool = True):
        self.file = file
        self.diags = diags
        self.record = record
        self.values: dict[str, Pos] = {}
        self.keys: dict[str, Pos] = {}
        self.count = 0
        self.stack: set[int] = set()

    def pos(self, node: Any) -> Pos:
        mark = node.start_mark
        return Pos(self.file, mark.line + 1, mark.column + 1, "file")

    def error(
        self, code: str, node: Any, message: str, path: str, help: str = "", related: tuple[Related, ...] = ()
    ) -> Diagnostic:
        p = self.pos(node)
        return _diag(code, message, file=self.file, line=p.line, col=p.col, path=path, help=help, related=related)

    def build(self, node: Any, path: str = "", depth: int = 0) -> Any:
        from ruamel.yaml.nodes import MappingNode, SequenceNode

        self.count += 1
        if self.count > MAX_NODES:
            raise _Abort(
                self.error(
                    "YAML005",
                    node,
                    f"the document expands to more than {MAX_NODES:,} YAML nodes (aliases expanded)",
                    path,
                    help="a recipe is small; remove the anchors/aliases that multiply the document",
                )
            )
        if depth > MAX_DEPTH:
            raise _Abort(
                self.error(
                    "YAML008",
                    node,
                    f"mappings and lists nested deeper than {MAX_DEPTH} levels",
                    path,
                    help="flatten the document; recipe keys are at most a few levels deep",
                )
            )
        if isinstance(node, (MappingNode, SequenceNode)):
            if id(node) in self.stack:
                raise _Abort(
                    self.error(
                        "YAML005",
                        node,
                        "an alias refers to the collection that contains it (a recursive document)",
                        path,
                        help="remove the self-referencing alias",
                    )
                )
            self.stack.add(id(node))
            try:
                if isinstance(node, MappingNode):
                    return self._mapping(node, path, depth)
                return self._sequence(node, path, depth)
            finally:
                self.stack.discard(id(node))
        return self._scalar(node, path)

    def _record(self, path: str, key_node: Any, value_node: Any) -> None:
        if not self.record:
            return
        from ruamel.yaml.nodes import ScalarNode

        self.keys[path] = self.pos(key_node)
        # Block collections start on the next line, and an empty value (`eval:`) has no text of its own: point
        # at the key for those.
        if isinstance(value_node, ScalarNode):
            inline = value_node.value != "" or bool(value_node.style)  # plain: None (pure parser) or "" (libyaml)
        else:
            inline = bool(getattr(value_node, "flow_style", False))
        self.values[path] = self.pos(value_node if inline else key_node)

    def _mapping(self, node: Any, path: str, depth: int) -> dict[str, Any] | None:
        tag = str(node.tag)
        if tag != _MAP:
            self.diags.append(
                self.error("YAML004", node, f"unsupported YAML tag `{_short(tag)}` on a mapping", path, help=_TAG_HELP)
            )
            return None
        out: dict[str, Any] = {}
        first_seen: dict[str, Any] = {}
        merged: list[tuple[Any, Any]] = []
        for key_node, value_node in node.value:
            if str(key_node.tag) == _MERGE:
                merged.append((key_node, value_node))
                continue
            key = self._key(key_node, path)
            if key is None:
                continue
            child = f"{path}.{key}" if path else key
            if key in first_seen:
                first = self.pos(first_seen[key])
                self.diags.append(
                    self.error(
                        "YAML003",
                        key_node,
                        f"duplicate key `{key}`",
                        child,
                        help="keep one of them; YAML parsers disagree on which one wins",
                        related=(Related(child, first.file, first.line, first.col, "first set here"),),
                    )
                )
                continue
            first_seen[key] = key_node
            out[key] = self.build(value_node, child, depth + 1)
            self._record(child, key_node, value_node)
        for _key_node, value_node in merged:
            # YAML merge keys (`<<: *base`): explicit keys win over merged ones.
            sources = value_node.value if str(value_node.tag) == _SEQ else [value_node]
            for src in sources:
                built = self.build(src, path, depth + 1)
                if not isinstance(built, dict):
                    self.diags.append(self.error("YAML001", src, "`<<` (merge key) must refer to a mapping", path))
                    continue
                for k, v in built.items():
                    out.setdefault(k, v)
        return out

    def _key(self, key_node: Any, path: str) -> str | None:
        from ruamel.yaml.nodes import ScalarNode

        if isinstance(key_node, ScalarNode) and str(key_node.tag) == _STR:
            return self._unicode(key_node, key_node.value, path)
        shown = key_node.value if isinstance(key_node, ScalarNode) else "a collection"
        self.diags.append(
            self.error(
                "YAML009",
                key_node,
                f"mapping key `{shown}` is not a string",
                path,
                help=f'quote it if it is a name: "{shown}":'
                if isinstance(key_node, ScalarNode)
                else "use a plain name as the key",
            )
        )
        return None

    def _unicode(self, node: Any, text: str, path: str) -> str | None:
        """`text` as Unicode: a `\\uD83D\\uDE00` escape pair (how JSON, which is YAML, writes a character past
        U+FFFF) joined into its character; a lone half of a pair is no character (YAML006), never a string that
        cannot be written out again (a path, a log line)."""
        if not _SURROGATE.search(text):
            return text
        try:
            return text.encode("utf-16", "surrogatepass").decode("utf-16")
        except UnicodeDecodeError:
            self.diags.append(
                self.error(
                    "YAML006",
                    node,
                    "a `\\u` escape in this string is half of a surrogate pair (U+D800-U+DFFF), not a character",
                    path,
                    help="write the character itself, or both halves of the pair",
                )
            )
            return None

    def _sequence(self, node: Any, path: str, depth: int) -> list[Any] | None:
        tag = str(node.tag)
        if tag != _SEQ:
            self.diags.append(
                self.error("YAML004", node, f"unsupported YAML tag `{_short(tag)}` on a list", path, help=_TAG_HELP)
            )
            return None
        out = []
        for i, item in enumerate(node.value):
            child = f"{path}.{i}" if path else str(i)
            out.append(self.build(item, child, depth + 1))
            if self.record:
                self.values[child] = self.pos(item)
                self.keys[child] = self.pos(item)
        return out

    def _scalar(self, node: Any, path: str) -> Any:
        tag, text = str(node.tag), node.value
        try:
            if tag == _STR or tag == _TIMESTAMP:
                return self._unicode(node, text, path)  # timestamps stay strings: no recipe key is a date
            if tag == _NULL:
                return None
            if tag == _BOOL:
                low = text.lower()
                if low in ("true", "yes", "on"):
                    return True
                if low in ("false", "no", "off"):
                    return False
                raise ValueError(text)
            if tag == _INT:
                return _parse_int(text)
            if tag == _FLOAT:
                return _parse_float(text)
        except ValueError:
            self.diags.append(
                self.error(
                    "YAML004",
                    node,
                    f"`{text}` cannot be read as `{_short(tag)}`",
                    path,
                    help="remove the tag or fix the value",
                )
            )
            return None
        self.diags.append(self.error("YAML004", node, f"unsupported YAML tag `{_short(tag)}`", path, help=_TAG_HELP))
        return None


_SURROGATE = re.compile("[\ud800-\udfff]")

_TAG_HELP = (
    "remove the tag: recipes are plain data, and nothing (no Python object, no include) is constructed while loading"
)


def _short(tag: str) -> str:
    return "!!" + tag[len(_T) :] if tag.startswith(_T) else tag


def _parse_int(text: str) -> int:
    s = text.replace("_", "")
    sign = -1 if s.startswith("-") else 1
    s = s.lstrip("+-")
    for prefix, base in (("0x", 16), ("0o", 8), ("0b", 2)):
        if s.lower().startswith(prefix):
            return sign * int(s[2:], base)
    return sign * int(s, 10)


def _parse_float(text: str) -> float:
    s = text.replace("_", "").lower()
    if s.lstrip("+-") in (".inf", "inf"):
        return float("-inf") if s.startswith("-") else float("inf")
    if s in (".nan", "nan"):
        return float("nan")
    return float(s)


# ------------------------------------------------------------------------------------------------ one file
def _flow_too_deep(text: str) -> tuple[int, int] | None:
    """(line, col) where `[`/`{` nesting first exceeds MAX_DEPTH, else None. Checked before parsing because the
    YAML parser recurses per level and would spend seconds before overflowing the stack."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return None
    depth, line, col, quote, comment = 0, 1, 0, "", False
    for ch in text:
        col += 1
        if ch == "\n":
            line, col, comment = line + 1, 0, False
            continue
        if comment:
            continue
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return line, col
        elif ch in "]}":
            depth = max(0, depth - 1)
    return None


_PLAIN_LINE = frozenset(map(chr, range(0x20, 0x7F))) | {"\n"}
"""Printable ASCII and the newline: text made of these (and the non-ASCII letters of `_libyaml_agrees`) reads the
same to libyaml as to ruamel's pure parser, outside the constructs that `_libyaml_agrees` sends to the pure parser."""
_NESTING = "-?:[{"
_DEEPEST_FOR_LIBYAML = 300
"""Bound on nesting below which both parsers compose (ruamel's pure composer recurses, about 450 levels deep before a
RecursionError at about 500 levels from the top of the stack: YAML008 without a position; libyaml goes deeper
there; the builder stops at MAX_DEPTH either way)."""


def _libyaml_agrees(text: str) -> bool:
    """True when `text` lies in the subset of YAML where libyaml's composer (ruamel.yaml.clib) and ruamel's
    pure-Python one give the same node tree (tags, values, styles, positions, aliases). A cheap scan that errs towards
    False: anything else is composed by the pure parser, whose result and errors are the loader's reference
    (tests/test_load.py fuzzes the two against each other). Outside the subset: tabs, CR, BOM, NEL, LS/PS and other
    non-printables; backslashes (escapes differ); directives (`%YAML 1.1` changes the resolver); anchors, aliases and
    tags (their character sets differ); block scalar headers with indentation or a glued comment (`|2`, `|#c`); and
    documents whose nesting might come near the pure composer's recursion limit."""
    if not _PLAIN_LINE.issuperset(text):
        for ch in set(text) - _PLAIN_LINE:
            # non-ASCII letters and symbols (§, —, é): libyaml counts columns in characters like Python does
            if ch < "\xa0" or ch in "\u2028\u2029\ufeff" or "\ud800" <= ch or ch == "\u1680" or ch.isspace():
                return False
    if "\\" in text:
        return False
    flow = text.count("[") + text.count("{")
    indent = per_line = 0
    code = []
    for line in text.split("\n"):
        if len(line) > 1000:
            return False  # simple keys are limited to 1,024 characters: leave the limit to the pure parser
        indent = max(indent, len(line) - len(line.lstrip(" ")))
        if "#" in line and "'" not in line and '"' not in line:
            # A comment holds no token: with no quote on the line, ` #` (or `#` first) starts one. (A line with a
            # quote is scanned whole: it may close a quoted scalar that holds the `#`.)
            comment = _COMMENT.search(line)
            if comment:
                line = line[: comment.start()]
        per_line = max(per_line, sum(line.count(c) for c in _NESTING))
        code.append(line)
    if _LIBYAML_DIFFERS.search("\n".join(code)):
        return False
    return (2 * indent + 2) * (per_line + 1) + flow <= _DEEPEST_FOR_LIBYAML


def _compose_libyaml(text: str) -> Any:
    """The node tree from libyaml, or None when ruamel.yaml.clib is missing or libyaml refuses the text (the pure
    parser then composes it, and its diagnostics are the ones reported)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.main import CParser

    if CParser is None:
        return None
    try:
        node = YAML(typ="safe", pure=False).compose(text)
    except Exception:  # any refusal: the pure parser says why
        return None
    if node is None:
        return _NO_DOCUMENT
    # An empty value (`key:`, `- `) has no text of its own, and the two parsers place it differently (libyaml at
    # the next token, the pure parser after the indicator): leave such documents to the pure parser.
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n.value, str):
            if n.value == "" and not n.style:
                return None
        elif n.value and isinstance(n.value[0], tuple):
            todo.extend(x for pair in n.value for x in pair)
        else:
            todo.extend(n.value)
    return node


_NO_DOCUMENT = object()
_COMMENT = re.compile(r"(?:^|\s)#")
_LIBYAML_DIFFERS = re.compile(r"(?:^|[\s\[\]{},:])[&*!]|^%|[|>](?![ \n]|[-+](?:[ \n]|$)|$)", re.M)


def _compose(text: str, file: str | None, diags: list[Diagnostic]) -> tuple[bool, Any]:
    """Parse YAML text into a node tree (no construction). Returns (ok, root node or None for an empty doc).

    libyaml composes what `_libyaml_agrees` admits (about 5x faster); the pure parser everything else, and anything
    libyaml refuses, so every error is the pure parser's."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

    if _libyaml_agrees(text):
        node = _compose_libyaml(text)
        if node is not None:
            return True, None if node is _NO_DOCUMENT else node
    try:
        return True, YAML(typ="safe", pure=True).compose(text)  # composing only: no comments, no constructors
    except MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark is not None else (None, None)
        problem = e.problem or e.context or "invalid YAML"
        lines = text.splitlines()
        bad_line = lines[line - 1] if line and line <= len(lines) else ""
        indent = bad_line[: len(bad_line) - len(bad_line.lstrip(" \t"))]
        if "\t" in problem or "\t" in indent:
            tab_col = indent.index("\t") + 1 if "\t" in indent else col
            diags.append(
                _diag(
                    "YAML002",
                    "tab character used for indentation",
                    file=file,
                    line=line,
                    col=tab_col,
                    help="indent with spaces; YAML does not allow tabs in indentation",
                )
            )
        else:
            context = f" ({e.context})" if e.context and e.problem else ""
            related: tuple[Related, ...] = ()
            cm = e.context_mark
            if e.context and cm is not None and (cm.line + 1, cm.column + 1) != (line, col):
                related = (Related("", file, cm.line + 1, cm.column + 1, f"{e.context} that started here"),)
            diags.append(
                _diag(
                    "YAML001",
                    f"YAML syntax error: {problem}{context}",
                    file=file,
                    line=line,
                    col=col,
                    help=_syntax_help(problem),
                    related=related,
                )
            )
    except RecursionError:
        diags.append(
            _diag(
                "YAML008",
                "mappings and lists nested deeper than the parser can follow",
                file=file,
                help="flatten the document; recipe keys are at most a few levels deep",
            )
        )
    except YAMLError as e:
        diags.append(_diag("YAML001", f"YAML syntax error: {e}", file=file))
    return False, None


def _syntax_help(problem: str) -> str:
    if "mapping values are not allowed" in problem:
        return (
            "a `key: value` cannot hold another `key:` on the same line; quote the value or start a new indented line"
        )
    if "another document" in problem:
        return "a recipe is one YAML document; remove the extra `---`"
    if "undefined alias" in problem:
        return "define the anchor (`&name`) before using the alias (`*name`)"
    return "check brackets, quotes and indentation on this line and the one before"


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
                _diag(
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
                _diag(
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
            _diag(
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
        diags.append(_diag("LOAD001", f"cannot read `{file}`: {e.strerror}", file=file))
        return None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        if lines is not None:
            lines[file] = raw.decode("utf-8", "replace").splitlines()  # only to show the line with a caret
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        diags.append(
            _diag(
                "YAML006",
                f"byte 0x{raw[e.start]:02x} at offset {e.start} is not valid UTF-8",
                file=file,
                line=line,
                col=col,
                help="save the file as UTF-8",
            )
        )
        return None


_PARSED: dict[tuple[str, str], tuple[_Layer | None, tuple[Diagnostic, ...]]] = {}
"""(display path, text) -> the file's own layer and diagnostics. `lint` reads the same bases once per recipe;
parsing dominates loading, so it is done once per process. Layers are never mutated (merging copies)."""


def _parse_layer(text: str, file: str) -> tuple[_Layer | None, tuple[Diagnostic, ...]]:
    key = (file, text)
    if key not in _PARSED:
        if len(_PARSED) > 256:
            _PARSED.clear()
        diags: list[Diagnostic] = []
        layer = _build_layer(text, file, diags)
        _PARSED[key] = (layer, tuple(diags))
    return _PARSED[key]


def _build_layer(text: str, file: str, diags: list[Diagnostic]) -> _Layer | None:
    """One file's text -> its data and positions (no `extends` yet), or None with diagnostics."""
    too_deep = _flow_too_deep(text)
    if too_deep:
        diags.append(
            _diag(
                "YAML008",
                f"mappings and lists nested deeper than {MAX_DEPTH} levels",
                file=file,
                line=too_deep[0],
                col=too_deep[1],
                help="flatten the document; recipe keys are at most a few levels deep",
            )
        )
        return None
    ok, node = _compose(text, file, diags)
    if not ok:
        return None
    if node is None:
        diags.append(
            _diag(
                "LOAD003",
                f"`{file}` is empty: it holds no YAML document",
                file=file,
                line=1,
                col=1,
                help="a recipe starts with `version: 1`, `name: ...`, `kind: rl|sft`",
            )
        )
        return None
    from ruamel.yaml.nodes import MappingNode

    builder = _Builder(file, diags)
    if not isinstance(node, MappingNode):
        p = builder.pos(node)
        what = "a list" if type(node).__name__ == "SequenceNode" else "a single value"
        diags.append(
            _diag(
                "LOAD004",
                f"the document is {what}; a recipe is a mapping of keys",
                file=file,
                line=p.line,
                col=p.col,
                help="start with `version: 1`, `name: ...`, `kind: rl|sft` at column 1",
            )
        )
        return None
    try:
        data = builder.build(node)
    except _Abort as e:
        diags.append(e.diag)
        return None
    if data is None:
        return None
    return _Layer(file, data, builder.values, builder.keys)


class _Tree:
    """Loads a recipe and its bases depth-first into layers, detecting cycles."""

    def __init__(self, diags: list[Diagnostic], source: SourceMap, roots: Sequence[Path]):
        self.diags = diags
        self.source = source
        self.roots = tuple(roots)
        self.layers: list[_Layer] = []
        self.done: set[Path] = set()
        self.targets: list[Path] = []
        self.files: list[str] = []

    def load(self, path: Path, stack: tuple[tuple[Path, str], ...], at: Diagnostic | None) -> _Layer | None:
        real = Path(os.path.realpath(path))
        file = display_path(path)
        # os.path's checks answer False, not OSError, for a name over NAME_MAX (an `extends` of 300 characters).
        if at is None and os.path.exists(real) and not _inside(real, self.roots):
            # The recipe itself is a symbolic link out of its repository (a planted recipes/x.yaml -> /etc/shadow).
            self.diags.append(
                _diag(
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
        layer, diags = _parse_layer(text, file)
        self.diags.extend(diags)
        if layer is None:
            return None
        self._bases(layer, real, stack + ((real, file),))
        self.layers.append(layer)
        return layer

    def _bases(self, layer: _Layer, real: Path, stack: tuple[tuple[Path, str], ...]) -> None:
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
                _diag(
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
            target_path = real.parent / target
            target_real = Path(os.path.realpath(target_path))
            chain = [f for _, f in stack]
            if any(target_real == s for s, _ in stack):
                self.diags.append(
                    _diag(
                        "LOAD005",
                        f"`extends: {target}` makes a cycle: {' -> '.join(chain + [display_path(target_path)])}",
                        file=layer.file,
                        line=p.line,
                        col=p.col,
                        path="extends",
                        help="remove this entry, or move the shared keys into a base that extends nothing",
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
                    _diag(
                        "LOAD011",
                        f"`extends` target `{target}` {why}; it was not read",
                        file=layer.file,
                        line=p.line,
                        col=p.col,
                        path="extends",
                        help=_ROOTS_HELP,
                    )
                )
                continue
            missing = _diag(
                "LOAD006",
                f"`extends` target `{target}` is not a file (looked for `{display_path(target_path)}`)",
                file=layer.file,
                line=p.line,
                col=p.col,
                path="extends",
                help="paths in `extends` are relative to the file that contains them",
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
            _diag(
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
            _diag("LOAD009", f"`--set {key}`: {where} has no key `{wrong}`", path=key, origin="--set", help=hint)
        )
        return
    sink: list[Diagnostic] = []
    ok, node = _compose(raw, None, sink)
    value: Any = None
    if ok and node is not None:
        builder = _Builder(None, sink, record=False)
        try:
            value = builder.build(node)
        except _Abort as e:
            sink.append(e.diag)
    if sink:
        reason = sink[0].message.removeprefix("YAML syntax error: ")
        diags.append(
            _diag(
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
            _diag(
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
