"""Search orchestration: tables for the space, bound-based pruning, a quick incumbent, then CP-SAT.

Pruning is exact: a configuration is dropped only when it cannot fit (its persistent states or its smallest
possible timeline exceed the budget) or when even its fastest possible step is slower than a plan already
found, or when another configuration dominates it (`dominates`). Everything left is solved by CP-SAT, one model
per configuration in the order of its fastest step, each asked only to beat the best plan so far (`solve_each`):
the minimum over configurations of each one's minimum, as the joint model would find it. A configuration whose
assignments below the best so far are few is proved unable to win by evaluating them all (`count_search`), the
others mostly by CP-SAT's linear relaxation.

Under a time limit, tables are built leanest first (smallest micro-batch, most sharded and offloaded), so a
plan that fits is found before the limit whenever one exists among the leanest configurations. The search
says INFEASIBLE only when every configuration was built and none fits; a search cut short by the limit
reports FEASIBLE (a plan, not proven best) or UNKNOWN (no plan yet, nothing proven).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodels import Cluster, Config, Offload, Workload, precision
from costmodels.activations import NodeMemory
from costmodels.memory import others_at_most
from costmodels.pipeline import Moment
from costmodels.terms import MemoryTerms
from costmodels.timing import TimeTerms
from graphs import Checkpoint, LayerGraph
from solver.search.count_search import best_below
from solver.search.model import SolveResult, add_objective_cutoff, build_model, solve
from solver.search.space import CHECKPOINTED, Outer, Space, canonical_modes
from solver.search.tables import Table, build_table, objective, table_modes, tie_weight


@dataclass(frozen=True, slots=True)
class SearchResult:
    """What the search found, with the tables it used (for alternatives and diagnosis)."""

    result: SolveResult
    tables: list[Table]
    """Every table built (before pruning), in space order."""
    candidates: list[int]
    """Indices into `tables` that went to CP-SAT."""
    configurations: int
    """Outer configurations in the space."""
    weight: int
    quick: dict[int, tuple[Checkpoint, ...]]
    """The quick search's feasible assignment per table (tables where it found none are absent)."""


def build_order(outers: tuple[Outer, ...]) -> list[int]:
    """Indices of `outers`, leanest first: the configurations most likely to fit come before the rest, so a
    search cut short by its time limit has a plan whenever the leanest configurations hold one."""
    def leanness(index: int) -> tuple[object, ...]:
        o = outers[index]
        return (o.micro_batch, -o.zero, o.param_offload is Offload.NONE, o.optimizer_offload is Offload.NONE,
                -o.tp, precision.compute_itemsize(o.precision), index)
    return sorted(range(len(outers)), key=leanness)


def build_tables(space: Space, graphs: Callable[[Outer], LayerGraph], cluster: Cluster, workload: Workload, *,
                 headroom: float, deadline: float | None = None,
                 memo: dict[tuple[LayerGraph, Config], TimeTerms] | None = None) -> list[Table]:
    """Tables built leanest first (`build_order`), stopping at `deadline` (perf_counter seconds) so the time
    limit holds; returned in tie-break order with `rank` set (see `tie_break_ranks`). `memo`: time terms priced
    before on this cluster and workload (by another search of the space at another headroom)."""
    tables: list[Table] = []
    memo = memo if memo is not None else {}
    for index in build_order(space.outers):
        if deadline is not None and tables and time.perf_counter() > deadline:
            break
        outer = space.outers[index]
        eager = graphs(replace(outer, compile=False)) if space.compile_auto and outer.compile else None
        tables.append(build_table(graphs(outer), cluster, workload, outer, rank=index, headroom=headroom,
                                  compile_auto=space.compile_auto, eager_graph=eager, memo=memo))
    return tie_break_ranks(tables)


def tie_break_ranks(tables: list[Table]) -> list[Table]:
    """Among equal step times the solver prefers the lower rank: the configuration with the least persistent
    memory per GPU (more headroom), then the earlier one in space order (simpler)."""
    ordered = sorted(tables, key=lambda t: (t.states.gpu_total + t.states.step_temp, t.rank))
    for rank, table in enumerate(ordered):
        table.rank = rank
    return ordered


def fastest_modes(table: Table, kinds: list[int], modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...]:
    """The per-layer modes with the least time (recompute only costs); layers of one kind choose alike."""
    best: dict[int, Checkpoint] = {}
    for options, kind in zip(table.layer_ticks, kinds, strict=True):
        if kind not in best:
            ticks = dict(options)
            best[kind] = min((m for m in modes if m in ticks), key=lambda m: (ticks[m], m is not Checkpoint.NONE))
    return tuple(best[kind] for kind in kinds)


