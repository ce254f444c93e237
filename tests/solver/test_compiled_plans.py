"""Compiled plans are priced on the compiled lowering (issue 10): what their layers save is what Inductor's
partitioner keeps (graphs/compiled.py, checked against real torch.compile in tests/graphs/test_compiled.py), their
work is the eager trace's (the time model prices fusion itself), and a configuration the tables keep eager is
priced on the eager lowering."""

from __future__ import annotations

import pytest

from costmodels import Config, Engine, Workload, estimate, parse_cluster
from costmodels.memory import memory_terms
from graphs import Checkpoint, lower
from solver import solve
from solver.search import tables as tables_module
from solver.search.space import Outer

MODEL = "gpt2"


@pytest.fixture(scope="module")
def graphs():
    return lower(MODEL), lower(MODEL, compiled=True)


def test_compiled_lowering_saves_less_in_plain_layers_and_the_same_work(graphs):
    eager, compiled = graphs
    for plain, fused in zip(eager.decoder_layers(), compiled.decoder_layers(), strict=True):
        assert fused.cost(Checkpoint.NONE).saved(b=2, s=512) < plain.cost(Checkpoint.NONE).saved(b=2, s=512)
        assert fused.cost(Checkpoint.FULL).saved(b=2, s=512) == plain.cost(Checkpoint.FULL).saved(b=2, s=512)
        for mode in plain.checkpoint_modes:
            assert fused.cost(mode).forward == plain.cost(mode).forward
            assert fused.cost(mode).backward == plain.cost(mode).backward


def test_a_compiled_plan_is_priced_on_the_compiled_lowering(graphs):
    eager, compiled = graphs
    plan = solve(MODEL, "1xA100", seq_len=1024, global_batch=8, compile="on", checkpoint="none", engine="fsdp2",
                 zero=3)
    assert plan.decisions.compile
    config = plan.decisions
    workload = Workload(seq_len=1024, global_batch=8)
    priced = estimate(compiled, parse_cluster("1xA100"), workload, config)
    assert plan.estimate.memory.allocated_peak == priced.memory.allocated_peak
    assert priced.memory.activations < estimate(eager, parse_cluster("1xA100"), workload, config).memory.activations


def test_a_table_that_keeps_compile_off_is_priced_on_the_eager_lowering(graphs, monkeypatch):
    eager, compiled = graphs
    monkeypatch.setattr(tables_module, "COMPILE_MIN_SAVING", 1.0)  # no saving is enough: every table drops it
    workload = Workload(seq_len=1024, global_batch=8)
    outer = Outer(engine=Engine.FSDP2, zero=3, micro_batch=8, compile=True)  # bf16 weights, as lowered
    table = tables_module.build_table(compiled, parse_cluster("1xA100"), workload, outer, rank=0, headroom=0.05,
                                      compile_auto=True, eager_graph=eager)
    assert not table.outer.compile
    assert table.build_memory() == memory_terms(eager, workload, Config(engine=Engine.FSDP2, zero=3,
                                                                               micro_batch=8))
