"""Search orchestration: tables for the space, bound-based pruning, a quick incumbent, then CP-SAT.

Pruning is exact: a configuration is dropped only when it cannot fit (its persistent states or its smallest
possible timeline exceed the budget) or when even its fastest possible step is slower than a plan already
found. Everything left goes into one CP-SAT model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from costmodels import Cluster, Workload
from graphs import Checkpoint, LayerGraph

from .model import SolveResult, build_model, solve
from .space import Outer, Space, canonical_modes
from .tables import Table, build_table, objective, tie_weight


@dataclass(frozen=True, slots=True)
class SearchResult:
    """What the search found, with the tables it used (for alternatives and diagnosis)."""

    result: SolveResult
    tables: list[Table]
    """Every table built (before pruning), in space order."""
    candidates: list[int]
    """Indices into `tables` that went into the CP-SAT model."""
    configurations: int
    """Outer configurations in the space."""
    weight: int
    quick: dict[int, tuple[Checkpoint, ...]]
    """The quick search's feasible assignment per table (tables where it found none are absent)."""


def build_tables(space: Space, graphs: Callable[[Outer], LayerGraph], cluster: Cluster, workload: Workload, *,
                 headroom: float, deadline: float | None = None) -> list[Table]:
    """Tables in space order; stops early at `deadline` (perf_counter seconds), so the time limit holds."""
    tables = []
    for rank, outer in enumerate(space.outers):
        if deadline is not None and tables and time.perf_counter() > deadline:
            break
        tables.append(build_table(graphs(outer), cluster, workload, outer, rank=rank, headroom=headroom))
    return tables


def fastest_modes(table: Table, kinds: list[int], modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...]:
    """The per-layer modes with the least time (recompute only costs); layers of one kind choose alike."""
    best: dict[int, Checkpoint] = {}
    for options, kind in zip(table.layer_ticks, kinds, strict=True):
        if kind not in best:
            ticks = dict(options)
            best[kind] = min((m for m in modes if m in ticks), key=lambda m: (ticks[m], m is not Checkpoint.NONE))
    return tuple(best[kind] for kind in kinds)


def quick_plan(table: Table, kinds: list[int], modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...] | None:
    """A good feasible assignment: no recompute if it fits, else the fewest leading layers checkpointed (by
    bisection on the canonical order, FULL first), else None."""
    if not table.host_ok:
        return None
    fastest = fastest_modes(table, kinds, modes)
    if table.peak_of(fastest) <= table.budget:
        return fastest
    for mode in (Checkpoint.SELECTIVE, Checkpoint.FULL):
        if mode not in modes:
            continue
        counts = _bisect(table, kinds, mode, modes)
        if counts is not None:
            return counts
    return None


def _bisect(table: Table, kinds: list[int], mode: Checkpoint, modes: tuple[Checkpoint, ...]
            ) -> tuple[Checkpoint, ...] | None:
    def assignment(fraction_layers: int) -> tuple[Checkpoint, ...]:
        counts = {}
        for kind in set(kinds):
            n = min(fraction_layers, kinds.count(kind))
            counts[kind] = (n, 0) if mode is Checkpoint.FULL else (0, n)
        result = canonical_modes(kinds, counts)
        if Checkpoint.NONE not in modes:
            result = tuple(m if m is not Checkpoint.NONE else mode for m in result)
        return result

    top = max(kinds.count(k) for k in set(kinds))
    if table.peak_of(assignment(top)) > table.budget:
        return None
    low, high = 0, top
    while low < high:
        middle = (low + high) // 2
        if table.peak_of(assignment(middle)) <= table.budget:
            high = middle
        else:
            low = middle + 1
    return assignment(low)


def search(tables: list[Table], kinds: list[int], modes: tuple[Checkpoint, ...], *, time_limit: float,
           configurations: int) -> SearchResult:
    start = time.perf_counter()
    weight = tie_weight(tables, len(kinds))
    incumbent: tuple[int, int, tuple[Checkpoint, ...]] | None = None
    quick: dict[int, tuple[Checkpoint, ...]] = {}
    lower = {k: objective(t, fastest_modes(t, kinds, modes), tie_weight=weight) for k, t in enumerate(tables)
             if t.states_fit}
    viable = sorted(lower, key=lambda k: lower[k])
    for k in viable:  # fastest first: once a plan is found, slower configurations need no memory terms
        if incumbent is not None and lower[k] > incumbent[0]:
            break
        plan = quick_plan(tables[k], kinds, modes)
        if plan is not None:
            quick[k] = plan
            value = objective(tables[k], plan, tie_weight=weight)
            if incumbent is None or value < incumbent[0]:
                incumbent = (value, k, plan)
    viable.sort()
    # Without a quick plan, CP-SAT still gets every viable table to prove infeasibility or find one.
    candidates = viable if incumbent is None else [k for k in viable if lower[k] <= incumbent[0]]
    if not candidates:
        empty = SolveResult("INFEASIBLE", None, None, time.perf_counter() - start, None, ())
        return SearchResult(empty, tables, [], configurations, weight, quick)
    chosen = [tables[k] for k in candidates]
    hint = None if incumbent is None else (candidates.index(incumbent[1]), incumbent[2])
    remaining = max(0.05, time_limit - (time.perf_counter() - start))
    pm = build_model(chosen, kinds, modes, weight=weight, hint=hint)
    result = solve(pm, time_limit=remaining)
    if result.table is not None:
        status = result.status if len(tables) == configurations else "FEASIBLE"  # part of the space unexplored
        result = SolveResult(status, result.objective, result.bound, result.wall_seconds,
                             candidates[result.table], result.modes)
    elif incumbent is not None:  # time limit hit before CP-SAT found anything: keep the quick plan
        result = SolveResult("FEASIBLE", incumbent[0], None, result.wall_seconds, incumbent[1], incumbent[2])
    return SearchResult(result, tables, candidates, configurations, weight, quick)
