"""One table's assignments below a cut-off, all evaluated at once: the exact proof that a table cannot beat the
best plan so far, where its assignments are few.

The CP-SAT model places each kind's checkpointed layers first, in canonical order (`space.canonical_modes`), so
a table's assignments are its per-kind count vectors. When a cut-off leaves few of them (one layer kind and an
incumbent that leaves little recompute time: every Llama-like model at scale), evaluating each against the same
memory events (`model._events`, the timeline of `activations.walk` as sums) and the same objective
(`tables.objective`) settles the table faster than a CP-SAT proof, and as exactly. `search.solve_each` skips
the tables this proves cannot win and hands CP-SAT the rest, with the best assignment found as its hint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphs import Checkpoint
from solver.search.space import CHECKPOINTED, canonical_modes
from solver.search.tables import Table, rank_step, recompute_weight

MAX_VECTORS = 2_000_000
"""More count vectors below the cut-off than this: left to CP-SAT (the evaluation would take longer)."""
_BATCH = 8192
_CHUNK = 1 << 18
"""Vectors checked at once against the binding events (bounds the arrays to tens of MB)."""
_SAMPLE = 64
"""Vectors whose binding events (the largest of each walk) are checked first for all vectors."""
_MAX_COMPOSITIONS = 4_000_000
"""A kind with more count vectors than this (before the cut-off): not tried (their memory, not their time,
would be large)."""
_ATTRS = ("fwd_net", "fwd_peak", "released_after_forward", "bwd_net", "bwd_peak", "bwd_peak_fresh", "grads")


@dataclass(frozen=True, slots=True)
class Below:
    """The table's best assignment with an objective below the cut-off, or None where none fits."""

    objective: int | None
    modes: tuple[Checkpoint, ...] = ()


def best_below(table: Table, kinds: list[int], modes: tuple[Checkpoint, ...], *, weight: int,
               cutoff: int) -> Below | None:
    """The best fitting assignment of `table` whose objective (`tables.objective` with `weight`) is below
    `cutoff`, as the CP-SAT model of this table alone would find it; None when the count vectors below the cut-off
    are more than `MAX_VECTORS` or the table is a pipeline rank's with moments of different micro-batches in flight
    (not tried)."""
    if table.memory.single_stage_others() is None:
        return None  # a rank of several stages or a zero-bubble split: its moments are left to CP-SAT
    checkpointed = tuple(m for m in CHECKPOINTED if m in modes and table.outer.runs(m))
    every_layer = Checkpoint.NONE not in modes or not table.outer.runs(Checkpoint.NONE)  # activation offload
    order = sorted(set(kinds))
    base, ticks = _time_deltas(table, kinds, order, checkpointed)
    base = base * weight + table.rank * rank_step(len(kinds))
    unit = np.array([recompute_weight(m) for m in checkpointed], dtype=np.int64)
    if any(math.comb(kinds.count(kind) + len(checkpointed), len(checkpointed)) > _MAX_COMPOSITIONS for kind in order):
        return None
    options = []
    for kind in order:
        counts = _compositions(kinds.count(kind), len(checkpointed), every_layer)
        options.append((counts, counts @ (ticks[kind] * weight + unit)))
    if any(len(counts) == 0 for counts, _ in options):
        return Below(None)
    cheapest = sum(int(costs.min()) for _, costs in options)
    kept = []
    for counts, costs in options:  # a kind's vector must leave the other kinds their cheapest
        keep = base + cheapest - int(costs.min()) + costs < cutoff
        kept.append((counts[keep], costs[keep]))
    total = int(np.prod([len(counts) for counts, _ in kept], dtype=np.float64))
    if total > MAX_VECTORS:
        return None
    counts, costs = _product(kept)
    below = np.flatnonzero(base + costs < cutoff)
    below = below[np.argsort(costs[below], kind="stable")]  # best objective first
    counts, objectives = counts[below], base + costs[below]
    if not len(counts):
        return Below(None)
    events = _Events(table, kinds, order, checkpointed)
    # Most vectors fail at the events that bind on the likeliest winners: check those first, for all vectors (a
    # vector failing any event does not fit), then every event for the survivors, best first, until one fits.
    binding = events.binding(counts[:_SAMPLE])
    survivors = np.concatenate([start + np.flatnonzero(events.fits(counts[start:start + _CHUNK], binding))
                                for start in range(0, len(counts), _CHUNK)])
    everything = np.arange(len(table.memory.nodes))
    for start in range(0, len(survivors), _BATCH):
        batch = survivors[start:start + _BATCH]
        fits = events.fits(counts[batch], everything)
        if fits.any():
            best = int(batch[np.argmax(fits)])
            per_kind = {kind: _full_counts(counts[best, j], checkpointed) for j, kind in enumerate(order)}
            return Below(int(objectives[best]), canonical_modes(kinds, per_kind))
    return Below(None)