def quick_plan(table: Table, kinds: list[int], modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...] | None:
    """A good feasible assignment: no recompute if it fits, else the fewest leading layers checkpointed in one
    mode (by bisection on the canonical order; the cheapest recompute tried first), else None."""
    if not table.host_ok:
        return None
    modes = table_modes(table, modes)
    fastest = fastest_modes(table, kinds, modes)
    if table.peak_of(fastest) <= table.budget:
        return fastest
    for mode in reversed(CHECKPOINTED):
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
            counts[kind] = tuple(n if m is mode else 0 for m in CHECKPOINTED)
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


def peak_lower_bound(table: Table, modes: tuple[Checkpoint, ...]) -> int:
    """An allocated peak no assignment of `modes` goes below: each of the timeline's events (`model._events`)
    takes, node by node, the mode that adds least to it, and the bound is the largest such event. Per stage and
    direction it is taken twice, each a bound: with the moment that has the most micro-batches in flight, its
    nodes choosing their mode for the running and the held micro-batches together; and with every moment, the held
    micro-batches at their least apart from the running one (exact with one mode). Above the budget it proves a
    table infeasible without CP-SAT (most pipeline ranks that cannot fit)."""
    terms = table.memory
    nodes = [[node for mode, node in options if mode in modes or not node.decoder] or [options[0][1]]
             for options in terms.nodes]
    spans = terms.stage_spans()
    least = _least_others(terms, nodes)
    best = terms.states.step_temp + terms.buffers + terms.states.accumulating_grads  # the optimizer step
    per_key = Counter((moment.stage, moment.forward) for moment in terms.moment_list())
    kept = [0, *itertools.accumulate(extra[1] for extra in terms.extra)]  # the engine's bytes kept to backward
    for (t, forward), moment in _largest_moments(terms.moment_list()).items():
        weights, constant = [0] * len(nodes), 0
        for span, full, after in zip(spans, moment.full, moment.after_input, strict=True):
            constant += (full + after) * terms.kept_base(span)
            for i in range(span.first, span.stop):
                weights[i] = full + (after if i < span.input_frees_from else 0)
        best = max(best, _events_bound(terms, nodes, kept, t, forward, weights, constant))
        if per_key[t, forward] > 1:  # with one moment, the bound above is at least this one
            best = max(best, _events_bound(terms, nodes, kept, t, forward, [0] * len(nodes), least[t, forward]))
    return terms.states.gpu_total + best


def _held(node: NodeMemory) -> int:
    return node.fwd_net - node.released_after_forward


def _least_others(terms: MemoryTerms, nodes: list[list[NodeMemory]]) -> dict[tuple[int, bool], int]:
    """Per (stage, forward), the most over its moments of what the other micro-batches hold, each node in the
    mode that keeps least (`memory.others_at_most`)."""
    return others_at_most(terms, [min(options, key=_held) for options in nodes])


def _events_bound(terms: MemoryTerms, nodes: list[list[NodeMemory]], kept: list[int], t: int, forward: bool,
                  weights: list[int], constant: int) -> int:
    """The largest of stage t's forward (or backward) events over the walks, each node in the mode that adds
    least to it, with `weights[i]` other micro-batches holding node i's kept bytes and `constant` more bytes
    (`kept[i]`: the engine's bytes the nodes before i keep to backward)."""
    span = terms.stage_spans()[t]
    first, stop = span.first, span.stop
    decoders = [i for i in range(first, stop) if nodes[i][0].decoder]
    last = decoders[-1] if decoders else -1
    outside = sum(min(weights[i] * _held(o) for o in nodes[i]) for i in (*range(first), *range(stop, len(nodes))))
    best = 0
    for fresh, before in terms.walks:
        base = before + constant + outside + terms.buffers + (span.other_grads if fresh else 0)
        if forward:
            # event i: nodes before i add fwd_net and their held bytes in the other micro-batches, i its peak
            ahead = [min(o.fwd_net + weights[i] * _held(o) for o in nodes[i]) for i in range(first, stop)]
            behind = [min(weights[i] * _held(o) for o in nodes[i]) for i in range(first, stop)]
            before_i, after_i = _prefix(ahead), _suffix(behind)
            for i in range(first, stop):
                own = min(o.fwd_peak + weights[i] * _held(o) for o in nodes[i])
                start = span.start - (span.forward_only if i > last >= 0 else 0)
                best = max(best, base + start + before_i[i - first] + own + after_i[i - first + 1]
                           + terms.extra[i][0] + kept[i] - kept[first])
            continue
        # event i: the stage's held bytes in all in-flight micro-batches, nodes after i their backward
        peak = "bwd_peak_fresh" if fresh else "bwd_peak"
        start = span.start - (span.forward_only if last >= 0 else 0)
        done = [min((1 + weights[i]) * _held(o) + o.bwd_net + (o.grads if fresh else 0) for o in nodes[i])
                for i in range(first, stop)]
        waiting = [min((1 + weights[i]) * _held(o) for o in nodes[i]) for i in range(first, stop)]
        before_i, after_i = _prefix(waiting), _suffix(done)
        for i in range(first, stop):
            own = min((1 + weights[i]) * _held(o) + getattr(o, peak) for o in nodes[i])
            best = max(best, base + start + before_i[i - first] + own + after_i[i - first + 1]
                       + terms.extra[i][2] + kept[i + 1] - kept[first])
    return best


