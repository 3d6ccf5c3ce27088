"""The derived-value map (`Derived`, `DerivedValue`) and the builder the sections add to."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_MISSING = object()


@dataclass(frozen=True)
class DerivedValue:
    """One derived number: its value, a one-line reason, and the keys it was computed from."""

    name: str
    value: Any
    reason: str
    inputs: tuple[str, ...] = ()
    forced: bool = False
    """True when the value overrides what the recipe wrote (Molt forces it); rules report these as info."""

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "reason": self.reason, "inputs": list(self.inputs)}


class Derived:
    """Ordered, read-only map of derived names to `DerivedValue`s."""

    def __init__(self, items: dict[str, DerivedValue]):
        self._items = dict(items)

    def __getitem__(self, name: str) -> DerivedValue:
        try:
            return self._items[name]
        except KeyError:
            import difflib  # only for the error message

            close = difflib.get_close_matches(name, self._items, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KeyError(f"no derived value {name!r}{hint}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def get(self, name: str) -> DerivedValue | None:
        return self._items.get(name)

    def value(self, name: str, default: Any = _MISSING) -> Any:
        """The value of `name`; KeyError for an unknown name unless a default is given."""
        if name in self._items:
            return self._items[name].value
        if default is _MISSING:
            return self[name].value  # raises with a did-you-mean
        return default

    def values(self) -> Iterator[DerivedValue]:
        return iter(self._items.values())

    def names(self) -> list[str]:
        return list(self._items)

    def to_list(self) -> list[dict]:
        return [dv.to_json() for dv in self._items.values()]


class Builder:
    """Collects derived values in order; `add` returns the value so derivations read as assignments."""

    def __init__(self) -> None:
        self.items: dict[str, DerivedValue] = {}

    def add(self, name: str, value: Any, reason: str, inputs: tuple[str, ...] = (), forced: bool = False) -> Any:
        self.items[name] = DerivedValue(name, value, reason, tuple(inputs), forced)
        return value

    def v(self, name: str) -> Any:
        return self.items[name].value
