"""Counting the tensors autograd saves, as real pipeline schedules keep them (the gloo pipeline tests)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn


class SavedBytes:
    """Saved-tensor hooks that count the distinct non-parameter tensors autograd holds (a tensor saved by two
    nodes once) and the peak of their bytes; a tensor is released when its last saved copy is freed."""

    def __init__(self, parameters: list[nn.Parameter]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in parameters}
        self.refs: dict[tuple[int, int], int] = {}
        self.held = self.peak = 0

    def live(self) -> set[tuple[int, int]]:
        return {key for key, count in self.refs.items() if count}

    def pack(self, tensor: torch.Tensor) -> object:
        if tensor.untyped_storage().data_ptr() in self.skip:
            return tensor
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if self.refs.get(key, 0) == 0:
            self.held += key[1]
            self.peak = max(self.peak, self.held)
        self.refs[key] = self.refs.get(key, 0) + 1
        # Boxing the tensor itself would tie a saved output to its own grad_fn in a cycle that autograd's saved
        # outputs avoid (they keep no grad_fn): a detached alias keeps the storage and nothing else.
        box = _Box(tensor.detach())
        weakref.finalize(box, self._release, key)
        return box

    def unpack(self, packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Box) else packed

    def _release(self, key: tuple[int, int]) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.held -= key[1]


class _Box:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def after(run: Callable, snapshot: Callable[[], None]) -> Callable:
    """`run`, then `snapshot()`: a measuring point just after an action of the schedule."""
    def wrapped(*args, **kwargs):
        result = run(*args, **kwargs)
        snapshot()
        return result
    return wrapped


def before(run: Callable, snapshot: Callable[[], None]) -> Callable:
    """`snapshot()`, then `run`: a measuring point just before an action of the schedule."""
    def wrapped(*args, **kwargs):
        snapshot()
        return run(*args, **kwargs)
    return wrapped