def _time_deltas(table: Table, kinds: list[int], order: list[int], checkpointed: tuple[Checkpoint, ...]
                 ) -> tuple[int, dict[int, np.ndarray]]:
    """(ticks with every layer in NONE, per kind the ticks each checkpointed mode adds), as `model.add_step_time`
    states them (a mode a layer lacks costs what NONE costs)."""
    base, deltas = table.fixed_ticks, {}
    for kind in order:
        values = dict(table.layer_ticks[kinds.index(kind)])
        none = values.get(Checkpoint.NONE, 0)
        base += kinds.count(kind) * none
        deltas[kind] = np.array([values.get(m, none) - none for m in checkpointed], dtype=np.int64)
    return base, deltas


def _compositions(layers: int, modes: int, every_layer: bool) -> np.ndarray:
    """Every vector of per-mode counts of one kind (rows): nonnegative, summing to at most `layers` (exactly,
    when no layer may stay un-checkpointed). Built a mode at a time: each row so far gets every count its
    remaining layers allow."""
    rows, remaining = np.zeros((1, 0), dtype=np.int64), np.array([layers], dtype=np.int64)
    for _ in range(modes):
        options = remaining + 1
        parent = np.repeat(np.arange(len(rows)), options)
        count = np.arange(len(parent)) - np.repeat(np.cumsum(options) - options, options)
        rows = np.concatenate([rows[parent], count[:, None]], axis=1)
        remaining = remaining[parent] - count
    return rows[remaining == 0] if every_layer else rows


