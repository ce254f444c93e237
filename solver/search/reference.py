"""The reference: enumerate every outer configuration and every canonical per-layer assignment, evaluating each
with the same tables as the CP-SAT model (pipeline configurations: every combination of their ranks' assignments
through the schedule simulation). Exponential; for tests and small instances."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodels import Cluster, Workload
from costmodels.pipeline_schedule import local_stages
from costmodels.pipeline_stages import stage_layers
from costmodels.stage_split import megatron_splits
from graphs import Checkpoint, LayerGraph
from solver.search.pipeline_search import (
    PipelineCandidate,
    Runs,
    best_recompute,
    candidate,
    fastest_fitting,
    lowered_modes,
    one_kind,
    registry_runs,
    stage_blocks,
    step_ticks,
)
from solver.search.space import Outer, all_counts, canonical_modes
from solver.search.tables import Table, objective, tie_weight


@dataclass(frozen=True, slots=True)
class Best:
    objective: int
    table: int
    modes: tuple[Checkpoint, ...]
    evaluated: int


def enumerate_best(tables: list[Table], kinds: list[int], modes: tuple[Checkpoint, ...]) -> Best | None:
    """The feasible assignment with the smallest objective, or None when nothing fits."""
    weight = tie_weight(tables, len(kinds))
    assignments = [canonical_modes(kinds, counts) for counts in all_counts(kinds, modes)]
    best: Best | None = None
    evaluated = 0
    for k, table in enumerate(tables):
        if not table.host_ok:
            continue
        for assignment in assignments:
            if not all(table.outer.runs(mode) for mode in set(assignment)):
                continue  # no launcher that runs this configuration expresses one of these modes
            evaluated += 1
            if table.peak_of(assignment) > table.budget:
                continue
            value = objective(table, assignment, tie_weight=weight)
            if best is None or value < best.objective:
                best = Best(value, k, assignment, 0)
    return None if best is None else Best(best.objective, best.table, best.modes, evaluated)


@dataclass(frozen=True, slots=True)
class PipelineBest:
    step_ticks: int
    candidate: int
    modes: tuple[tuple[Checkpoint, ...], ...]
    """Each rank's modes."""
    evaluated: int


def enumerate_pipelines(candidates: list[PipelineCandidate], modes: tuple[Checkpoint, ...],
                        runs: Runs | None = None) -> PipelineBest | None:
    """The fastest pipeline configuration by brute force: every combination of the ranks' canonical assignments
    that each fits its rank and a launcher runs (`runs`, default: the registry), through the schedule simulation
    (no decomposition assumed). None when nothing fits."""
    best: PipelineBest | None = None
    evaluated = 0
    for index, found in enumerate(candidates):
        per_rank = []
        for rank in found.ranks:
            table = rank.table
            options = [canonical_modes(rank.kinds, counts) for counts in all_counts(rank.kinds, modes)]
            per_rank.append([a for a in options if all(table.outer.runs(m) for m in set(a))
                             and table.peak_of(a) <= table.budget])
        check = runs or registry_runs(found.ranks[0].slice.graph)
        for combination in itertools.product(*per_rank):
            if not check(found.config(list(combination))):
                continue
            evaluated += 1
            step = step_ticks(found, list(combination))
            if best is None or step < best.step_ticks:
                best = PipelineBest(step, index, combination, 0)
    return None if best is None else PipelineBest(best.step_ticks, best.candidate, best.modes, evaluated)


def every_block_recompute(found: PipelineCandidate, modes: tuple[Checkpoint, ...],
                          runs: Runs) -> list[tuple[Checkpoint, ...]] | None:
    """`pipeline_search.block_recompute` by trying every mode and every block size k."""
    largest = max(len(terms.layers) for rank in found.ranks for terms in rank.stage_terms)
    options = [stage_blocks(found, m, k, modes) for m in modes if m is not Checkpoint.NONE
               for k in range(1, largest + 1)]
    if Checkpoint.NONE in modes:
        options.insert(0, stage_blocks(found, Checkpoint.NONE, 0, modes))
    return fastest_fitting(found, options, runs)


def every_split(outer: Outer, graph: LayerGraph, workload: Workload) -> tuple[tuple[int, ...], ...]:
    """The splits the pipeline search considers for `outer`: every split Megatron's flags express when each rank
    runs one stage of decoder layers of one kind and no split is configured, else the configured or balanced one."""
    split = stage_layers(graph, workload, outer.config())
    if outer.pp_split or local_stages(outer.pp_schedule, outer.pp_virtual) > 1 or not one_kind(graph):
        return (split,)
    return megatron_splits(sum(split), len(split))


def every_split_candidate(outers: tuple[Outer, ...], graph_of: Callable[[Outer], LayerGraph], cluster: Cluster,
                          workload: Workload, *, headroom: float,
                          modes: tuple[Checkpoint, ...]) -> list[PipelineCandidate]:
    """Every configuration at every split of `every_split`, built alone (no bound, nothing shared across splits),
    less those whose states cannot fit."""
    return [found for outer in outers for split in every_split(outer, graph_of(outer), workload)
            if (found := candidate(replace(outer, pp_split=split), graph_of(outer), cluster, workload,
                                   headroom=headroom, modes=lowered_modes(graph_of(outer), modes))) is not None]


def every_split_best(outers: tuple[Outer, ...], graph_of: Callable[[Outer], LayerGraph], cluster: Cluster,
                     workload: Workload, *, headroom: float, modes: tuple[Checkpoint, ...]) -> int | None:
    """The fastest step, in ticks, over every configuration at every split, each split's ranks solved on their
    own (`pipeline_search.best_recompute`, itself compared with brute force at one split): what the search must
    find without its bounds, its order or the rank tables it shares across splits. None when nothing fits."""
    best = None
    for found in every_split_candidate(outers, graph_of, cluster, workload, headroom=headroom, modes=modes):
        graph = graph_of(found.outer)
        rank_modes, _ = best_recompute(found, lowered_modes(graph, modes), registry_runs(graph),
                                       deadline=time.perf_counter() + 600)
        if rank_modes is not None:
            step = step_ticks(found, rank_modes)
            best = step if best is None else min(best, step)
    return best
