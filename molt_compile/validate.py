"""Pass 2, validate: the loaded data -> `RlRecipe | SftRecipe`, every schema error a positioned diagnostic.

`version` and `kind` are checked first, by hand, because everything else depends on them (which format, which
model). The rest is pydantic; each of its errors is mapped back to the YAML path it concerns (union member tags
in pydantic's `loc` are dropped), then to where that key or value was written (`Loaded.source`), with a plain
message and a fix: the closest key for a typo (difflib, within the section, else the section that has such a key)
and the closest choice for an enum value.

Schema errors are recipe errors (exit 1), and the pass recovers from them as a compiler does: the offending key or
value is reported, dropped (its default applies) and the rest validated again, so that the rules still run and one
round shows every mistake. Only a missing required key, a bad `kind` or an unsupported `version` leaves no recipe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from molt_compile import schema_walk as sw
from molt_compile.codes import BUILTIN
from molt_compile.diagnostics import Diagnostic
from molt_compile.load import Loaded
from molt_compile.source import Pos

_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "string_unicode": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
    "iterable_type": "a list",
    "none_required": "null",
}
_RANGE_WORDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def describe(value: Any) -> str:
    """A value as a message shows it: `eight` (a string), a mapping, null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"the string `{value}`" if len(value) <= 40 else "a long string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)}"
    return f"`{value}`"


def _dotted(segments: list[Any]) -> str:
    return ".".join(str(s) for s in segments)


def _error(code: str, message: str, path: str, pos: Pos | None, help: str = "") -> Diagnostic:
    return BUILTIN[code].diagnostic(message, pos=pos or Pos(None, None, None, "default"), path=path, help=help)


class _Where:
    """Positions for a loaded recipe: of values, of keys, and of a section when a key in it is missing."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded

    def value(self, path: str) -> Pos:
        return self.loaded.source.pos(path) if path else self.root()

    def key(self, path: str) -> Pos:
        return self.loaded.key_positions.get(path) or self.value(path)

    def section(self, path: str) -> Pos:
        return (
            (self.loaded.key_positions.get(path) or self.loaded.source.positions.get(path) or self.root())
            if path
            else self.root()
        )

    def root(self) -> Pos:
        return Pos(self.loaded.source.root_file, None, None, "file")


def _loc_to_segments(loc: tuple, data: Any, keep_last: bool) -> list[Any]:
    """pydantic's loc -> YAML path segments, dropping union member tags (`str`, `list[str]`, `function-after[...]`)."""
    out: list[Any] = []
    cur = data
    for i, part in enumerate(loc):
        if isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and 0 <= part < len(cur):
            out.append(part)
            cur = cur[part]
        elif keep_last and i == len(loc) - 1:
            out.append(part)
        else:
            continue
    return out


def _check_version_kind(data: dict[str, Any], where: _Where) -> tuple[list[Diagnostic], Any]:
    from schemas.recipe import RECIPE_VERSION, RlRecipe, SftRecipe

    diags: list[Diagnostic] = []
    version = data.get("version")
    if "version" not in data:
        diags.append(
            _error(
                "SCHEMA006",
                "missing key `version`",
                "version",
                where.root(),
                help=f"add `version: {RECIPE_VERSION}` at the top of the recipe",
            )
        )
    elif type(version) is not int or version != RECIPE_VERSION:
        diags.append(
            _error(
                "SCHEMA006",
                f"unsupported recipe version {describe(version)}; this molt-compile reads version {RECIPE_VERSION}",
                "version",
                where.value("version"),
                help=f"write `version: {RECIPE_VERSION}` (see schemas/recipe.schema.json)",
            )
        )
    kinds = {"rl": RlRecipe, "sft": SftRecipe}
    kind = data.get("kind")
    if "kind" not in data:
        diags.append(
            _error(
                "SCHEMA004",
                "missing key `kind`",
                "kind",
                where.root(),
                help="add `kind: rl` (reinforcement learning) or `kind: sft` (supervised fine-tuning)",
            )
        )
        return diags, None
    if not isinstance(kind, str) or kind not in kinds:  # a list or mapping is unhashable: test the type first
        guess = sw.closest(str(kind), list(kinds)) if isinstance(kind, str) else None
        diags.append(
            _error(
                "SCHEMA005",
                f"`kind` must be `rl` or `sft`, got {describe(kind)}",
                "kind",
                where.value("kind"),
                help=f"did you mean `{guess}`?" if guess else "use `kind: rl` or `kind: sft`",
            )
        )
        return diags, None
    return diags, kinds[kind]


