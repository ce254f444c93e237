"""FSDP2's CPU-offload copies as its streams run them (issue 35 item 13).

The reference is a small stream-and-event simulator driven by the calls torch's FSDP2 makes, in the order it makes
them (`torch/distributed/fsdp/_fully_shard/`: `FSDPParamGroup.pre_forward` / `unshard` / `wait_for_unshard` /
`pre_backward` / `_backward_prefetch` / `post_backward`, `foreach_all_gather`, `foreach_reduce`): every operation
queues on its stream and starts when the stream is free, every event it waits has fired, and the host has issued it
(the host runs ahead except where a copy blocks it). `costmodels.offload_schedule` must give the same times from its
recurrences, over random per-unit compute, collective and copy times.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from costmodels.offload_schedule import Unit, backward_seconds, exposed_copy_seconds, forward_seconds

COPY_IN, GATHER, DEFAULT, REDUCE = "copy_in", "all_gather", "default", "reduce_scatter"


class Streams:
    """CUDA-like streams: operations run in issue order on each stream; an event fires when the work queued before
    it on its stream is done; `wait` holds a stream's later work until an event; `sync` holds the host."""

    def __init__(self) -> None:
        self.free: dict[str, float] = defaultdict(float)
        self.host = 0.0

    def run(self, stream: str, seconds: float) -> None:
        self.free[stream] = max(self.free[stream], self.host) + seconds

    def record(self, stream: str) -> float:
        return max(self.free[stream], self.host)

    def wait(self, stream: str, event: float) -> None:
        self.free[stream] = max(self.free[stream], event)

    def sync(self, event: float) -> None:
        self.host = max(self.host, event)


def unshard(streams: Streams, unit: Unit, *, copies: bool) -> float:
    """`foreach_all_gather`: the host shard's copy to the device in the copy-in stream (`all_gather_inputs`), the
    all-gather stream waits it, then the collective; returns the all-gather's event."""
    streams.run(COPY_IN, unit.up if copies else 0.0)
    streams.wait(GATHER, streams.record(COPY_IN))
    streams.run(GATHER, unit.gather)
    return streams.record(GATHER)


def simulated_forward(units: list[Unit], *, lead: float, copies: bool) -> float:
    streams = Streams()
    state = streams.record(DEFAULT)  # the root's copy-out, kept as the all-gather state (deferred free)
    streams.run(DEFAULT, lead)  # the root's own forward (embedding) before the first layer
    for unit in units:
        gathered = unshard(streams, unit, copies=copies)  # pre_forward: unshard, then wait_for_unshard
        streams.wait(COPY_IN, state)  # forward's implicit prefetch: wait the previous copy-out
        streams.wait(GATHER, state)
        streams.wait(DEFAULT, gathered)  # foreach_all_gather_copy_out
        state = streams.record(DEFAULT)
        streams.run(DEFAULT, unit.forward)
    return streams.free[DEFAULT]


def simulated_backward(units: list[Unit], *, lead: float, tail: float, copies: bool, blocking: bool) -> float:
    """`units` in backward order; the root's pre-backward prefetches the first of them."""
    streams = Streams()
    gathered = [unshard(streams, units[0], copies=copies)]
    streams.run(DEFAULT, lead)  # head, norm and loss backward
    kept: list[float] = []  # reduce-scatter states (one input buffer kept)
    for k, unit in enumerate(units):
        streams.wait(DEFAULT, gathered[k])  # pre_backward: wait_for_unshard
        copied_out = streams.record(DEFAULT)
        streams.wait(COPY_IN, copied_out)
        streams.wait(GATHER, copied_out)
        if k + 1 < len(units):  # _backward_prefetch
            gathered.append(unshard(streams, units[k + 1], copies=copies))
        streams.run(DEFAULT, unit.backward)
        if kept:  # post_backward: reclaim the oldest reduce-scatter input
            streams.wait(DEFAULT, kept.pop(0))
        streams.wait(REDUCE, streams.record(DEFAULT))  # foreach_reduce
        streams.run(REDUCE, unit.reduce)
        kept.append(streams.record(REDUCE))
        streams.run(REDUCE, unit.down if copies else 0.0)  # the gradient shard to the host
        if copies and blocking:
            streams.sync(streams.record(REDUCE))
    streams.run(DEFAULT, tail)
    return max(streams.free[DEFAULT], streams.free[REDUCE])  # finalize_backward


def random_units(rng: random.Random, count: int) -> list[Unit]:
    """Per-unit times from well under to well over each other, so that every wait in the schedule binds somewhere."""
    def draw() -> float:
        return rng.choice([0.0, rng.uniform(0.0, 1.0), rng.uniform(0.0, 4.0)])

    return [Unit(forward=draw(), backward=draw(), gather=draw(), reduce=draw(), up=draw(), down=draw())
            for _ in range(count)]


@pytest.mark.parametrize("seed", range(200))
def test_the_recurrences_match_the_simulated_fsdp2_streams(seed):
    rng = random.Random(seed)
    units = random_units(rng, rng.randint(1, 9))
    lead, back_lead, tail = rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, 2)
    backward = units[::-1]
    assert forward_seconds(units, lead=lead) == pytest.approx(simulated_forward(units, lead=lead, copies=True))
    for blocking in (False, True):
        assert backward_seconds(backward, lead=back_lead, tail=tail, blocking=blocking) == pytest.approx(
            simulated_backward(backward, lead=back_lead, tail=tail, copies=True, blocking=blocking))
        expected = (simulated_forward(units, lead=lead, copies=True)
                    - simulated_forward(units, lead=lead, copies=False)
                    + simulated_backward(backward, lead=back_lead, tail=tail, copies=True, blocking=blocking)
                    - simulated_backward(backward, lead=back_lead, tail=tail, copies=False, blocking=False))
        assert exposed_copy_seconds(units, forward_lead=lead, backward_lead=back_lead, backward_tail=tail,
                                    blocking=blocking) == pytest.approx(expected)


def test_copies_hide_behind_longer_compute_but_for_the_edges():
    """Equal layers whose compute outlasts copy plus collective: only the first layer's copy in forward and the last
    gradient copy in backward (nothing computes after it but the short tail) are exposed."""
    unit = Unit(forward=1.0, backward=2.0, gather=0.3, reduce=0.3, up=0.4, down=0.4)
    exposed = exposed_copy_seconds([unit] * 8, backward_lead=1.0, backward_tail=0.1)
    assert exposed == pytest.approx(unit.up + unit.down)
    fully = 8 * (2 * unit.up + unit.down)
    assert exposed < fully


def test_blocking_gradient_copies_expose_each_reduce_scatter_and_copy():
    """An accumulating micro-batch copies each gradient shard synchronously: the next layer's backward cannot be
    issued before it lands, so every reduce-scatter and copy but the ones the tail covers stand in the way."""
    unit = Unit(forward=1.0, backward=2.0, gather=0.3, reduce=0.3, up=0.4, down=0.4)
    free = exposed_copy_seconds([unit] * 8, backward_lead=1.0)
    blocked = exposed_copy_seconds([unit] * 8, backward_lead=1.0, blocking=True)
    assert blocked == pytest.approx(free + 7 * (unit.reduce + unit.down))
