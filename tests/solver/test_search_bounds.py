"""The search's cuts are exact: every bound it prunes with is at most what the configuration can achieve, and the
pruned search returns what the unpruned one does (random small instances, the brute-force instances of
`test_pipeline_search`)."""

from __future__ import annotations

import time

import pytest

from solver.pipeline_search import (
    candidate,
    compute_bound,
    edge_compute,
    fastest_compute,
    pipeline_search,
    stage_bound,
)
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
