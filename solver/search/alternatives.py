"""The next-best distinct configurations and why each loses, each reason read off the alternative's own
`Estimate` (the numbers `fitplan estimate` prints for that configuration)."""

from __future__ import annotations

import time
from collections.abc import Callable

from costmodels import Cluster, Estimate, Workload, estimate
from graphs import Checkpoint, LayerGraph
from solver.plan.record import Alternative, decisions_of
from solver.search.space import Outer, leanest_modes
from solver.search.table_search import SearchResult, fastest_modes, quick_plan
from solver.search.tables import TICK_SECONDS, Table, objective, table_modes

GIB = 2**30


def alternatives(found: SearchResult, kinds: list[int], modes: tuple[Checkpoint, ...],
                 graph_of: Callable[[Outer], LayerGraph], cluster: Cluster, workload: Workload, *,
                 chosen: int | None, count: int, deadline: float | None = None,
                 pipeline: tuple[Outer, float] | None = None) -> tuple[Alternative, ...]:
    """The best plan of each other configuration family (parallelism, engine, offload), ranked by step time;
    families that cannot fit come last. Past `deadline` (perf_counter seconds) no more are computed: the time
    limit covers the report too. `pipeline` is the winner and its step seconds when a pipeline configuration
    won (`chosen` is then None)."""
    if count <= 0:
        return ()
    if chosen is None:
        if pipeline is None:
            raise ValueError("alternatives need the chosen table or the winning pipeline configuration")
        winner_outer, winner_time = pipeline
    else:
        winner_outer = found.tables[chosen].outer
        winner_time = found.tables[chosen].time_of(_modes_of(found, chosen, kinds)) * TICK_SECONDS
    best = _fitting_per_family(found, kinds, modes, winner_outer.family, deadline)
    result = []
    for _, k, plan in sorted(best.values())[:count]:
        if _past(deadline):
            return tuple(result)
        table = found.tables[k]
        est = estimate(graph_of(table.outer), cluster, workload, table.outer.config(plan))
        slower = est.time.step_time / winner_time - 1 if winner_time else 0.0
        result.append(Alternative(decisions=decisions_of(table.outer, plan).summary(), step_time=est.time.step_time,
                                  device_peak=est.memory.device_peak, fits=True,
                                  why=f"{slower:+.1%} step time ({est.time.step_time:.3g} s vs {winner_time:.3g} s)"))
    if len(result) < count and not _past(deadline):
        result.extend(_misfits(found, kinds, modes, {*best, winner_outer.family}, count - len(result), graph_of,
                               cluster, workload, deadline))
    return tuple(result)


def _fitting_per_family(found: SearchResult, kinds: list[int], modes: tuple[Checkpoint, ...],
                        winner: tuple[object, ...], deadline: float | None
                        ) -> dict[tuple[object, ...], tuple[int, int, tuple[Checkpoint, ...]]]:
    """Per other family, its best quick plan: from the search where it made one, otherwise from the family's
    tables in order of their fastest possible step (the search pruned those on time, not on memory)."""
    best: dict[tuple[object, ...], tuple[int, int, tuple[Checkpoint, ...]]] = {}
    for k, plan in found.quick.items():
        family = found.tables[k].outer.family
        value = objective(found.tables[k], plan, tie_weight=found.weight)
        if family != winner and (family not in best or value < best[family][0]):
            best[family] = (value, k, plan)
    untried: dict[tuple[object, ...], list[int]] = {}
    for k, table in enumerate(found.tables):
        family = table.outer.family
        if family != winner and family not in best and table.states_fit:
            untried.setdefault(family, []).append(k)
    def fastest(i: int) -> int:  # the table's step with every layer in its fastest runnable mode
        table = found.tables[i]
        return table.time_of(fastest_modes(table, kinds, table_modes(table, modes)))

    for family, indices in untried.items():
        for k in sorted(indices, key=fastest):
            if _past(deadline):
                return best
            plan = quick_plan(found.tables[k], kinds, modes)
            if plan is not None:
                best[family] = (objective(found.tables[k], plan, tie_weight=found.weight), k, plan)
                break
    return best


def _modes_of(found: SearchResult, chosen: int, kinds: list[int]) -> tuple[Checkpoint, ...]:
    return found.result.modes if found.result.table == chosen else found.quick.get(chosen) \
        or tuple(Checkpoint.NONE for _ in kinds)


def _misfits(found: SearchResult, kinds: list[int], modes: tuple[Checkpoint, ...], fitting: set, count: int,
             graph_of: Callable[[Outer], LayerGraph], cluster: Cluster, workload: Workload,
             deadline: float | None) -> list[Alternative]:
    """Families with no fitting plan, by how far their smallest footprint is over budget, each with the reason
    its leanest estimate gives."""
    smallest: dict[tuple[object, ...], tuple[int, int]] = {}
    lean = leanest_modes(modes, len(kinds))
    for k, table in enumerate(found.tables):
        if table.outer.family in fitting:
            continue
        if _past(deadline):
            break
        over = table.peak_of(lean) - table.budget
        if table.outer.family not in smallest or over < smallest[table.outer.family][0]:
            smallest[table.outer.family] = (over, k)
    result = []
    for _, k in sorted(smallest.values())[:count]:
        table = found.tables[k]
        est = estimate(graph_of(table.outer), cluster, workload, table.outer.config(lean))
        result.append(Alternative(decisions=decisions_of(table.outer, lean).summary(), step_time=None,
                                  device_peak=est.memory.device_peak, fits=False,
                                  why=misfit_reason(est, table, cluster, lean)))
    return result


def misfit_reason(est: Estimate, table: Table, cluster: Cluster, lean: tuple[Checkpoint, ...]) -> str:
    """Why a configuration cannot run, from its estimate: host RAM for offloaded states, or device memory."""
    if est.memory.cpu_bytes_per_node > cluster.cpu_ram_per_node:
        return (f"offloaded states need {est.memory.cpu_bytes_per_node / GIB:.0f} GiB of host RAM per node; the node "
                f"has {cluster.cpu_ram_per_node / GIB:.0f} GiB (--cpu-ram-gib changes it)")
    if est.memory.nvme_bytes_per_node and cluster.nvme_bandwidth <= 0:
        return "NVMe offload needs the cluster's NVMe bandwidth (--nvme-gbps)"
    what = "with every layer checkpointed" if Checkpoint.FULL in lean else f"with every layer in {lean[0]} mode"
    return (f"does not fit: {what} it allocates {est.memory.allocated_peak / GIB:.1f} GiB per GPU at its peak; "
            f"{table.budget / GIB:.1f} GiB is available after overhead and headroom")


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline
