"""The order in which a training step allocates and frees device memory, from the HF modeling code on fake tensors.

This is the reference input of `costmodels.allocator` (the caching allocator replayed): the planner's reservation
formula (`costmodels.overhead.reserved_bytes`) is checked against replays of these traces, in tests and in
benchmarks/allocator.py. Each new storage an op creates is one allocation, in dispatch order, and it is freed when
its last reference dies, as the caching allocator sees it on a GPU: parameters first, then `steps` steps of
forward, backward, AdamW (foreach, states created at the first step) and `zero_grad(set_to_none=True)`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .fake import build_model, to_fake
from .measure import transformers_config
from .sources import resolve

Event = tuple[int, int | None]
"""(storage number, bytes) when it is allocated; (storage number, None) when it is freed."""


class _Allocations(TorchDispatchMode):
    """Record each new storage's allocation and, through a weakref finalizer, its free."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[Event] = []
        self._live: set[int] = set()

    def note(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        self._live.add(key)
        number = len(self.events)
        self.events.append((number, storage.nbytes()))
        weakref.finalize(storage, self._freed, key, number)

    def _freed(self, key: int, number: int) -> None:
        self._live.discard(key)
        self.events.append((number, None))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.note(value)
        return out


def training_events(model: str, *, micro_batch: int, seq_len: int, checkpoint: bool = False, steps: int = 2,
                    dtype: str = "bfloat16") -> list[Event]:
    """Allocation events of `steps` AdamW training steps of a catalog model in `dtype` (weights and states),
    SDPA attention, every layer fully checkpointed when `checkpoint` (HF activation checkpointing, non-reentrant)."""
    config = transformers_config(resolve(model))
    network = build_model(config, dtype=dtype, attention="sdpa")
    if checkpoint:
        network.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    to_fake(network, fake)
    recorder = _Allocations()
    with fake:
        tokens = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
    with fake, recorder:
        for parameter in network.parameters():
            recorder.note(parameter)
        optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4, foreach=True)
        for _ in range(steps):
            loss = network(input_ids=tokens, labels=tokens).loss
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return list(recorder.events)  # a copy: the model's own storages are freed (and noted) after it returns
