"""The only place costs become integers: per outer configuration, time in ticks per layer and mode, and the
memory terms (already integer bytes) with the allocated-byte budget they must fit.

The CP-SAT model and the enumeration both read these tables, so comparing them is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from costmodels import Cluster, Config, Workload, check
from costmodels.compilation import COMPILE_MIN_SAVING
from costmodels.identity_memo import IdentityMemo
from costmodels.memory import allocated_peak, memory_terms, offload_bytes
from costmodels.pipeline_stages import RankSlice, rank_memory_terms
from costmodels.states import model_states
from costmodels.terms import MemoryTerms, ModelStates
from costmodels.timing import TimeTerms, time_terms
from costmodels.verdict import host_fits, memory_budget
from graphs import Checkpoint, LayerGraph
from solver.search.space import Outer

# Time resolution of the solver: 1 microsecond per tick (step times run from milliseconds to minutes).
TICK_SECONDS = 1e-6


def ticks(seconds: float) -> int:
    return round(seconds / TICK_SECONDS)


@dataclass(slots=True)
class Table:
    """One outer configuration's integer costs. The memory terms are built on first use: most
    configurations are pruned on time or persistent states alone."""

    outer: Outer
    rank: int
    """Position in the search space: breaks ties (simpler configurations first)."""
    fixed_ticks: int
    """Time that does not depend on checkpoint modes."""
    layer_ticks: tuple[tuple[tuple[Checkpoint, int], ...], ...]
    """Per decoder layer, its ticks in each mode."""
    states: ModelStates
    budget: int
    """Largest allocated peak that fits the usable device memory after overhead and allocator slack: the form
    of `costmodels.verdict.fits` the CP-SAT model can state (estimate's verdict agrees on every configuration)."""
    host_ok: bool
    """Offloaded states fit the nodes' CPU RAM and NVMe."""
    host_bytes: int
    """Host RAM per node the offloaded states need."""
    build_memory: Callable[[], MemoryTerms]
    _memory: MemoryTerms | None = None
    buffers: int = 0
    """Bytes allocated through the whole step outside the timeline (a pipeline rank's receive buffers)."""
    _peaks: dict[tuple[Checkpoint, ...], int] = field(init=False, default_factory=dict)
    """Peaks already walked, by modes: a pipeline rank's table is asked again for each split and block."""

    @property
    def memory(self) -> MemoryTerms:
        if self._memory is None:
            self._memory = self.build_memory()
        return self._memory

    @property
    def states_fit(self) -> bool:
        """The persistent states and the optimizer step fit, whatever the activations."""
        return self.host_ok and self.states.gpu_total + self.states.step_temp + self.buffers <= self.budget

    def time_of(self, modes: tuple[Checkpoint, ...]) -> int:
        return self.fixed_ticks + sum(dict(options)[m] for options, m in zip(self.layer_ticks, modes, strict=True))

    def peak_of(self, modes: tuple[Checkpoint, ...]) -> int:
        key = tuple(modes)
        if key not in self._peaks:
            memory = self.memory
            walk = lambda: allocated_peak(memory, key)[0]  # noqa: E731
            self._peaks[key] = _PEAKS.get((memory,), (key,), walk) if memory.moments else walk()
        return self._peaks[key]


# Pipeline ranks' peaks by memory terms (identity) and modes, across tables: a rank's terms are one object per shape,
# schedule and position (`pipeline_stages.rank_memory_terms`), shared by the splits and by a plan's side searches
# at other headrooms, whose tables differ in their budgets only.
_PEAKS: IdentityMemo[int] = IdentityMemo(limit=2**14)


def build_table(graph: LayerGraph, cluster: Cluster, workload: Workload, outer: Outer, *, rank: int,
                headroom: float, compile_auto: bool = False, eager_graph: LayerGraph | None = None,
                rank_slice: RankSlice | None = None, terms: TimeTerms | None = None,
                memo: dict[tuple[LayerGraph, Config], TimeTerms] | None = None) -> Table:
    """One configuration's table. With `compile_auto` a compiled configuration keeps torch.compile only where
    it saves at least `COMPILE_MIN_SAVING` of its fastest step, so that the search ranks what the plan runs;
    `eager_graph` is its lowering without compile (what it then saves). `rank_slice` makes it a pipeline rank's
    table (`graph` that slice's: `costmodels.pipeline_stages`, its stages, schedule and receive buffers); `terms`
    its time terms when the caller has them, `memo` the time terms already computed for other tables (a compiled
    configuration's eager twin)."""
    config = outer.config()
    check(graph, cluster, workload, config)
    terms = terms or timed(graph, cluster, workload, config, memo)
    if compile_auto and outer.compile:
        eager_config = replace(config, compile=False)
        graph_eager = eager_graph or graph
        eager = timed(graph_eager, cluster, workload, eager_config, memo)
        if 1 - fastest_step(terms) / fastest_step(eager) < COMPILE_MIN_SAVING:
            outer, config, terms, graph = replace(outer, compile=False), eager_config, eager, graph_eager
    fixed = ticks(terms.fixed.step_time)
    per_kind: dict[int, tuple[tuple[Checkpoint, int], ...]] = {}  # layers of one kind share their options
    for options in terms.layers:
        if id(options) not in per_kind:
            per_kind[id(options)] = tuple((mode, ticks(t.total)) for mode, t in options if outer.runs(mode))
    layers = tuple(per_kind[id(options)] for options in terms.layers)
    states = model_states(graph, config)
    budget = memory_budget(cluster, config, headroom)
    cpu, nvme = offload_bytes(cluster, config, states)
    host_ok = host_fits(cpu, nvme, cluster)
    return Table(outer=outer, rank=rank, fixed_ticks=fixed, layer_ticks=layers, states=states, budget=budget,
                 host_ok=host_ok, host_bytes=cpu, buffers=rank_slice.buffers if rank_slice else 0,
                 build_memory=lambda: (rank_memory_terms(rank_slice, workload, config) if rank_slice
                                       else memory_terms(graph, workload, config)))


def timed(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config,
          memo: dict[tuple[LayerGraph, Config], TimeTerms] | None) -> TimeTerms:
    """`time_terms`, looked up in `memo` first (one cluster and workload per memo; graphs compare by identity)."""
    if memo is None:
        return time_terms(graph, cluster, workload, config)
    if (graph, config) not in memo:
        memo[graph, config] = time_terms(graph, cluster, workload, config)
    return memo[graph, config]


def fastest_step(terms: TimeTerms) -> float:
    """Seconds of the step with every layer in its fastest mode."""
    fastest: dict[int, float] = {}
    for options in terms.layers:
        if id(options) not in fastest:
            fastest[id(options)] = min(t.total for _, t in options)
    return terms.fixed.step_time + sum(fastest[id(options)] for options in terms.layers)


def table_modes(table: Table, modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...]:
    """The allowed `modes` this configuration can run (none its launchers cannot express, `Outer.runs`)."""
    return tuple(m for m in modes if table.outer.runs(m))


# Tie-break among equal step times: fewer recomputed layers, the leaner modes counted heavier (as the canonical
# order places them, `space.CHECKPOINTED`).
RECOMPUTE_WEIGHT = {Checkpoint.NONE: 0, Checkpoint.SELECTIVE: 1, Checkpoint.OP_SELECTIVE: 2, Checkpoint.FULL: 3}


def recompute_weight(mode: Checkpoint) -> int:
    return RECOMPUTE_WEIGHT[mode]


def rank_step(layers: int) -> int:
    """The tie-break value of one configuration rank: above any sum of `recompute_weight` over the layers."""
    return max(RECOMPUTE_WEIGHT.values()) * layers + 1


def objective(table: Table, modes: tuple[Checkpoint, ...], *, tie_weight: int) -> int:
    """Step ticks first; among equal times, the earlier configuration and fewer recomputed layers."""
    recomputed = sum(recompute_weight(m) for m in modes)
    return table.time_of(modes) * tie_weight + table.rank * rank_step(len(modes)) + recomputed


def tie_weight(tables: list[Table], layers: int) -> int:
    """A weight that keeps the tie-break below one tick."""
    return (max((t.rank for t in tables), default=0) + 1) * rank_step(layers) + 1
