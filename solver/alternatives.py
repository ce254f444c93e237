"""The next-best distinct configurations and why each loses."""

from __future__ import annotations

from collections.abc import Callable

from costmodels import Cluster, Workload, estimate
from graphs import Checkpoint, LayerGraph

from .plan import Alternative, decisions_of
from .search import SearchResult
from .space import Outer, leanest_modes
from .tables import TICK_SECONDS, objective

GIB = 2**30


def alternatives(found: SearchResult, kinds: list[int], modes: tuple[Checkpoint, ...],
                 graph_of: Callable[[Outer], LayerGraph], cluster: Cluster, workload: Workload, *, chosen: int,
                 count: int) -> tuple[Alternative, ...]:
    """The best plan of each other configuration family (parallelism, engine, offload, precision, optimizer),
    found by the quick search, ranked by step time; families that cannot fit come last."""
    winner = found.tables[chosen]
    winner_time = winner.time_of(_modes_of(found, chosen, kinds, modes)) * TICK_SECONDS
    best: dict[tuple[object, ...], tuple[int, int, tuple[Checkpoint, ...]]] = {}
    for k, table in enumerate(found.tables):
        family = table.outer.family
        if family == winner.outer.family:
            continue
        plan = found.quick.get(k)
        if plan is None:
            continue
        value = objective(table, plan, tie_weight=found.weight)
        if family not in best or value < best[family][0]:
            best[family] = (value, k, plan)
    ranked = sorted(best.values())[:count]
    result = []
    for _, k, plan in ranked:
        table = found.tables[k]
        est = estimate(graph_of(table.outer), cluster, workload, table.outer.config(plan))
        slower = est.time.step_time / winner_time - 1 if winner_time else 0.0
        result.append(Alternative(decisions=decisions_of(table.outer, plan).summary(), step_time=est.time.step_time,
                                  device_peak=est.memory.device_peak, fits=True,
                                  why=f"{slower:+.1%} step time ({est.time.step_time:.3g} s vs {winner_time:.3g} s)"))
    if len(result) < count:
        result.extend(_misfits(found, kinds, modes, best, count - len(result)))
    return tuple(result)


def _modes_of(found: SearchResult, chosen: int, kinds: list[int], modes: tuple[Checkpoint, ...]
              ) -> tuple[Checkpoint, ...]:
    return found.result.modes if found.result.table == chosen else found.quick.get(chosen) \
        or tuple(Checkpoint.NONE for _ in kinds)


def _misfits(found: SearchResult, kinds: list[int], modes: tuple[Checkpoint, ...], fitting: dict, count: int
             ) -> list[Alternative]:
    """Families with no fitting plan, by how far their smallest footprint is over budget."""
    smallest: dict[tuple[object, ...], tuple[int, int]] = {}
    lean = leanest_modes(modes, len(kinds))
    for k, table in enumerate(found.tables):
        if table.outer.family in fitting or found.result.table == k:
            continue
        over = table.peak_of(lean) - table.budget
        if table.outer.family not in smallest or over < smallest[table.outer.family][0]:
            smallest[table.outer.family] = (over, k)
    result = []
    for over, k in sorted(smallest.values())[:count]:
        table = found.tables[k]
        why = (f"does not fit: even with every layer checkpointed it needs {over / GIB:.1f} GiB more per GPU "
               "(allocated) than the budget" if over > 0 else "offloaded states exceed the host RAM")
        result.append(Alternative(decisions=decisions_of(table.outer, lean).summary(), step_time=None,
                                  device_peak=table.peak_of(lean), fits=False, why=why))
    return result