def _unknown_key(model: Any, segments: list[Any], where: _Where) -> Diagnostic:
    path = _dotted(segments)
    parent, key = segments[:-1], str(segments[-1])
    parent_types, _ = sw.type_at(model, parent)
    candidates: list[str] = []
    for tp in parent_types or []:
        candidates.extend(k for k in (sw.keys_of(tp) or []) if k not in candidates)
    section = f"`{_dotted(parent)}`" if parent else "the recipe"
    guess = sw.closest(key, candidates)
    if guess:
        help = f"did you mean `{guess}`?"
    else:
        elsewhere = sw.sections_with_key(model, key)
        if elsewhere:
            help = (
                f"{section} has: {', '.join(candidates)}; `{key}` is a key of "
                + " and ".join(f"`{s}`" for s in elsewhere[:3])
                + " (move it there if that is what you meant)"
            )
        else:
            help = f"{section} has: " + ", ".join(candidates)
    where_msg = f"in {section}" if parent else "at the top level"
    return _error("SCHEMA001", f"unknown key `{key}` {where_msg}", path, where.key(path), help=help)


def _map_errors(
    model: Any, errors: Sequence[Mapping[str, Any]], data: dict[str, Any], where: _Where
) -> list[Diagnostic]:
    by_path: dict[str, list[tuple[list[Any], Mapping[str, Any]]]] = {}
    for err in errors:
        if err["loc"] and err["loc"][0] in ("version", "kind"):
            continue  # checked by hand, with better messages
        keep_last = err["type"] in ("missing", "extra_forbidden")
        segments = _loc_to_segments(tuple(err["loc"]), data, keep_last)
        by_path.setdefault(_dotted(segments), []).append((segments, err))

    diags: list[Diagnostic] = []
    for path, group in by_path.items():
        segments, err = group[0]
        kind = err["type"]
        value = err.get("input")
        if kind == "extra_forbidden":
            diags.append(_unknown_key(model, segments, where))
        elif kind == "missing" and segments and isinstance(segments[-1], int):
            listed = _dotted(segments[:-1])
            diags.append(
                _error(
                    "SCHEMA003",
                    f"`{listed}` has too few items: item {segments[-1]} is missing",
                    listed,
                    where.value(listed),
                    help=_list_len_help(model, segments[:-1]),
                )
            )
        elif kind == "missing":
            parent = _dotted(segments[:-1])
            doc = sw.field_doc(model, segments)
            diags.append(
                _error(
                    "SCHEMA004",
                    f"missing required key `{path}`",
                    path,
                    where.section(parent),
                    help=f"add `{segments[-1]}:` under `{parent}`"
                    if parent
                    else f"add `{path}:`" + (f" ({doc})" if doc else ""),
                )
            )
        elif kind == "literal_error":
            types, _ = sw.type_at(model, segments)
            choices = sw.literal_choices(types or [])
            shown = ", ".join(str(c) for c in choices)
            guess = sw.closest(str(value), [str(c) for c in choices]) if value is not None else None
            diags.append(
                _error(
                    "SCHEMA005",
                    f"`{path}` must be one of {shown}; got {describe(value)}",
                    path,
                    where.value(path),
                    help=f"did you mean `{guess}`?" if guess else f"choose one of: {shown}",
                )
            )
        elif kind in _RANGE_WORDS:
            bound_key, op = _RANGE_WORDS[kind]
            bound = err.get("ctx", {}).get(bound_key)
            diags.append(
                _error(
                    "SCHEMA003",
                    f"`{path}` must be {op} {bound}, got {describe(value)}",
                    path,
                    where.value(path),
                    help=_range_help(model, segments, op, bound),
                )
            )
        elif kind == "too_long" or kind == "too_short":
            ctx = err.get("ctx", {})
            diags.append(
                _error(
                    "SCHEMA003",
                    f"`{path}` has {ctx.get('actual_length', '?')} items; {_len_words(ctx)}",
                    path,
                    where.value(path),
                    help=_list_len_help(model, segments),
                )
            )
        elif kind == "string_pattern_mismatch" and err["loc"][-1] == "[key]":  # a mapping key: env names
            diags.append(
                _error(
                    "SCHEMA007",
                    f"`{value}` is not an environment variable name (in `{_dotted(segments[:-1])}`)",
                    path,
                    where.key(path),
                    help="a name is letters, digits and `_`, not starting with a digit; the value goes "
                    f"after the colon: `{_env_name_guess(str(value))}: ...`",
                )
            )
        elif kind in ("string_pattern_mismatch", "string_too_long", "string_too_short"):
            diags.append(
                _error(
                    "SCHEMA007",
                    f"`{path}` is not allowed: {err['msg'].lower()}; got {describe(value)}",
                    path,
                    where.value(path),
                    help=_string_help(path, value),
                )
            )
        else:
            expected = []
            for _, e in group:
                word = _TYPE_WORDS.get(e["type"])
                if word and word not in expected:
                    expected.append(word)
            if expected:
                help = _type_help(model, segments, expected)
                if expected == ["a mapping"] and value is None:
                    help = f"an empty `{segments[-1]}:` is null; write `{segments[-1]}: {{}}` for the defaults, or remove it"
                elif expected == ["a string"] and isinstance(value, (int, float, bool)):
                    shown = str(value).lower() if isinstance(value, bool) else str(value)
                    help = f'quote it: `{segments[-1]}: "{shown}"`'
                diags.append(
                    _error(
                        "SCHEMA002",
                        f"`{path}` must be {' or '.join(expected)}, got {describe(value)}",
                        path,
                        where.value(path),
                        help=help,
                    )
                )
            else:
                diags.append(_error("SCHEMA007", f"`{path}`: {err['msg']}", path, where.value(path)))
    return diags


