"""`runnable.Runnable` asks the launcher rules once per family of knobs, and remembers the answers across spaces:
the rules read no cluster, so a space built after another GPU's (a `choose` sweep) is the one built afresh."""

from __future__ import annotations

import pytest

from costmodels import Workload, parse_cluster
from graphs import lower
from solver.search import runnable
from solver.search.pins import Pins
from solver.search.space import outer_space

WORKLOAD = Workload(seq_len=2048, global_batch=16)


@pytest.mark.parametrize("pins", [Pins.of(), Pins.of(launcher="megatron")])
def test_a_space_built_after_another_gpus_equals_one_built_afresh(pins):
    graph = lower("meta-llama/Llama-3.2-1B")
    build = outer_space.__wrapped__  # not the lru_cache of whole spaces
    fresh = {}
    for spec in ("16xH100", "16xA100"):
        runnable._MARKS.clear()
        fresh[spec] = build(graph, parse_cluster(spec), WORKLOAD, pins)
    runnable._MARKS.clear()
    first = build(graph, parse_cluster("16xA100"), WORKLOAD, pins)
    asked = sum(map(len, runnable._MARKS.values()))
    second = build(graph, parse_cluster("16xH100"), WORKLOAD, pins)
    assert sum(map(len, runnable._MARKS.values())) < 2 * asked  # families the A100 space asked were not asked again
    assert (first, second) == (fresh["16xA100"], fresh["16xH100"])
    assert second.outers or second.pipelines
