"""The search's cuts are exact: every bound it prunes with is at most what the configuration can achieve, and the
pruned search returns what the unpruned one does (random small instances, the brute-force instances of
`test_pipeline_search`)."""

from __future__ import annotations

import random
import time

import pytest

from costmodels import Engine, Precision, Workload, parse_cluster
from costmodels.timing import time_terms
from solver.search.model import build_model, solve
from solver.search.pins import Pins
from solver.search.pipeline_search import (
    candidate,
    compute_bound,
    edge_compute,
    fastest_compute,
    pipeline_search,
    stage_bound,
)
from solver.search.space import all_counts, canonical_modes
from solver.search.table_search import dominates, search, undominated
from solver.search.tables import objective, table_modes, tie_weight
from tests.solver.test_model import instance as model_instance
from tests.solver.test_model import tables_for
from tests.solver.test_pipeline_search import instance, space_of


@pytest.mark.parametrize("seed", range(0, 30, 2))
def test_stage_bound_is_never_above_the_fastest_simulated_step(seed):
    case = instance(seed)
    graph_of, space = space_of(case)
    memo, edges = {}, {}
    checked, tighter = 0, 0
    for outer in space.pipelines:
        graph = graph_of(outer)
        found = candidate(outer, graph, case["cluster"], case["workload"], headroom=0.0, modes=space.modes)
        if found is None:
            continue
        fastest = fastest_compute(outer, graph, case["cluster"], case["workload"], space.modes, memo)
        bound = stage_bound(outer, graph, case["workload"], fastest,
                            edge_compute(outer, graph, case["cluster"], case["workload"], edges))
        # `found.lower` simulates every rank in its fastest modes: the least step of any assignment
        assert 0 < bound <= found.lower
        # the bound from the stages' own time terms, p2p and work outside the schedule, prunes only above it
        assert candidate(outer, graph, case["cluster"], case["workload"], headroom=0.0, modes=space.modes,
                         beat=found.lower + 1) is not None
        mean = compute_bound(outer, graph, case["cluster"], case["workload"], space.modes, memo)
        assert mean <= found.lower
        checked, tighter = checked + 1, tighter + (bound > mean)
    assert checked and tighter  # the split and the bubble add to the mean compute


@pytest.mark.parametrize("seed", range(1, 30, 3))
def test_pipeline_search_with_an_incumbent_prunes_to_the_same_plan(seed):
    """With the unpruned search's own step as the incumbent to beat, the pruned search finds nothing faster; with
    one tick more, it finds that same step."""
    case = instance(seed)
    graph_of, space = space_of(case)
    args = (space.pipelines, graph_of, case["cluster"], case["workload"])
    kwargs = {"headroom": case["headroom"], "modes": space.modes}
    free = pipeline_search(*args, incumbent=None, deadline=time.perf_counter() + 120, **kwargs)
    if free.step_ticks is None:
        return
    same = pipeline_search(*args, incumbent=free.step_ticks, deadline=time.perf_counter() + 120, **kwargs)
    assert same.status == "OPTIMAL" and same.outer is None
    above = pipeline_search(*args, incumbent=free.step_ticks + 1, deadline=time.perf_counter() + 120, **kwargs)
    assert above.status == "OPTIMAL" and above.step_ticks == free.step_ticks


def _assignments(kinds: list[int], modes, seed: int) -> list[tuple]:
    """A few canonical assignments: every layer in each mode, and random per-kind counts."""
    rng = random.Random(seed)
    counts = all_counts(kinds, modes)
    picked = [tuple(m for _ in kinds) for m in modes] + [canonical_modes(kinds, c) for c in
                                                         rng.sample(counts, min(20, len(counts)))]
    return picked


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_a_dominated_table_never_fits_or_scores_better_than_its_dominator(seed):
    case = model_instance(seed)
    tables, kinds, modes = tables_for(case, seed)
    weight = tie_weight(tables, len(kinds))
    viable = [t for t in tables if t.states_fit]
    for a in viable:
        for b in viable:
            if a is b or not dominates(a, b, modes):
                continue
            for x in _assignments(kinds, table_modes(b, modes), seed):
                if b.peak_of(x) <= b.budget:
                    assert a.peak_of(x) <= a.budget
                    assert objective(a, x, tie_weight=weight) < objective(b, x, tie_weight=weight)


