"""A bounded memo for pure cost functions of large frozen objects (graphs, layers, clusters): keyed by those
objects' identities plus plain values, because hashing a frozen graph or layer by its fields costs more than the
call it saves. The solver prices the same few objects under thousands of configurations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class IdentityMemo(Generic[T]):
    """Values by (objects by identity, plain hashable values). Each entry keeps its objects alive, so an id is not
    reused by another object while its entry is cached; the memo empties itself when it reaches `limit`."""

    def __init__(self, limit: int = 2**16) -> None:
        self._entries: dict[tuple[object, ...], tuple[tuple[object, ...], T]] = {}
        self._limit = limit

    def get(self, objects: tuple[object, ...], values: tuple[object, ...], compute: Callable[[], T]) -> T:
        """The cached value for these objects and values, else `compute()` (then cached)."""
        key = (*map(id, objects), *values)
        hit = self._entries.get(key)
        if hit is not None and all(kept is given for kept, given in zip(hit[0], objects, strict=True)):
            return hit[1]
        value = compute()
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[key] = (objects, value)
        return value

    def clear(self) -> None:
        self._entries.clear()
