"""Navigating Recipe v1 by YAML key path: which keys a section has, and what type a key holds.

Used by `--set` (is this key real?), by the validator (which keys could a typo have meant? which choices does an
enum allow?) and by `explain` (every leaf path with its docstring). Works on the pydantic models' annotations only.
"""

from __future__ import annotations

import types
import typing
from functools import cache
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel

from schemas.recipe import field_docs


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def members(tp: Any) -> list[Any]:
    """The non-None alternatives of a (possibly Optional/Union/Annotated) type."""
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        out = []
        for arg in typing.get_args(tp):
            if arg is not type(None):
                out.extend(members(arg))
        return out
    return [tp]


@cache
def _fields(model: type[BaseModel]) -> dict[str, Any]:
    return {(f.alias or name): f for name, f in model.model_fields.items()}


def is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def child_types(tp: Any, key: str | int) -> list[Any] | None:
    """The types a value at `key` under a value of type `tp` may have; None when `key` cannot exist there."""
    out: list[Any] = []
    found = False
    for m in members(tp):
        origin = typing.get_origin(m)
        args = typing.get_args(m)
        if is_model(m):
            f = _fields(m).get(str(key))
            if f is not None:
                found = True
                out.append(f.annotation)
        elif origin is dict or m is dict:
            found = True
            out.append(args[1] if len(args) == 2 else Any)
        elif origin is list:
            if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
                found = True
                out.append(args[0] if args else Any)
        elif origin is tuple:
            idx = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else None
            if idx is not None:
                if len(args) == 2 and args[1] is Ellipsis:
                    found = True
                    out.append(args[0])
                elif idx < len(args):
                    found = True
                    out.append(args[idx])
        elif m is Any or m is object:
            found = True
            out.append(Any)
    return out if found else None


def keys_of(tp: Any) -> list[str] | None:
    """The keys a mapping of type `tp` has (model fields); None when any key is allowed or it is not a mapping."""
    keys: list[str] = []
    for m in members(tp):
        if is_model(m):
            keys.extend(k for k in _fields(m) if k not in keys)
        elif typing.get_origin(m) is dict or m is dict or m is Any:
            return None
    return keys


def type_at(root: Any, segments: list[str | int]) -> tuple[list[Any] | None, int]:
    """Follow `segments` from `root`. Returns (types at the end, -1) or (None, index of the first bad segment)."""
    current = [root]
    for i, seg in enumerate(segments):
        nxt: list[Any] = []
        for tp in current:
            got = child_types(tp, seg)
            if got:
                nxt.extend(got)
        if not nxt:
            return None, i
        current = nxt
    return current, -1


def literal_choices(types_: list[Any]) -> list[Any]:
    """The allowed values when the type is (or contains) a Literal."""
    out: list[Any] = []
    for tp in types_:
        for m in members(tp):
            if typing.get_origin(m) is Literal:
                out.extend(a for a in typing.get_args(m) if a not in out)
    return out


def field_doc(root: Any, segments: list[str | int]) -> str:
    """The docstring of the field at `segments` (empty when there is none)."""
    if not segments:
        return ""
    parents, bad = type_at(root, segments[:-1])
    if parents is None:
        return ""
    for tp in parents:
        for m in members(tp):
            if is_model(m):
                f = _fields(m).get(str(segments[-1]))
                doc = field_docs(m).get(str(segments[-1])) or (f.description if f is not None else None)
                if doc:
                    return doc
    return ""


def all_leaf_paths(root: Any, prefix: str = "", depth: int = 0) -> list[str]:
    """Every dotted key path of the model tree (sections and their keys), for 'did you mean' across sections."""
    out: list[str] = []
    if depth > 8:
        return out
    for m in members(root):
        if is_model(m):
            for key, f in _fields(m).items():
                path = f"{prefix}.{key}" if prefix else key
                out.append(path)
                out.extend(all_leaf_paths(f.annotation, path, depth + 1))
    return out


def closest(word: str, candidates: list[str]) -> str | None:
    """The candidate a typo most likely meant, or None when nothing is close."""
    import difflib

    hits = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    if not hits:
        lowered = {c.lower(): c for c in candidates}
        hits = [lowered[h] for h in difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)]
    return hits[0] if hits else None


def sections_with_key(root: Any, key: str) -> list[str]:
    """Dotted parent paths of every section that has `key` (for 'did you mean' across sections)."""
    out = []
    for path in all_leaf_paths(root):
        parent, _, leaf = path.rpartition(".")
        if leaf == key and parent and parent not in out:
            out.append(parent)
    return out