def _len_words(ctx: dict) -> str:
    if "max_length" in ctx and ctx["max_length"] is not None:
        return f"at most {ctx['max_length']} allowed"
    return f"at least {ctx.get('min_length')} needed"


def _list_len_help(model: Any, segments: list[Any]) -> str:
    import typing

    types, _ = sw.type_at(model, segments)
    for tp in types or []:
        for m in sw.members(tp):
            args = typing.get_args(m)
            if typing.get_origin(m) is tuple and args and args[-1] is not Ellipsis:
                return f"give exactly {len(args)} items, e.g. [{', '.join('...' for _ in args)}]" + (
                    f" ({sw.field_doc(model, segments)})" if sw.field_doc(model, segments) else ""
                )
    return ""


def _range_help(model: Any, segments: list[Any], op: str, bound: Any) -> str:
    doc = sw.field_doc(model, segments)
    return f"use a value {op} {bound}" + (f"; `{segments[-1]}`: {doc}" if doc else "")


def _type_help(model: Any, segments: list[Any], expected: list[str]) -> str:
    doc = sw.field_doc(model, segments)
    if "a mapping" in expected:
        return "write it as an indented section of keys" + (f"; `{segments[-1]}`: {doc}" if doc else "")
    return f"write {' or '.join(expected)}" + (f"; `{segments[-1]}`: {doc}" if doc else "")


def _env_name_guess(value: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]+", "_", value.partition("=")[0]).strip("_") or "NAME"
    return f"_{name}" if name[0].isdigit() else name


def _string_help(path: str, value: Any) -> str:
    if path == "name" and isinstance(value, str):
        slug = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63] or "my-job"
        return f"use lowercase letters, digits and dashes (at most 63), e.g. `name: {slug}`"
    return ""


def _with_overridden(d: Diagnostic, loaded: Loaded) -> Diagnostic:
    """Name the base values that the offending value replaced: the user may be editing the wrong file."""
    from dataclasses import replace

    from molt_compile.diagnostics import Related

    earlier = loaded.overridden.get(d.path, [])
    notes = tuple(Related(d.path, p.file, p.line, p.col, "replaces the value set") for p in earlier)
    return replace(d, related=d.related + notes) if notes else d


_ROUNDS = 8
"""At most this many validate-and-drop rounds: each drops at least one key, and pydantic reports all errors of a
round at once, so a recipe needs two or three."""


def _drop(data: Any, segments: list[Any]) -> bool:
    """Remove the value at `segments` (a list item's error drops the whole list's key). False when there is none."""
    while segments and not isinstance(segments[-1], str):
        segments = segments[:-1]
    if not segments:
        return False
    cur = data
    for s in segments[:-1]:
        if isinstance(cur, dict) and s in cur:
            cur = cur[s]
        elif isinstance(cur, list) and isinstance(s, int) and 0 <= s < len(cur):
            cur = cur[s]
        else:
            return False
    if isinstance(cur, dict) and segments[-1] in cur:
        del cur[segments[-1]]
        return True
    return False


def validate(loaded: Loaded) -> tuple[Any, list[Diagnostic]]:
    """Validate loaded data into `RlRecipe | SftRecipe`. Returns (recipe or None, new diagnostics).

    With schema errors, the recipe (when one can be had) is the one validated without the offending keys: the
    caller runs the rules on it to report their findings too, and makes no plan of it."""
    if loaded.data is None or not loaded.ok:
        return None, []
    import copy

    from pydantic import ValidationError

    where = _Where(loaded)
    diags, model = _check_version_kind(loaded.data, where)
    if model is None or any(d.path == "version" and "unsupported" in d.message for d in diags):
        return None, diags
    data = copy.deepcopy(loaded.data)
    if "version" not in data:  # reported above; the rest is read as this compiler's version
        from schemas.recipe import RECIPE_VERSION

        data["version"] = RECIPE_VERSION
    reported: set[str] = set()
    for _ in range(_ROUNDS):
        try:
            return model.model_validate(data), diags
        except ValidationError as e:
            errors = [
                err for err in e.errors(include_url=False) if not (err["loc"] and err["loc"][0] in ("version", "kind"))
            ]
            mapped = [m for m in _map_errors(model, errors, data, where) if m.path not in reported]
            reported.update(m.path for m in mapped)
            diags.extend(_with_overridden(d, loaded) for d in mapped)
            if any(err["type"] == "missing" for err in errors):
                return None, diags  # a required key: nothing to fall back to
            dropped = False
            for err in errors:
                keep_last = err["type"] == "extra_forbidden"
                dropped |= _drop(data, _loc_to_segments(tuple(err["loc"]), data, keep_last))
            if not dropped:
                return None, diags
    return None, diags
