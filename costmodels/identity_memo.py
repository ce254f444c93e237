"""A bounded memo for pure cost functions of large frozen objects (graphs, layers, clusters): keyed by those
objects' identities plus plain values, because hashing a frozen graph or layer by its fields costs more than the
call it saves. The solver prices the same few objects under thousands of configurations."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# Every memo, so that a caller that changes what the cost functions read besides their arguments (the module
# constants benchmarks/calibrate.py sweeps) can drop every cached cost at once (`clear_all`).
_MEMOS: weakref.WeakSet[IdentityMemo] = weakref.WeakSet()


class IdentityMemo(Generic[T]):
    """Values by (objects by identity, plain hashable values). Each entry keeps its objects alive, so an id is not
    reused by another object while its entry is cached; the memo empties itself when it reaches `limit`."""

    def __init__(self, limit: int = 2**16) -> None:
        self._entries: dict[tuple[object, ...], tuple[tuple[object, ...], T]] = {}
        self._limit = limit
        _MEMOS.add(self)

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


def clear_all() -> None:
    """Empty every memo: the costs they hold were computed with the constants of the moment, which a sweep over
    those constants changes (the memos key on their functions' arguments only)."""
    for memo in list(_MEMOS):
        memo.clear()
