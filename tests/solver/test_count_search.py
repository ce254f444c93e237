"""The count-vector proof (`solver.search.count_search`) against CP-SAT on the same one-table model, and its answers
against the reference walk (`Table.peak_of`, `tables.objective`)."""

from __future__ import annotations

import pytest

from costmodels import Offload, Precision, Workload, parse_cluster
from graphs import Checkpoint
from solver.search.count_search import best_below
from solver.search.model import add_objective_cutoff, build_model, solve
from solver.search.pins import Pins
from solver.search.table_search import fastest_modes
from solver.search.tables import objective, table_modes, tie_weight
from tests.solver.test_model import instance, tables_for

TABLES_PER_INSTANCE = 6
UNBOUNDED = 2**62


def _cpsat_below(table, kinds, modes, weight, cutoff):
    pm = build_model([table], kinds, modes, weight=weight)
    add_objective_cutoff(pm, cutoff)
    found = solve(pm, time_limit=60)
    assert found.status in ("OPTIMAL", "INFEASIBLE")
    return found.objective


def _settle(tables, kinds, modes) -> tuple[int, int]:
    """Check every table that fits its states at cut-offs at its CP-SAT optimum (nothing below it), just above it
    (the optimum itself), midway down to its fastest assignment's objective (fewer vectors, none fitting: the
    fastest assignment is never above the optimum), and unbounded; (checked, optima that checkpoint some layers but
    not all in one mode)."""
    weight = tie_weight(tables, len(kinds))
    settled = partial = 0
    for table in [t for t in tables if t.states_fit][:TABLES_PER_INSTANCE]:
        optimum = _cpsat_below(table, kinds, modes, weight, UNBOUNDED)
        cutoffs = [UNBOUNDED]
        if optimum is not None:
            fastest = objective(table, fastest_modes(table, kinds, table_modes(table, modes)), tie_weight=weight)
            cutoffs += [optimum, optimum + 1, (optimum + fastest) // 2 + 1]
        for cutoff in cutoffs:
            counted = best_below(table, kinds, modes, weight=weight, cutoff=cutoff)
            if counted is None:  # more vectors than it evaluates: left to CP-SAT
                continue
            settled += 1
            expected = None if optimum is None or optimum >= cutoff else optimum
            assert counted.objective == expected, (table.outer, cutoff)
            if expected is not None:  # the assignment it names is that optimum by the reference walk
                assert table.peak_of(counted.modes) <= table.budget
                assert objective(table, counted.modes, tie_weight=weight) == expected
                partial += len(set(counted.modes)) > 1
    return settled, partial


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(14))
def test_count_vectors_settle_a_table_as_its_cpsat_model_does_on_random_instances(seed):
    case = instance(seed)
    tables, kinds, modes = tables_for(case, seed)
    settled, _ = _settle(tables, kinds, modes)
    assert settled or not any(t.states_fit for t in tables)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "gpus", "seq_len"), [
    ("meta-llama/Llama-3.2-1B", "1xA100-40GB", 2048),  # one layer kind, every checkpoint mode
    ("google/gemma-2-2b", "1xH100", 4096),  # two layer kinds (sliding-window and global attention)
])
def test_count_vectors_settle_memory_bound_tables_as_cpsat_does(model, gpus, seq_len):
    # Headrooms from loose to tight, so that the optima checkpoint some layers, in more than one mode.
    settled = partial = 0
    for headroom in (0.1, 0.25, 0.35, 0.45, 0.55):
        case = {"model": model, "cluster": parse_cluster(gpus), "workload": Workload(seq_len=seq_len, global_batch=4),
                "pins": Pins.of(micro_batch=1, offload=Offload.NONE, precision=(Precision.BF16_MIXED,)),
                "headroom": headroom}
        tables, kinds, modes = tables_for(case, seed=1)
        found = _settle(tables, kinds, modes)
        settled, partial = settled + found[0], partial + found[1]
    assert settled >= 20 and partial >= 2


@pytest.mark.slow
def test_activation_offload_tables_have_every_layer_fully_checkpointed():
    # Offloading activations runs only with every layer fully checkpointed (`Outer.runs`), whatever modes the space
    # searches: the one assignment, by the reference walk, at loose and tight memory.
    fits = 0
    for headroom in (0.05, 0.5):
        case = {"model": "Qwen/Qwen2.5-0.5B", "cluster": parse_cluster("1xL4"),
                "workload": Workload(seq_len=4096, global_batch=8),
                "pins": Pins.of(activation_offload=(False, True), micro_batch=1, precision=(Precision.BF16_MIXED,)),
                "headroom": headroom}
        tables, kinds, modes = tables_for(case, seed=1)
        assert Checkpoint.NONE in modes
        weight = tie_weight(tables, len(kinds))
        for table in [t for t in tables if t.outer.activation_offload and t.states_fit]:
            full = (Checkpoint.FULL,) * len(kinds)
            expected = objective(table, full, tie_weight=weight) if table.peak_of(full) <= table.budget else None
            counted = best_below(table, kinds, modes, weight=weight, cutoff=UNBOUNDED)
            assert counted.objective == expected and counted.modes in ((), full)
            fits += expected is not None
    assert fits


def test_a_table_with_more_vectors_than_it_evaluates_is_left_to_cpsat(monkeypatch):
    import solver.search.count_search as count_search

    case = instance(0)
    tables, kinds, modes = tables_for(case, 0)
    table = next(t for t in tables if t.states_fit)
    weight = tie_weight(tables, len(kinds))
    monkeypatch.setattr(count_search, "MAX_VECTORS", 0)
    assert best_below(table, kinds, modes, weight=weight, cutoff=UNBOUNDED) is None
