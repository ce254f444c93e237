"""`IdentityMemo` keys on identity, not equality: an equal but distinct object is another entry, and a kept entry
holds its objects so that their ids are not reused."""

from __future__ import annotations

from costmodels.identity_memo import IdentityMemo, clear_all


class _Box:
    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:  # equal boxes must still be told apart
        return isinstance(other, _Box) and other.value == self.value

    __hash__ = None  # type: ignore[assignment]  # like a graph too costly to hash


def test_values_are_computed_once_per_object_identity_and_values():
    memo: IdentityMemo[int] = IdentityMemo()
    calls: list[int] = []

    def compute(box: _Box, k: int) -> int:
        calls.append(k)
        return box.value * k

    first, twin = _Box(3), _Box(3)
    assert memo.get((first,), (2,), lambda: compute(first, 2)) == 6
    assert memo.get((first,), (2,), lambda: compute(first, 2)) == 6
    assert memo.get((first,), (5,), lambda: compute(first, 5)) == 15
    assert memo.get((twin,), (2,), lambda: compute(twin, 2)) == 6
    assert calls == [2, 5, 2]


def test_a_full_memo_empties_and_recomputes():
    memo: IdentityMemo[int] = IdentityMemo(limit=2)
    box, calls = _Box(1), []
    for k in (1, 2, 3, 1):
        memo.get((box,), (k,), lambda k=k: calls.append(k) or k)
    assert calls == [1, 2, 3, 1]  # the third entry emptied the memo, so 1 is computed again
    memo.clear()
    memo.get((box,), (3,), lambda: calls.append(3) or 3)
    assert calls[-1] == 3


def test_clear_all_empties_every_memo():
    memos: list[IdentityMemo[int]] = [IdentityMemo(), IdentityMemo(limit=4)]
    box, calls = _Box(2), []
    for memo in memos:
        memo.get((box,), (1,), lambda: calls.append(1) or 1)
    clear_all()
    for memo in memos:
        memo.get((box,), (1,), lambda: calls.append(1) or 1)
    assert calls == [1, 1, 1, 1]