def _largest_moments(moments: tuple[Moment, ...]) -> dict[tuple[int, bool], Moment]:
    """Per (stage, forward), its moment with the most micro-batches in flight (then the most full ones)."""
    def size(moment: Moment) -> tuple[int, int]:
        return sum(moment.full) + sum(moment.after_input), sum(moment.full)

    largest: dict[tuple[int, bool], Moment] = {}
    for moment in moments:
        key = (moment.stage, moment.forward)
        if key not in largest or size(moment) > size(largest[key]):
            largest[key] = moment
    return largest


def _prefix(values: list[int]) -> list[int]:
    """prefix[i] = sum(values[:i])."""
    return [0, *itertools.accumulate(values)]


def _suffix(values: list[int]) -> list[int]:
    """suffix[i] = sum(values[i:])."""
    return [*itertools.accumulate(reversed(values), initial=0)][::-1]


def dominates(a: Table, b: Table, modes: tuple[Checkpoint, ...]) -> bool:
    """Whether every assignment of `b` is one of `a` that fits as well and scores better: `a` comes first among
    equal times (lower rank), runs every mode `b` runs, takes no more ticks in any of them, and has the same
    activation timeline with at least as much room for it (budget less persistent states) and an optimizer step
    that fits whatever the modes. Such a `b` (the fp16 twin of a bf16 configuration, the foreach twin of a fused
    optimizer) never holds the optimum."""
    if a.rank >= b.rank or not a.host_ok or a.buffers != b.buffers or a.fixed_ticks > b.fixed_ticks:
        return False
    runs = table_modes(b, modes)
    if any(not a.outer.runs(m) for m in runs):
        return False
    for ours, theirs in zip(a.layer_ticks, b.layer_ticks, strict=True):
        if ours is not theirs and ours != theirs:
            mine = dict(ours)
            if any(m in runs and (m not in mine or mine[m] > value) for m, value in theirs):
                return False
    sa, sb = a.memory.states, b.memory.states
    return (a.budget - sa.gpu_total >= b.budget - sb.gpu_total
            and sa.gpu_total + sa.accumulating_grads + sa.step_temp + a.buffers <= a.budget
            and replace(a.memory, states=sb) == b.memory)


def undominated(tables: list[Table], candidates: list[int], modes: tuple[Checkpoint, ...]) -> list[int]:
    """`candidates` less those another candidate `dominates` (a strict order: what remains holds the optimum)."""
    return [k for k in candidates if not any(j != k and dominates(tables[j], tables[k], modes) for j in candidates)]


