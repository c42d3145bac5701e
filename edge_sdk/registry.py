"""One registry type for everything looked up by name: policies, metrics, tasks.

>>> shapes: Registry[type] = Registry("shape")
>>> @shapes.register("square")
... class Square: ...
>>> shapes.get("square") is Square
True
>>> shapes.get("sqare")
Traceback (most recent call last):
...
edge_sdk.registry.UnknownNameError: unknown shape 'sqare'; did you mean 'square'? (available: square)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """A name that no entry of a registry carries (a ``KeyError`` and a ``ValueError``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class Registry(Generic[T]):
    """Name → object, with a decorator to register and a ``get`` that suggests near misses.

    Args:
        kind: what the entries are ("policy", "metric", "task"), used in error messages.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, obj: T | None = None, *, force: bool = False) -> Callable[[T], T] | T:
        """Register ``obj`` under ``name``; without ``obj``, return a decorator that does.

        Registering a different object under a taken name raises ``ValueError``
        unless ``force`` is set (re-registering the same object is a no-op).
        """

        def add(target: T) -> T:
            if not name or not isinstance(name, str):
                raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
            existing = self._entries.get(name)
            if existing is not None and existing is not target and not force:
                raise ValueError(f"a {self.kind} named {name!r} is already registered ({existing!r})")
            self._entries[name] = target
            return target

        return add if obj is None else add(obj)

    def get(self, name: str) -> T:
        """The entry named ``name``; :class:`UnknownNameError` naming the closest matches otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._entries, n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}{hint} (available: {', '.join(self.names())})"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