def _product(kept: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """All combinations of the kinds' vectors: counts (rows, kinds, modes) and summed costs."""
    counts, costs = kept[0][0][:, None, :], kept[0][1]
    for more, more_costs in kept[1:]:
        n, m = len(counts), len(more)
        counts = np.concatenate([np.repeat(counts, m, axis=0), np.tile(more[:, None, :], (n, 1, 1))], axis=1)
        costs = np.repeat(costs, m) + np.tile(more_costs, n)
    return counts, costs


def _full_counts(row: np.ndarray, checkpointed: tuple[Checkpoint, ...]) -> tuple[int, ...]:
    """A kind's counts in `CHECKPOINTED` order (0 for the modes not searched), as `canonical_modes` reads them."""
    by_mode = dict(zip(checkpointed, (int(c) for c in row), strict=True))
    return tuple(by_mode.get(m, 0) for m in CHECKPOINTED)


class _Events:
    """The memory events of one table (`model._events`) as functions of the count vectors: each event is a
    constant (every layer in NONE) plus, per kind and checkpointed mode, that mode's per-layer deltas times how
    many of the kind's layers before (and through) the event's node take the mode. Under the canonical order that
    number is clip(q - layers in earlier modes, 0, layers in this mode), so an event costs O(kinds x modes)
    per vector and any subset of events can be checked alone."""

    def __init__(self, table: Table, kinds: list[int], order: list[int], checkpointed: tuple[Checkpoint, ...]
                 ) -> None:
        terms = table.memory
        self.terms, self.table = terms, table
        nodes = terms.nodes
        n = len(nodes)
        none = {attr: np.array([getattr(dict(options)[Checkpoint.NONE], attr) for options in nodes],
                               dtype=np.int64) for attr in _ATTRS}
        decoders = [i for i, options in enumerate(nodes) if options[0][1].decoder]
        last = decoders[-1] if decoders else -1
        node_kind = {i: kinds[p] for p, i in enumerate(decoders)}
        self.before = {kind: np.zeros(n, dtype=np.int64) for kind in order}  # the kind's layers before node i
        self.through = {kind: np.zeros(n, dtype=np.int64) for kind in order}  # ... and through node i
        seen = dict.fromkeys(order, 0)
        self.deltas: dict[int, dict[str, np.ndarray]] = {}
        for i, options in enumerate(nodes):
            for kind in order:
                self.before[kind][i] = seen[kind]
            if i in node_kind:
                kind = node_kind[i]
                seen[kind] += 1
                if kind not in self.deltas:  # the first layer of a kind gives its deltas (`model._Sums`)
                    by_mode = dict(options)
                    self.deltas[kind] = {attr: np.array(
                        [getattr(by_mode.get(m, by_mode[Checkpoint.NONE]), attr)
                         - getattr(by_mode[Checkpoint.NONE], attr) for m in checkpointed], dtype=np.int64)
                        for attr in _ATTRS}
            for kind in order:
                self.through[kind][i] = seen[kind]
        self.order = [kind for kind in order if kind in self.deltas]
        self.index = {kind: order.index(kind) for kind in self.order}
        kept = np.cumsum([0] + [extra[1] for extra in terms.extra], dtype=np.int64)
        drop = np.array([terms.forward_only if i > last >= 0 else 0 for i in range(n)], dtype=np.int64)
        self.forward = (terms.start - drop + np.array([e[0] for e in terms.extra], dtype=np.int64) + kept[:-1]
                        + np.cumsum(none["fwd_net"]) - none["fwd_net"] + none["fwd_peak"])
        self.live_end = (terms.start - (terms.forward_only if last >= 0 else 0) + int(none["fwd_net"].sum())
                         - int(none["released_after_forward"].sum()))
        self.backward = {}
        for fresh, _ in terms.walks:
            later = none["bwd_net"] + (none["grads"] if fresh else 0)
            self.backward[fresh] = (later.sum() - np.cumsum(later) + none["bwd_peak_fresh" if fresh else "bwd_peak"]
                                    + np.array([e[2] for e in terms.extra], dtype=np.int64) + kept[1:])

    def fits(self, counts: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Per vector (rows of `counts`: kinds x modes), whether the events at the nodes `columns` stay within
        every walk's limit (`model.add_memory_limit`)."""
        fits = np.ones(len(counts), dtype=bool)
        for peaks, limit in self._peaks(counts, columns):
            fits &= peaks.max(axis=1, initial=np.iinfo(np.int64).min) <= limit
        return fits

    def binding(self, counts: np.ndarray) -> np.ndarray:
        """The nodes whose events are the largest of some walk for some of `counts`."""
        everything = np.arange(len(self.terms.nodes))
        return np.unique(np.concatenate([peaks.argmax(axis=1) for peaks, _ in self._peaks(counts, everything)]))

    def _peaks(self, counts: np.ndarray, columns: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """(events at `columns` per vector, each vector's limit) for the forward events and each walk's backward
        events."""
        terms = self.terms
        forward = np.broadcast_to(self.forward[columns], (len(counts), len(columns))).copy()
        backward = {fresh: np.broadcast_to(row[columns], forward.shape).copy() for fresh, row in self.backward.items()}
        live_end = np.full(len(counts), self.live_end, dtype=np.int64)
        for kind in self.order:
            mine = counts[:, self.index[kind], :]
            earlier = np.cumsum(mine, axis=1) - mine
            before, through = self.before[kind][columns][None, :], self.through[kind][columns][None, :]
            d = self.deltas[kind]
            for m in range(mine.shape[1]):
                low, size = earlier[:, m:m + 1], mine[:, m:m + 1]
                at_before = np.clip(before - low, 0, size)
                at_through = np.clip(through - low, 0, size)
                forward += d["fwd_net"][m] * at_before + d["fwd_peak"][m] * (at_through - at_before)
                live_end += (d["fwd_net"][m] - d["released_after_forward"][m]) * mine[:, m]
                for fresh in backward:
                    later = d["bwd_net"][m] + (d["grads"][m] if fresh else 0)
                    peak = d["bwd_peak_fresh" if fresh else "bwd_peak"][m]
                    backward[fresh] += later * (size - at_through) + peak * (at_through - at_before)
        others = (terms.single_stage_others() or 0) * live_end + terms.buffers
        result = []
        for fresh, before in terms.walks:
            limit = self.table.budget - terms.states.gpu_total - before
            result.append((forward, limit - others))
            result.append((backward[fresh], limit - others - live_end))
        return result