@pytest.mark.parametrize("seed", range(1, 40, 4))
def test_search_equals_one_joint_model_over_every_table_that_fits(seed):
    """The search (quick plans, bound and dominance pruning, one cut-off model per table) against the joint CP-SAT
    model over every table whose states fit, nothing pruned."""
    case = model_instance(seed)
    tables, kinds, modes = tables_for(case, seed)
    found = search(tables, kinds, modes, time_limit=60, configurations=len(tables))
    viable = [t for t in tables if t.states_fit]
    if not viable:
        assert found.result.status == "INFEASIBLE"
        return
    joint = solve(build_model(viable, kinds, modes, weight=found.weight), time_limit=60)
    assert joint.status in ("OPTIMAL", "INFEASIBLE")
    assert found.result.status == joint.status
    assert found.result.objective == joint.objective


def test_dominance_prunes_twin_configurations():
    """bf16 and fp16 mixed precision (same bytes, same kernels on an A100), and the fused and foreach AdamW, give
    twin tables: the later one of each pair is dominated."""
    case = model_instance(0)
    case.update(cluster=parse_cluster("8xA100-40GB"),
                pins=Pins.of(engine=Engine.FSDP2, precision=(Precision.BF16_MIXED, Precision.FP16_MIXED)))
    tables, _, modes = tables_for(case)
    viable = [k for k, t in enumerate(tables) if t.states_fit]
    assert len(undominated(tables, viable, modes)) < len(viable)


@pytest.mark.parametrize("seed", range(0, 30, 3))
def test_slice_time_terms_shared_across_configurations_equal_fresh_ones(seed):
    """Every stage's and rank's time terms from the memo shared by all of an instance's pipeline configurations
    (keyed by slice shape, `slice_terms`) equal `time_terms` of that very slice and configuration."""
    case = instance(seed)
    graph_of, space = space_of(case)
    memo: dict = {}
    compared = 0
    for outer in space.pipelines:
        found = candidate(outer, graph_of(outer), case["cluster"], case["workload"], headroom=0.0, modes=space.modes,
                          memo=memo)
        if found is None:
            continue
        config = outer.config()
        for rank in found.ranks:
            for graph, terms in zip(rank.slice.stage_graphs, rank.stage_terms, strict=True):
                assert terms == time_terms(graph, case["cluster"], case["workload"], config)
            assert rank.outside == time_terms(rank.slice.graph, case["cluster"], case["workload"], config).outside
            compared += 1
    assert compared


def test_slice_time_terms_of_a_model_with_alternating_layer_kinds_equal_fresh_ones():
    """gemma-2 alternates sliding-window and global attention layers: slices of different kind sequences never
    share terms."""
    cluster = parse_cluster("8xA100-40GB")
    case = {"model": "google/gemma-2-2b", "cluster": cluster, "workload": Workload(seq_len=1024, global_batch=64),
            "pins": Pins.of(pp=4, tp=1, cp=1, engine=Engine.DDP, zero=0, precision=(Precision.BF16_MIXED,),
                            micro_batch=1, optimizers=("adamw",), offload="none")}
    graph_of, space = space_of(case)
    memo: dict = {}
    compared = 0
    for outer in space.pipelines:
        found = candidate(outer, graph_of(outer), cluster, case["workload"], headroom=0.0, modes=space.modes,
                          memo=memo)
        for rank in found.ranks if found else ():
            for graph, terms in zip(rank.slice.stage_graphs, rank.stage_terms, strict=True):
                assert terms == time_terms(graph, cluster, case["workload"], outer.config())
                compared += 1
    assert compared
