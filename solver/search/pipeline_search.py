"""Pipeline-parallel configurations, searched by an exact decomposition.

A pipeline rank's memory depends only on the checkpoint modes of its own layers, and the simulated step
(`costmodels.pipeline.pipeline_time`) never decreases when a stage gets slower: it is a longest path through the
schedule's dependencies. So with one stage per rank, the fastest modes that fit each rank give the fastest step
of the configuration; each rank's are found by CP-SAT on the rank's own table (the whole-model search's model,
with the rank's in-flight micro-batches and receive buffers). With several stages per rank the rank's modes
minimise its total time (the recompute of all its stages). `reference.py` enumerates every combination of the
ranks' modes through the simulation on small instances, and the tests check the two agree.

Configurations are visited in the order of a lower bound (their compute in the fastest modes spread over the
ranks) and the visit stops once the bound reaches the best step found, whole-model configurations included; a
configuration whose split and bubble alone (`stage_bound`) or whose ranks in their fastest modes, simulated, reach
that step is passed over. An interleaved configuration stands for each count of stages per rank its schedule runs
(`space.virtual_variants`): they share its compute bound, and are searched when it is reached, in the order of their
`stage_bound`s.

The split is searched too: with one stage per rank and decoder layers of one kind, every split Megatron's
first/last flags express (ends free, middle stages equal; every launcher runs them), in the order of each split's
`stage_bound` (`split_bounds`, all at once) until that bound reaches the best step. Where memory binds, a lighter
first stage, which holds the most micro-batches under 1F1B, can recompute less or fit where the FLOP-balanced
split does not. The splits share their ranks' tables and solutions by rank shape (`RankMemo`), and a rank found
unable to hold n layers rules out every split that gives it as many. `reference.every_split_best` builds and
solves every split alone, and the tests check the two agree. Where the decoder layers are of one kind, the ranks are
priced on one graph per shape (`shaped_slices`), so ranks, splits and schedules of one shape share their states and
memory terms.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

import numpy as np

from costmodels import Cluster, Config, Workload
from costmodels.pipeline import DEFAULT_WEIGHT_SHARE, StageTimes, step_lower_bound
from costmodels.pipeline_schedule import SPLIT_BACKWARD, local_stages
from costmodels.pipeline_stages import (
    UNSCHEDULED_FIELDS,
    RankSlice,
    pipeline_step,
    rank_slices,
    stage_layers,
    stage_p2p_seconds,
    stage_split_seconds,
    sub_graph,
)
from costmodels.stage_split import megatron_splits
from costmodels.states import model_states
from costmodels.timing import TimeTerms, time_terms
from costmodels.verdict import memory_budget
from graphs import Checkpoint, LayerGraph
from solver.search.pins import KNOBS
from solver.search.space import Outer
from solver.search.table_search import fastest_modes, search
from solver.search.tables import TICK_SECONDS, Table, build_table, table_modes, ticks


@dataclass(frozen=True, slots=True)
class RankTable:
    """One pipeline rank's search table and its stages' time terms."""

    slice: RankSlice
    table: Table
    kinds: list[int]
    stage_terms: tuple[TimeTerms, ...]
    outside: float
    """Seconds per step outside the schedule (data-parallel synchronisation, offload, optimizer step)."""


@dataclass(frozen=True, slots=True)
class PipelineCandidate:
    """A pipeline configuration ready to search: its ranks' tables and its step's lower bound."""

    outer: Outer
    ranks: tuple[RankTable, ...]
    p2p: tuple[float, ...]
    lower: int
    """Step ticks with every rank in its fastest modes: no assignment is faster."""
    split: tuple[int, ...] = ()
    """Decoder layers of each stage (what the plan records)."""

    def config(self, rank_modes: list[tuple[Checkpoint, ...]]) -> Config:
        """The configuration with its split and these modes, as a plan would carry it."""
        return replace(self.outer, pp_split=self.split).config(whole_model_modes(self, rank_modes))


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """The best pipeline configuration found (or why none)."""

    status: str
    """OPTIMAL (every configuration that could beat `incumbent` searched), FEASIBLE (cut short by the time
    limit), INFEASIBLE (no pipeline configuration fits) or UNKNOWN."""
    outer: Outer | None
    modes: tuple[Checkpoint, ...]
    step_ticks: int | None
    explored: int
    """Configurations whose tables were built."""
    searched: int
    """Configurations whose ranks were solved."""


def candidate(outer: Outer, graph: LayerGraph, cluster: Cluster, workload: Workload, *, headroom: float,
              modes: tuple[Checkpoint, ...], memo: dict[tuple[object, ...], TimeTerms] | None = None,
              beat: int | None = None, shapes: RankMemo | None = None) -> PipelineCandidate | None:
    """The configuration's rank tables and lower bound; None when some rank's states alone cannot fit, or when
    its stages' time terms already bound its step at `beat` ticks or more (`timed_bound`). `memo` keeps time terms
    across configurations (`slice_terms`), `shapes` rank tables across the splits of one (`RankMemo`)."""
    config = outer.config()
    budget = memory_budget(cluster, config, headroom)  # (`whole_states_fit` is asked once per configuration first)
    slices = shaped_slices(graph, rank_slices(graph, workload, config))
    for slice_ in slices:  # the states alone, before any timing: most configurations that cannot fit stop here
        if shapes is not None and shape(slice_) in shapes.tables:
            continue  # its table was built: its states fit
        states = model_states(slice_.graph, config)
        if states.gpu_total + states.step_temp + slice_.buffers > budget:
            if shapes is not None:
                shapes.refuse(slice_)
            return None
    memo = {} if memo is None else memo
    last = len(stage_layers(graph, workload, config)) - 1
    timed = []
    for slice_ in slices:
        terms = tuple(slice_terms(graph, g, cluster, workload, config, first=s == 0, last=s == last, memo=memo)
                      for s, g in zip(slice_.stages, slice_.stage_graphs, strict=True))
        whole = terms[0] if len(terms) == 1 else slice_terms(  # one stage: the same nodes
            graph, slice_.graph, cluster, workload, config, first=0 in slice_.stages, last=last in slice_.stages,
            memo=memo)
        timed.append((slice_, terms, whole))
    p2p = stage_p2p_seconds(graph, cluster, workload, config)
    if beat is not None and timed_bound(outer, timed, p2p, modes) >= beat:
        return None
    ranks = []
    for slice_, terms, whole in timed:
        table = shapes.tables.get(shape(slice_)) if shapes is not None else None
        if table is None:
            table = build_table(slice_.graph, cluster, workload, outer, rank=0, headroom=headroom,
                                rank_slice=slice_, terms=whole)
        if not table.states_fit:
            if shapes is not None:
                shapes.refuse(slice_)
            return None
        if shapes is not None:
            shapes.tables[shape(slice_)] = table
        ranks.append(RankTable(slice_, table, [layer.kind for layer in slice_.graph.decoder_layers()], terms,
                               whole.outside))
    found = PipelineCandidate(outer, tuple(ranks), p2p, 0)
    fastest = [fastest_modes(r.table, r.kinds, table_modes(r.table, modes)) for r in ranks]
    return PipelineCandidate(outer, tuple(ranks), found.p2p, step_ticks(found, fastest),
                             stage_layers(graph, workload, config))


def shaped_slices(graph: LayerGraph, slices: tuple[RankSlice, ...]) -> tuple[RankSlice, ...]:
    """The slices, priced on one graph per shape where the model's decoder layers are of one kind: a rank's memory
    and time then depend only on how many layers each of its stages holds and whether it holds the model's first
    or last nodes (the graphs differ in their nodes' names alone), so ranks, splits and schedules of one shape share
    their states and memory terms (memos keyed by the graphs' identities). Each keeps its own layer indices."""
    if not one_kind(graph):
        return slices
    last = max(stage for slice_ in slices for stage in slice_.stages)
    shaped = []
    for slice_ in slices:
        sizes = [len(g.decoder_layers()) for g in slice_.stage_graphs]
        stages = tuple(sub_graph(graph, tuple(range(n)), first=s == 0, last=s == last)
                       for n, s in zip(sizes, slice_.stages, strict=True))
        whole = sub_graph(graph, tuple(range(sum(sizes))), first=0 in slice_.stages, last=last in slice_.stages)
        shaped.append(replace(slice_, graph=whole, stage_graphs=stages))
    return tuple(shaped)


def whole_states_fit(graph: LayerGraph, config: Config, budget: int) -> bool:
    """Whether the fullest rank's states can fit, whatever the split: the ranks' states together hold at least the
    whole model's (its tensors split by stage, each rank with its own optimizer), so the fullest rank holds at
    least 1/pp of them. Refuses most configurations that cannot fit without slicing the model."""
    return model_states(graph, config).gpu_total <= budget * config.pp


def timed_bound(outer: Outer, timed: list[tuple[RankSlice, tuple[TimeTerms, ...], TimeTerms]],
                p2p: tuple[float, ...], modes: tuple[Checkpoint, ...]) -> int:
    """Step ticks no assignment beats, from each rank's stage and whole-slice time terms: `pipeline.step_lower_bound`
    over the stages in their fastest modes, p2p hops included, plus the slowest rank's work outside the schedule
    (what `step_ticks` adds to the simulated schedule, which never beats the bound)."""
    stages: dict[int, tuple[float, float]] = {}
    for slice_, terms, _ in timed:
        for stage, own in zip(slice_.stages, terms, strict=True):
            fastest = sum(fastest_layers(outer, own, modes))
            in_schedule = own.fixed.step_time - own.outside + fastest
            stages[stage] = (own.forward, max(0.0, in_schedule / outer.grad_accum - own.forward))
    order = [stages[s] for s in range(len(stages))]
    times = StageTimes(forward=tuple(f for f, _ in order), backward=tuple(b for _, b in order), p2p=p2p)
    bound = step_lower_bound(outer.pp_schedule, outer.pp, outer.grad_accum, v=outer.pp_virtual, times=times)
    return max(0, ticks((bound + max(whole.outside for _, _, whole in timed)) * (1 - _BOUND_MARGIN)) - 1)


def slice_terms(model: LayerGraph, graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, *,
                first: bool, last: bool, memo: dict[tuple[object, ...], TimeTerms]) -> TimeTerms:
    """`time_terms` of a slice of `model` (a stage's or a rank's), timed once per slice shape and setting: slices
    of the same decoder-layer kinds, with or without the model's first and last nodes, are the same nodes but for
    their names (layers of one kind cost the same), and no time term reads the schedule or the split."""
    key = (model, tuple(layer.kind for layer in graph.decoder_layers()), first, last,
           *(getattr(config, name) for name in UNSCHEDULED_FIELDS))
    if key not in memo:
        memo[key] = time_terms(graph, cluster, workload, config)
    return memo[key]


def step_ticks(found: PipelineCandidate, rank_modes: list[tuple[Checkpoint, ...]]) -> int:
    """Step ticks of the configuration with each rank's layers in `rank_modes` (what `estimate` prices)."""
    outer = found.outer
    stages: dict[int, tuple[float, float]] = {}
    for rank, modes in zip(found.ranks, rank_modes, strict=True):
        start = 0
        for stage, terms in zip(rank.slice.stages, rank.stage_terms, strict=True):
            own = modes[start:start + len(terms.layers)]
            start += len(terms.layers)
            stages[stage] = stage_split_seconds(terms, own, outer.grad_accum)
    _, step = pipeline_step(outer.pp_schedule, outer.pp, outer.grad_accum, outer.pp_virtual,
                            [stages[s] for s in range(len(stages))], found.p2p, [r.outside for r in found.ranks])
    return ticks(step)


def whole_model_modes(found: PipelineCandidate, rank_modes: list[tuple[Checkpoint, ...]]) -> tuple[Checkpoint, ...]:
    """The per-layer modes of the model from each rank's."""
    modes: dict[int, Checkpoint] = {}
    for rank, own in zip(found.ranks, rank_modes, strict=True):
        modes.update(zip(rank.slice.layers, own, strict=True))
    return tuple(modes[i] for i in range(len(modes)))


def solve_ranks(found: PipelineCandidate, modes: tuple[Checkpoint, ...], *, deadline: float,
                beat: int | None = None, shapes: RankMemo | None = None
                ) -> tuple[list[tuple[Checkpoint, ...]] | None, bool]:
    """Each rank's fastest modes that fit (CP-SAT on its table), or None when some rank has none; and whether
    every rank's search finished (proved its optimum or its infeasibility). None too, proved, once the ranks
    solved so far, with the rest in their fastest modes, already take `beat` step ticks or more (the simulated
    step never decreases when a stage slows down). `shapes` keeps each rank shape's solution across splits."""
    chosen, proved = [], True
    fastest = [fastest_modes(r.table, r.kinds, table_modes(r.table, modes)) for r in found.ranks]
    for index, rank in enumerate(found.ranks):
        key = shape(rank.slice)
        if shapes is None or key not in shapes.solved:
            limit = max(0.01, deadline - time.perf_counter())
            result = search([rank.table], rank.kinds, modes, time_limit=limit, configurations=1).result
            solution = (result.modes if result.table is not None else None), result.status
            if shapes is not None and (solution[0] is not None or result.status == "INFEASIBLE"):
                shapes.solved[key] = solution  # a search cut short by the deadline is not kept
        else:
            solution = shapes.solved[key]
        own, status = solution
        if own is None:
            if shapes is not None and status == "INFEASIBLE":
                shapes.refuse(rank.slice)
            return None, status == "INFEASIBLE"
        chosen.append(own)
        proved = proved and status == "OPTIMAL"
        rest = index + 1 < len(found.ranks)
        if rest and proved and beat is not None and step_ticks(found, chosen + fastest[index + 1:]) >= beat:
            return None, True
    return chosen, proved


@dataclass(frozen=True, slots=True)
class FastestCompute:
    """Seconds of one micro-batch's compute with every layer in its fastest mode, under one compute setting
    (`compute_key`): what bounds every pipeline configuration that shares the setting."""

    total: float
    """Every node of the model."""
    layers: tuple[float, ...]
    """Per decoder layer."""


@dataclass(frozen=True, slots=True)
class EdgeCompute:
    """Seconds of one micro-batch outside the decoder layers' fastest modes, under one compute setting: the
    nodes before the first decoder layer (the embedding, stage 0's) and after the last one (final norm, head and
    loss, the last stage's), and the forwards (without recompute) of those nodes and of one decoder layer. Priced
    on one-layer slices, as a stage's slice is priced."""

    before: float
    after: float
    forward_before: float
    forward_layer: float
    forward_after: float


# The knobs declared `outside_compute` (the pipeline, accumulation, offload, optimizer): a rank's micro-batch compute
# is timed at their defaults.
_OUTSIDE = {name: declared.default for name, declared in KNOBS.items() if declared.knob.outside_compute}


def compute_key(outer: Outer) -> Outer:
    """What the micro-batches' compute depends on: not the data-parallel degree nor the knobs declared
    `outside_compute` (their time is outside the schedule, or the schedule itself); dp = ep keeps ep valid."""
    return replace(outer, dp=outer.ep, **_OUTSIDE)


# The fields `compute_key` keeps: their values name the compute setting (with ep, which stands for dp there).
_COMPUTE_FIELDS = tuple(f.name for f in fields(Outer) if f.name != "dp" and f.name not in _OUTSIDE)


def compute_signature(outer: Outer) -> tuple[object, ...]:
    """`compute_key(outer)` as a plain tuple: a memo key that costs no validated dataclass per configuration."""
    return tuple(getattr(outer, name) for name in _COMPUTE_FIELDS)


def fastest_compute(outer: Outer, graph: LayerGraph, cluster: Cluster, workload: Workload,
                    modes: tuple[Checkpoint, ...], memo: dict[tuple[object, ...], FastestCompute]) -> FastestCompute:
    """`FastestCompute` of `outer`'s compute setting, timed once per setting (`memo`)."""
    key = compute_signature(outer)
    if key not in memo:
        terms = time_terms(graph, cluster, workload, compute_key(outer).config())
        layers = fastest_layers(outer, terms, modes)
        memo[key] = FastestCompute(total=terms.fixed.step_time - terms.outside + sum(layers), layers=layers)
    return memo[key]


def fastest_layers(outer: Outer, terms: TimeTerms, modes: tuple[Checkpoint, ...]) -> tuple[float, ...]:
    """Each decoder layer's time in its fastest of `modes` that `outer` runs (layers of one kind share their
    options, so each kind is compared once)."""
    by_options: dict[int, float] = {}
    for options in terms.layers:
        if id(options) not in by_options:
            by_options[id(options)] = min(t.total for mode, t in options if mode in modes and outer.runs(mode))
    return tuple(by_options[id(options)] for options in terms.layers)


def edge_compute(outer: Outer, graph: LayerGraph, cluster: Cluster, workload: Workload,
                 memo: dict[tuple[object, ...], EdgeCompute]) -> EdgeCompute:
    """`EdgeCompute` of `outer`'s compute setting, timed once per setting (`memo`)."""
    key = compute_signature(outer)
    if key not in memo:
        config, last = compute_key(outer).config(), len(graph.decoder_layers()) - 1
        terms = [time_terms(sub_graph(graph, (layer,), first=first, last=final), cluster, workload, config)
                 for layer, first, final in ((0, True, False), (0, False, False), (last, False, True))]
        layer = terms[1].forward
        memo[key] = EdgeCompute(before=terms[0].fixed.step_time - terms[0].outside,
                                after=terms[2].fixed.step_time - terms[2].outside,
                                forward_before=terms[0].forward - layer,
                                forward_layer=layer, forward_after=terms[2].forward - layer)
    return memo[key]


def mean_bound(outer: Outer, fastest: FastestCompute) -> int:
    """Step ticks no split or schedule of `outer` beats: its micro-batches' compute in the fastest modes spread
    evenly over the pipeline ranks (the busiest rank has at least the mean, and the schedule lasts at least as
    long as its busiest rank)."""
    return ticks(outer.grad_accum * fastest.total / outer.pp)


def compute_bound(outer: Outer, graph: LayerGraph, cluster: Cluster, workload: Workload,
                  modes: tuple[Checkpoint, ...], memo: dict[tuple[object, ...], FastestCompute]) -> int:
    """`mean_bound` of `outer`: one time evaluation per compute setting, shared by every pipeline degree."""
    return mean_bound(outer, fastest_compute(outer, graph, cluster, workload, modes, memo))


# Bounds are summed in another order than the step they bound: a relative margin far above float rounding.
_BOUND_MARGIN = 1e-9


def stage_bound(outer: Outer, graph: LayerGraph, workload: Workload, fastest: FastestCompute,
                edges: EdgeCompute, sizes: tuple[int, ...] = ()) -> int:
    """Step ticks no assignment of `outer` beats, from its split (`sizes`, else `stage_layers`) with every stage in
    its fastest modes, p2p hops and the work outside the schedule taken as free: the larger of
    `pipeline.step_lower_bound` and one micro-batch's path through every stage and back (under a split backward,
    its input gradients and stage 0's whole backward). 0 (no bound) unless the model's decoder layers are of one
    kind: only then does a stage's slice price its nodes as the one-layer slices do (a slice's kernel speed
    follows its first layer)."""
    if not one_kind(graph):
        return 0
    sizes = sizes or stage_layers(graph, workload, outer.config())
    forward, backward, start = [], [], 0
    for stage, size in enumerate(sizes):
        first, last = stage == 0, stage == len(sizes) - 1
        work = sum(fastest.layers[start:start + size]) + (edges.before if first else 0.0) + \
            (edges.after if last else 0.0)
        ahead = size * edges.forward_layer + (edges.forward_before if first else 0.0) + \
            (edges.forward_after if last else 0.0)
        forward.append(min(ahead, work))
        backward.append(work - forward[-1])
        start += size
    times = StageTimes(forward=tuple(forward), backward=tuple(backward))
    bound = step_lower_bound(outer.pp_schedule, outer.pp, outer.grad_accum, v=outer.pp_virtual, times=times)
    share = DEFAULT_WEIGHT_SHARE if outer.pp_schedule in SPLIT_BACKWARD else 0.0  # W may run after the path
    path = sum(forward) + backward[0] + (1 - share) * sum(backward[1:])
    return max(0, ticks(max(bound, path) * (1 - _BOUND_MARGIN)) - 1)


def one_kind(graph: LayerGraph) -> bool:
    """Whether the model's decoder layers are all of one kind: a slice's time and memory then depend on how many
    layers it holds, not which."""
    return len({layer.kind for layer in graph.decoder_layers()}) == 1


def searched_splits(outer: Outer, graph: LayerGraph, workload: Workload, fastest: FastestCompute,
                    edges: EdgeCompute, below: int | None) -> list[tuple[int, tuple[int, ...]]]:
    """The splits of `outer` whose `stage_bound` is below `below` step ticks (None: every split), each with that
    bound, in its order (the balanced split first among equals): with one stage per rank and decoder layers of one
    kind, every split Megatron's first/last flags express (`stage_split.megatron_splits`; every pipeline launcher
    runs them), since where memory binds a lighter first stage (it holds the most micro-batches) can fit or run
    faster than the FLOP-balanced one; otherwise the configured or balanced split alone."""
    balanced = stage_layers(graph, workload, outer.config())
    if outer.pp_split or local_stages(outer.pp_schedule, outer.pp_virtual) > 1 or not one_kind(graph):
        bound = stage_bound(outer, graph, workload, fastest, edges, balanced)
        return [(bound, balanced)] if below is None or bound < below else []
    splits = megatron_splits(sum(balanced), len(balanced))
    bounds = split_bounds(outer, fastest, edges, split_array(sum(balanced), len(balanced)))
    kept = range(len(splits)) if below is None else np.flatnonzero(bounds < below).tolist()
    order = sorted(kept, key=lambda i: (bounds[i], splits[i] != balanced, splits[i]))
    return [(int(bounds[i]), splits[i]) for i in order]


@lru_cache(maxsize=256)
def split_array(layers: int, stages: int) -> np.ndarray:
    """`megatron_splits` as a read-only float array, one row per split."""
    array = np.array(megatron_splits(layers, stages), dtype=float)
    array.flags.writeable = False
    return array


def split_bounds(outer: Outer, fastest: FastestCompute, edges: EdgeCompute, sizes: np.ndarray) -> np.ndarray:
    """`stage_bound` of each split (a row of `sizes`, layers per stage) of a one-stage-per-rank configuration whose
    decoder layers are of one kind, for hundreds of splits at once: rank r's m micro-batches after the first one's
    forward through the stages before it and, without a split backward, its backward back through them."""
    layer = fastest.layers[0]  # every layer's, the layers being of one kind
    work = sizes * layer
    ahead = sizes * edges.forward_layer
    work[:, 0] += edges.before
    ahead[:, 0] += edges.forward_before
    work[:, -1] += edges.after
    ahead[:, -1] += edges.forward_after
    forward = np.minimum(ahead, work)
    backward = work - forward
    fill = np.cumsum(forward, axis=1) - forward  # the stages before each
    drain = np.zeros_like(fill) if outer.pp_schedule in SPLIT_BACKWARD else np.cumsum(backward, axis=1) - backward
    bound = (fill + outer.grad_accum * work + drain).max(axis=1)
    share = DEFAULT_WEIGHT_SHARE if outer.pp_schedule in SPLIT_BACKWARD else 0.0
    path = forward.sum(axis=1) + backward[:, 0] + (1 - share) * backward[:, 1:].sum(axis=1)
    limit = np.maximum(bound, path) * (1 - _BOUND_MARGIN) / TICK_SECONDS
    return np.maximum(0, np.rint(limit).astype(np.int64) - 1)


@dataclass(slots=True)
class RankMemo:
    """What the splits of one configuration share, by rank shape: with one stage per rank and decoder layers of one
    kind, a rank's table and its solved modes depend only on its position and layer count. A rank that cannot hold
    n layers (its states, or its leanest modes) cannot hold more, since its states and every mode's activations
    grow with its layers: `too_many` keeps the fewest found, and splits that give a rank as many are skipped."""

    tables: dict[tuple[int, int], Table] = field(default_factory=dict)
    solved: dict[tuple[int, int], tuple[tuple[Checkpoint, ...] | None, str]] = field(default_factory=dict)
    too_many: dict[int, int] = field(default_factory=dict)

    def excludes(self, split: tuple[int, ...]) -> bool:
        return any(layers >= self.too_many.get(rank, layers + 1) for rank, layers in enumerate(split))

    def refuse(self, slice_: RankSlice) -> None:
        layers = len(slice_.layers)
        self.too_many[slice_.rank] = min(self.too_many.get(slice_.rank, layers), layers)


def shape(slice_: RankSlice) -> tuple[int, int]:
    return slice_.rank, len(slice_.layers)


Runs = Callable[[Config], bool]
"""Whether some allowed launcher runs a configuration as emitted (`capability.runnable_by`)."""


def stage_blocks(found: PipelineCandidate, mode: Checkpoint, k: int, modes: tuple[Checkpoint, ...]
                 ) -> list[tuple[Checkpoint, ...]]:
    """Each rank's modes when every stage puts its first k layers in `mode` and the rest in no recompute (or in
    `mode` too when no recompute is not allowed): Megatron's block recompute, and one mode for every layer at k =
    the largest stage (torchtitan's one policy)."""
    rest = Checkpoint.NONE if Checkpoint.NONE in modes else mode
    return [tuple(mode if i < k else rest for terms in rank.stage_terms for i in range(len(terms.layers)))
            for rank in found.ranks]


def free_recompute(found: PipelineCandidate, modes: tuple[Checkpoint, ...], runs: Runs) -> bool:
    """Whether a launcher runs any per-layer modes on this configuration: asked with an assignment no uniform
    or per-stage block rule expresses (the first layer of rank 0 alone checkpointed)."""
    checkpointed = [m for m in modes if m is not Checkpoint.NONE]
    if not checkpointed or Checkpoint.NONE not in modes:
        return True  # one mode for every layer: nothing to choose
    sample = [tuple(checkpointed[0] if r == 0 and i == 0 else Checkpoint.NONE for i in range(len(rank.kinds)))
              for r, rank in enumerate(found.ranks)]
    return runs(found.config(sample))


def block_recompute(found: PipelineCandidate, modes: tuple[Checkpoint, ...],
                    runs: Runs) -> list[tuple[Checkpoint, ...]] | None:
    """The fastest runnable per-stage block assignment that fits every rank. For one mode, a larger block k (the
    first k layers of every stage in it) never runs faster (more recompute: the simulated step never falls when a
    stage slows) and never peaks higher (each layer moved out of no recompute keeps less), so that mode's best is
    the smallest k that fits, found by bisection, or the first above it that a launcher runs; the modes' bests
    (and no recompute) are then compared. `reference.every_block_recompute` tries every k; the tests compare."""
    largest = max(len(terms.layers) for rank in found.ranks for terms in rank.stage_terms)
    options = []
    if Checkpoint.NONE in modes:
        options.append(stage_blocks(found, Checkpoint.NONE, 0, modes))
    for mode in modes:
        if mode is Checkpoint.NONE or not blocks_fit(found, stage_blocks(found, mode, largest, modes)):
            continue
        low, high = 1, largest
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if blocks_fit(found, stage_blocks(found, mode, middle, modes)) else \
                (middle + 1, high)
        runnable = (blocks for k in range(low, largest + 1)
                    if runs(found.config(blocks := stage_blocks(found, mode, k, modes))))
        options.extend(itertools.islice(runnable, 1))
    return fastest_fitting(found, options, runs)


def blocks_fit(found: PipelineCandidate, rank_modes: list[tuple[Checkpoint, ...]]) -> bool:
    """Whether every rank's peak with its modes fits its budget."""
    return all(rank.table.peak_of(own) <= rank.table.budget for rank, own in zip(found.ranks, rank_modes, strict=True))


def fastest_fitting(found: PipelineCandidate, options: list[list[tuple[Checkpoint, ...]]],
                    runs: Runs) -> list[tuple[Checkpoint, ...]] | None:
    """The first fastest of `options` that fits and a launcher runs, its step simulated (None if none does)."""
    best: tuple[int, list[tuple[Checkpoint, ...]]] | None = None
    for rank_modes in options:
        if not blocks_fit(found, rank_modes) or not runs(found.config(rank_modes)):
            continue
        step = step_ticks(found, rank_modes)
        if best is None or step < best[0]:
            best = (step, rank_modes)
    return None if best is None else best[1]


def best_recompute(found: PipelineCandidate, modes: tuple[Checkpoint, ...], runs: Runs, *,
                   deadline: float, beat: int | None = None, shapes: RankMemo | None = None
                   ) -> tuple[list[tuple[Checkpoint, ...]] | None, bool]:
    """The ranks' fastest fitting modes that a launcher runs: per rank by CP-SAT where some launcher takes any
    per-layer modes (`free_recompute`), else the best per-stage block (Megatron's block recompute, torchtitan's
    one policy), exhaustively; and whether the search finished."""
    if free_recompute(found, modes, runs):
        rank_modes, proved = solve_ranks(found, modes, deadline=deadline, beat=beat, shapes=shapes)
        if rank_modes is None or runs(found.config(rank_modes)):
            return rank_modes, proved
        # a launcher rule the probe did not meet (one no per-layer freedom shows): the runnable blocks instead, and
        # no proof that a runnable per-layer assignment is not faster
        return block_recompute(found, modes, runs), False
    return block_recompute(found, modes, runs), True


@dataclass(frozen=True, slots=True)
class PipelineMemos:
    """What a pipeline search computes whatever the memory budget: each setting's fastest compute, its edge stages'
    compute and its rank slices' time terms. Only for one set of configurations, cluster and workload."""
    fastest: dict[tuple[object, ...], FastestCompute] = field(default_factory=dict)
    edges: dict[tuple[object, ...], EdgeCompute] = field(default_factory=dict)
    sliced: dict[tuple[object, ...], TimeTerms] = field(default_factory=dict)


Variants = Callable[[Outer], tuple[Outer, ...]]
"""A configuration at each count of stages per rank its schedule runs (`space.virtual_variants`), its own first."""


@dataclass(slots=True)
class _Best:
    """What a pipeline search has found so far, and how much it has built and searched."""

    incumbent: int | None
    best: tuple[int, Outer, tuple[Checkpoint, ...]] | None = None
    explored: int = 0
    searched: int = 0
    complete: bool = True

    @property
    def bound(self) -> int | None:
        """Step ticks a configuration must beat: the best found, else the incumbent."""
        return self.best[0] if self.best is not None else self.incumbent


def pipeline_search(outers: tuple[Outer, ...], graph_of: Callable[[Outer], LayerGraph], cluster: Cluster,
                    workload: Workload, *, headroom: float, modes: tuple[Checkpoint, ...], incumbent: int | None,
                    deadline: float, runs: Runs | None = None, memos: PipelineMemos | None = None,
                    variants: Variants | None = None) -> PipelineResult:
    """The fastest pipeline configuration that fits and beats `incumbent` step ticks (None: any): configurations
    in the order of `compute_bound`, each built (`candidate`) and its ranks solved only while its bounds are below
    the best step so far. `variants` opens each configuration's other counts of stages per rank, which share its
    compute bound, in the order of their `stage_bound`s. `memos`: what an earlier search of these configurations on
    this cluster and workload computed (at another headroom)."""
    memos = memos if memos is not None else PipelineMemos()
    bounds = compute_bounds(outers, graph_of, cluster, workload, modes=modes, memo=memos.fastest, deadline=deadline)
    if bounds is None:  # no bound for some: none of them is searched
        return PipelineResult("UNKNOWN", None, (), None, 0, 0)
    found = _Best(incumbent)
    for k in sorted(range(len(outers)), key=lambda i: (bounds[i], i)):
        if found.bound is not None and bounds[k] >= found.bound:
            break
        if time.perf_counter() > deadline:
            found.complete = False
            break
        outer = outers[k]
        graph = graph_of(outer)
        if not whole_states_fit(graph, outer.config(), memory_budget(cluster, outer.config(), headroom)):
            continue  # no split fits
        own = lowered_modes(graph, modes)
        fastest, edges = memos.fastest[compute_signature(outer)], edge_compute(outer, graph, cluster, workload,
                                                                               memos.edges)
        opened = [(splits, variant) for variant in (variants(outer) if variants else (outer,))
                  if (splits := searched_splits(variant, graph, workload, fastest, edges, below=found.bound))]
        for splits, variant in sorted(opened, key=lambda pair: pair[0][0][0]):  # the likeliest to win first
            _search_splits(found, variant, splits, graph, cluster, workload, headroom=headroom, modes=own,
                           runs=runs or registry_runs(graph), deadline=deadline, sliced=memos.sliced)
    best = found.best
    if best is None:
        status = ("INFEASIBLE" if incumbent is None else "OPTIMAL") if found.complete else "UNKNOWN"
        return PipelineResult(status, None, (), None, found.explored, found.searched)
    return PipelineResult("OPTIMAL" if found.complete else "FEASIBLE", best[1], best[2], best[0], found.explored,
                          found.searched)


def _search_splits(found: _Best, outer: Outer, splits: list[tuple[int, tuple[int, ...]]], graph: LayerGraph,
                   cluster: Cluster, workload: Workload, *, headroom: float, modes: tuple[Checkpoint, ...], runs: Runs,
                   deadline: float, sliced: dict[tuple[object, ...], TimeTerms]) -> None:
    """Search `outer`'s splits, in the order of their bounds, while those bounds are below the best step so far
    (`found`, updated): each built (`candidate`) and its ranks solved."""
    shapes = RankMemo() if len(splits) > 1 else None
    for split_bound, split in splits:
        bound = found.bound
        if bound is not None and split_bound >= bound:
            break  # this split's and the later ones' bubbles alone keep them from beating the best
        if time.perf_counter() > deadline:
            found.complete = False
            break
        if shapes is not None and shapes.excludes(split):
            continue  # a rank holds at least as many layers as it was found unable to
        built = candidate(replace(outer, pp_split=split), graph, cluster, workload, headroom=headroom, modes=modes,
                          memo=sliced, beat=bound, shapes=shapes)
        found.explored += 1
        if built is None or (bound is not None and built.lower >= bound):
            continue
        rank_modes, proved = best_recompute(built, modes, runs, deadline=deadline, beat=bound, shapes=shapes)
        found.searched += 1
        found.complete = found.complete and proved
        if rank_modes is None:
            continue
        step = step_ticks(built, rank_modes)
        if bound is None or step < bound:
            found.best = (step, built.outer, whole_model_modes(built, rank_modes))


def compute_bounds(outers: tuple[Outer, ...], graph_of: Callable[[Outer], LayerGraph], cluster: Cluster,
                   workload: Workload, *, modes: tuple[Checkpoint, ...], memo: dict[tuple[object, ...], FastestCompute],
                   deadline: float) -> list[int] | None:
    """Each configuration's `compute_bound` (its setting's fastest compute looked up once in `memo`, the lowering
    too); None when the deadline passes before every bound is known."""
    bounds = []
    for outer in outers:
        if time.perf_counter() > deadline:
            return None
        fastest = memo.get(compute_signature(outer))
        if fastest is None:
            graph = graph_of(outer)
            bounds.append(compute_bound(outer, graph, cluster, workload, lowered_modes(graph, modes), memo))
        else:
            bounds.append(mean_bound(outer, fastest))
    return bounds


def lowered_modes(graph: LayerGraph, modes: tuple[Checkpoint, ...]) -> tuple[Checkpoint, ...]:
    """The searched `modes` that `graph` has: a configuration lowered through other code than the space's (Megatron's
    engine on megatron-core's layers) has only its runtime's modes."""
    own = graph.checkpoint_modes()
    return tuple(m for m in modes if m in own)


def registry_runs(graph: LayerGraph) -> Runs:
    """Whether any registered launcher runs a configuration (the model's own launcher limits aside): the search's
    default when the caller gives none."""
    from solver.plan.capability import runnable_by

    return lambda config: bool(runnable_by(config, lora=graph.lora))


def pipeline_infeasible(outers: tuple[Outer, ...], graph_of: Callable[[Outer], LayerGraph], cluster: Cluster,
                        workload: Workload, *, headroom: float, model: str, gpus: str) -> tuple[str, str, dict]:
    """Why no pipeline configuration fits (all of them were searched): the fullest rank of the leanest one, by
    its persistent states and receive buffers alone, against the budget; with the ways out."""
    leanest: tuple[int, int, Outer] | None = None
    for outer in outers:
        config = outer.config()
        budget = memory_budget(cluster, config, headroom)
        worst = max(model_states(s.graph, config).gpu_total + s.buffers
                    for s in rank_slices(graph_of(outer), workload, config))
        if leanest is None or worst - budget < leanest[0] - leanest[1]:
            leanest = (worst, budget, outer)
    assert leanest is not None
    worst, budget, outer = leanest
    gib = 2**30
    summary = (f"pp={outer.pp} tp={outer.tp} dp={outer.dp} {outer.engine} zero={outer.zero} {outer.pp_schedule}"
               + (f" cp={outer.cp}" if outer.cp > 1 else ""))
    if worst > budget:
        why = (f"its fullest rank holds {worst / gib:.1f} GiB of parameters, gradients, optimizer states and receive "
               f"buffers before any activation; {budget / gib:.1f} GiB is available after overhead and headroom")
    else:
        why = ("the ranks' states fit, but no checkpointing that a pipeline launcher runs brings every rank's "
               f"activations under the {budget / gib:.1f} GiB available")
    return (f"Nothing fits {model} on {gpus} with pipeline parallelism: the leanest configuration ({summary}): "
            f"{why}.",
            "A pipeline shards only what each stage holds (Megatron's distributed optimizer at most the optimizer "
            "states, torchtitan's FSDP2 keeps a stage's parameters gathered); leave --pp to the solver to compare "
            "ZeRO-3/FSDP2 sharding and offload, or use more GPUs.",
            {"pipeline_states_bytes": worst, "budget_bytes": budget})
