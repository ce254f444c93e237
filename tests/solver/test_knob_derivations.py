"""What the search and the plan derive from the knob record (`costmodels.knobs.Knob`) instead of hand-kept lists:
the strategy that makes alternatives distinct (`Outer.family`), the knobs the search opens (`Knob.searched`) and the
layout line (`Knob.shown`), so that a new parallelism-like knob is its declaration, cost modules and emitters."""

from __future__ import annotations

import dataclasses

from costmodels import Engine, Offload, parse_cluster
from solver.search import space
from solver.search.outer import STRATEGY, Outer
from solver.search.pins import KNOBS, Pins


def test_family_is_the_strategy_knobs_of_the_record():
    # the parallel degrees, the engine and its stage, and the offloads: the alternatives `alternatives.py` ranks
    assert set(STRATEGY) >= {"tp", "cp", "pp", "ep", "engine", "zero", "optimizer_offload", "param_offload"}
    assert not {"micro_batch", "grad_accum", "checkpoint", "precision", "optimizer", "compile"} & set(STRATEGY)
    one = Outer(engine=Engine.FSDP2, zero=3, dp=8, micro_batch=1)
    assert one.family == dataclasses.replace(one, micro_batch=2, grad_accum=4).family
    assert one.family != dataclasses.replace(one, zero=2).family
    assert one.family != dataclasses.replace(one, optimizer_offload=Offload.CPU, param_offload=Offload.CPU).family


def _searched(values, gpus_per_node):
    """A stand-in declaration: offers 2 where dp spans more than one node."""
    return (False, True) if values["dp"] > gpus_per_node else (False,)


def test_a_knob_declared_searched_is_opened_where_its_declaration_offers_values(monkeypatch):
    knob = KNOBS["compile"]
    monkeypatch.setitem(KNOBS, "compile", dataclasses.replace(
        knob, knob=dataclasses.replace(knob.knob, searched=_searched)))
    monkeypatch.setattr(space, "SEARCHED", ("compile",))
    cluster = parse_cluster("2x8xH100")
    assert space.opened_knobs({"dp": 16}, cluster, Pins()) == [{"compile": False}, {"compile": True}]
    assert space.opened_knobs({"dp": 8}, cluster, Pins()) == [{"compile": False}]
    assert space.opened_knobs({"dp": 16}, cluster, Pins.of(compile=True)) == [{}]  # the pin stands



def test_pipeline_compute_is_timed_at_the_defaults_of_the_knobs_declared_outside_compute():
    from costmodels import Optimizer
    from costmodels.pipeline_schedule import Schedule
    from solver.search.pipeline_search import compute_key

    outer = Outer(engine=Engine.DDP, pp=2, dp=4, micro_batch=2, grad_accum=8, pp_schedule=Schedule.GPIPE,
                  optimizer=Optimizer.SGD)
    key = compute_key(outer)
    outside = [name for name, declared in KNOBS.items() if declared.knob.outside_compute]
    assert {"pp", "pp_schedule", "grad_accum", "optimizer", "optimizer_offload"} <= set(outside)
    assert all(getattr(key, name) == KNOBS[name].default for name in outside)
    assert (key.dp, key.micro_batch, key.engine) == (outer.ep, 2, Engine.DDP)  # the compute setting stays
