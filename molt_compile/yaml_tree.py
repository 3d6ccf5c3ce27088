"""One YAML file -> plain Python data and the position of every key and value (pass 1's parser; `load.py` reads
the files and merges the layers).

A recipe is untrusted text, so the YAML is only *composed* (ruamel.yaml's safe, pure-Python composer: no
constructors run, and its errors are the diagnostics) and plain data is then built here from the node tree:
- every key and value keeps `file:line:col` (dotted YAML paths like `train.async.queue_size`, list items as
  `algo.reward_clip.0`);
- what plain data cannot hold is rejected: duplicate keys, non-string keys, `!!python/...` and other tags;
- nodes are counted while aliases expand, so an alias bomb stops at a budget instead of eating the machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from molt_compile.codes import BUILTIN
from molt_compile.diagnostics import Diagnostic, Related
from molt_compile.source import Pos

MAX_NODES = 10_000
"""Budget of YAML nodes built per file, aliases expanded; an alias bomb stops here. The largest shipped
recipe builds under 200."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""

_T = "tag:yaml.org,2002:"
_STR, _INT, _FLOAT, _BOOL, _NULL = _T + "str", _T + "int", _T + "float", _T + "bool", _T + "null"
_MAP, _SEQ, _MERGE, _TIMESTAMP = _T + "map", _T + "seq", _T + "merge", _T + "timestamp"


def diagnostic(
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
class Layer:
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
        return diagnostic(code, message, file=self.file, line=p.line, col=p.col, path=path, help=help, related=related)

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
            inline = value_node.value != "" or bool(value_node.style)
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


def _compose(text: str, file: str | None, diags: list[Diagnostic]) -> tuple[bool, Any]:
    """Parse YAML text into a node tree (no construction). Returns (ok, root node or None for an empty doc)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import MarkedYAMLError, YAMLError

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
                diagnostic(
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
                diagnostic(
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
            diagnostic(
                "YAML008",
                "mappings and lists nested deeper than the parser can follow",
                file=file,
                help="flatten the document; recipe keys are at most a few levels deep",
            )
        )
    except YAMLError as e:
        diags.append(diagnostic("YAML001", f"YAML syntax error: {e}", file=file))
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


_PARSED: dict[tuple[str, str], tuple[Layer | None, tuple[Diagnostic, ...]]] = {}
"""(display path, text) -> the file's own layer and diagnostics. `lint` reads the same bases once per recipe;
parsing dominates loading, so it is done once per process. Layers are never mutated (merging copies)."""


def parse_layer(text: str, file: str) -> tuple[Layer | None, tuple[Diagnostic, ...]]:
    key = (file, text)
    if key not in _PARSED:
        if len(_PARSED) > 256:
            _PARSED.clear()
        diags: list[Diagnostic] = []
        layer = _build_layer(text, file, diags)
        _PARSED[key] = (layer, tuple(diags))
    return _PARSED[key]


def _build_layer(text: str, file: str, diags: list[Diagnostic]) -> Layer | None:
    """One file's text -> its data and positions (no `extends` yet), or None with diagnostics."""
    too_deep = _flow_too_deep(text)
    if too_deep:
        diags.append(
            diagnostic(
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
            diagnostic(
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
            diagnostic(
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
    return Layer(file, data, builder.values, builder.keys)


def parse_value(text: str) -> tuple[Any, list[Diagnostic]]:
    """A `--set` value read as YAML: (plain data, the diagnostics of reading it); no positions are kept."""
    sink: list[Diagnostic] = []
    ok, node = _compose(text, None, sink)
    value: Any = None
    if ok and node is not None:
        builder = _Builder(None, sink, record=False)
        try:
            value = builder.build(node)
        except _Abort as e:
            sink.append(e.diag)
    return value, sink