def search(tables: list[Table], kinds: list[int], modes: tuple[Checkpoint, ...], *, time_limit: float,
           configurations: int) -> SearchResult:
    """The best plan among `tables` within `time_limit` seconds (model building included). The status is
    OPTIMAL or INFEASIBLE only when `tables` covers all `configurations` and the search finished."""
    start = time.perf_counter()
    deadline = start + time_limit
    complete = len(tables) == configurations
    weight = tie_weight(tables, len(kinds))
    incumbent: tuple[int, int, tuple[Checkpoint, ...]] | None = None
    quick: dict[int, tuple[Checkpoint, ...]] = {}
    lower = {k: objective(t, fastest_modes(t, kinds, table_modes(t, modes)), tie_weight=weight)
             for k, t in enumerate(tables) if t.states_fit}
    viable = sorted(lower, key=lambda k: lower[k])
    for k in viable:  # fastest first: once a plan is found, slower configurations need no memory terms
        if incumbent is not None and (lower[k] > incumbent[0] or time.perf_counter() > deadline):
            break
        plan = quick_plan(tables[k], kinds, modes)
        if plan is not None:
            quick[k] = plan
            value = objective(tables[k], plan, tie_weight=weight)
            if incumbent is None or value < incumbent[0]:
                incumbent = (value, k, plan)
    viable.sort()
    # Without a quick plan, CP-SAT still gets every viable table to prove infeasibility or find one (less those
    # whose peak cannot come under the budget in any assignment).
    candidates = viable if incumbent is None else [k for k in viable if lower[k] <= incumbent[0]]
    candidates = [k for k in candidates if k in quick or peak_lower_bound(tables[k], table_modes(tables[k], modes))
                  <= tables[k].budget]
    candidates = undominated(tables, candidates, modes)
    if incumbent is not None and all(lower[k] >= incumbent[0] for k in candidates):
        # no candidate's fastest assignment is below the quick plan (the incumbent's own included): optimal
        status = "OPTIMAL" if complete else "FEASIBLE"
        result = SolveResult(status, incumbent[0], incumbent[0], time.perf_counter() - start, incumbent[1],
                             incumbent[2])
        return SearchResult(result, tables, candidates, configurations, weight, quick)
    if not candidates:
        status = "INFEASIBLE" if complete else "UNKNOWN"  # unbuilt configurations might fit
        empty = SolveResult(status, None, None, time.perf_counter() - start, None, ())
        return SearchResult(empty, tables, [], configurations, weight, quick)
    result = solve_each(tables, sorted(candidates, key=lambda k: (lower[k], k)), kinds, modes, weight=weight,
                        incumbent=incumbent, quick=quick, deadline=deadline)
    if result.table is not None:
        status = result.status if complete else "FEASIBLE"  # part of the space unexplored
        result = replace(result, status=status, wall_seconds=time.perf_counter() - start)
    elif result.status == "INFEASIBLE" and not complete:
        result = SolveResult("UNKNOWN", None, None, result.wall_seconds, None, ())
    return SearchResult(result, tables, candidates, configurations, weight, quick)


def solve_each(tables: list[Table], order: list[int], kinds: list[int], modes: tuple[Checkpoint, ...], *,
               weight: int, incumbent: tuple[int, int, tuple[Checkpoint, ...]] | None,
               quick: dict[int, tuple[Checkpoint, ...]], deadline: float) -> SolveResult:
    """The best assignment over the tables in `order` (by their fastest objective): one CP-SAT model per table,
    each asked only for objectives below the best so far (`model.add_objective_cutoff`), so a table that cannot
    beat it is proved so without its optimum; the visit stops once the tables' fastest objectives reach the
    best. A table whose count vectors below the best are few is settled by evaluating them all
    (`count_search.best_below`): skipped when none fits, else solved from the best of them as hint. An exact
    decomposition of the joint model: the minimum over tables of each table's minimum. OPTIMAL
    when every model finished, INFEASIBLE when none has a plan, FEASIBLE or UNKNOWN when the limit cut it."""
    begin = time.perf_counter()
    best = incumbent
    finished = True
    for k in order:
        table = tables[k]
        if best is not None and objective(table, fastest_modes(table, kinds, table_modes(table, modes)),
                                          tie_weight=weight) >= best[0]:
            break  # nothing in this table (nor in the later ones) goes below the cut-off
        if time.perf_counter() > deadline:
            finished = False
            break
        plan = best[2] if best is not None and best[1] == k else quick.get(k)
        if best is not None and (counted := best_below(table, kinds, modes, weight=weight, cutoff=best[0])):
            if counted.objective is None:
                continue  # proved by its count vectors: nothing in this table fits below the best so far
            plan = counted.modes  # CP-SAT confirms it as the table's optimum from this hint
        pm = build_model([table], kinds, modes, weight=weight, hint=None if plan is None else (0, plan))
        if best is not None:
            add_objective_cutoff(pm, best[0])
        found = solve(pm, time_limit=max(0.01, deadline - time.perf_counter()))
        if found.table is not None:
            best = (found.objective, k, found.modes)
        finished = finished and found.status in ("OPTIMAL", "INFEASIBLE")
    seconds = time.perf_counter() - begin
    if best is None:
        return SolveResult("INFEASIBLE" if finished else "UNKNOWN", None, None, seconds, None, ())
    status = "OPTIMAL" if finished else "FEASIBLE"
    return SolveResult(status, best[0], best[0] if finished else None, seconds, best[1], best[2])
