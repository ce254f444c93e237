"""The CP-SAT model against the exhaustive enumeration, on random instances small enough to enumerate."""

from __future__ import annotations

import random

import pytest

from costmodels import Engine, Offload, Precision, Workload, parse_cluster
from graphs import Checkpoint, resolve
from graphs.lowering import lower_resolved
from solver.search.pins import Pins
from solver.search.reference import enumerate_best
from solver.search.route import Lowerings, Route
from solver.search.space import all_counts, canonical_modes, outer_space
from solver.search.table_search import build_tables, search
from solver.search.tables import TICK_SECONDS, objective, tie_weight

SMALL_MODELS = ["gpt2", "facebook/opt-125m", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B",
                "EleutherAI/pythia-1b", "google/gemma-2-2b"]
CLUSTERS = ["1xT4", "1xL4", "2xA10G", "4xL4", "8xA100-40GB", "2x8xH100", "16xA100"]


def instance(seed: int) -> dict:
    rng = random.Random(seed)
    model = rng.choice(SMALL_MODELS)
    gpus = rng.choice(CLUSTERS)
    cluster = parse_cluster(gpus)
    engine = rng.choice([Engine.DEEPSPEED, Engine.FSDP2, None])
    modes = rng.choice([None, None, Checkpoint.FULL, Checkpoint.NONE, Checkpoint.OP_SELECTIVE])
    batch = cluster.world_size * rng.choice([1, 2, 4])
    precision = Precision.BF16_MIXED if cluster.gpu.peak_flops("bf16") else Precision.FP16_MIXED
    return {
        "model": model, "cluster": cluster,
        "workload": Workload(seq_len=rng.choice([256, 512, 1024, 2048]), global_batch=batch),
        "pins": Pins.of(engine=engine, checkpoint=modes, precision=(precision,)),
        # From loose to so tight that nothing may fit.
        "headroom": rng.choice([0.0, 0.3, 0.6, 0.8, 0.9, 0.95]),
    }


# Enumeration cost: (canonical assignments) x (tables). Models with many layers per kind enumerate with fewer
# modes (one of SELECTIVE / OP_SELECTIVE left out, alternating by seed, then both) to keep each instance to a
# few seconds.
MAX_ASSIGNMENTS = 300


def tables_for(case: dict, seed: int = 0) -> tuple[list, list[int], tuple[Checkpoint, ...]]:
    """The tables of a case's space, lowered with op-level SAC traced (the torchrun launcher runs it per layer)."""
    resolved = resolve(case["model"])
    graph_of = Lowerings(Route(resolved=resolved, op_selective=True))
    graph = lower_resolved(resolved, op_selective=True)
    space = outer_space(graph, case["cluster"], case["workload"], case["pins"])
    tables = build_tables(space, graph_of, case["cluster"], case["workload"], headroom=case["headroom"])
    kinds = [layer.kind for layer in graph.decoder_layers()]
    modes = space.modes
    for dropped in ((Checkpoint.SELECTIVE, Checkpoint.OP_SELECTIVE)[::1 if seed % 2 else -1]):
        if len(all_counts(kinds, modes)) > MAX_ASSIGNMENTS and len(modes) > 1:
            modes = tuple(m for m in modes if m is not dropped)
    return tables, kinds, modes


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(50))
def test_cpsat_objective_equals_enumeration_on_random_instances(seed):
    case = instance(seed)
    tables, kinds, modes = tables_for(case, seed)
    best = enumerate_best(tables, kinds, modes)
    found = search(tables, kinds, modes, time_limit=30.0, configurations=len(tables))
    if best is None:
        assert found.result.table is None and found.result.status == "INFEASIBLE"
        return
    assert found.result.status == "OPTIMAL"
    assert found.result.objective == best.objective
    assert (found.result.table, found.result.modes) == (best.table, best.modes)


def test_table_costs_equal_a_fresh_estimate_of_the_same_configuration():
    case = {"model": "meta-llama/Llama-3.2-1B", "cluster": parse_cluster("2xL4"),
            "workload": Workload(seq_len=1024, global_batch=8), "pins": Pins.of(precision=(Precision.BF16_MIXED,)),
            "headroom": 0.05}
    tables, kinds, _ = tables_for(case)
    resolved = resolve(case["model"])
    graph_of = Lowerings(Route(resolved=resolved, op_selective=True))
    from costmodels import estimate

    for table in tables[::7]:
        # selective modes only where a launcher that runs the configuration expresses them (`Outer.runs`)
        counts = (5, 2 if table.outer.op_selective else 0, 3 if table.outer.selective else 0)
        assignment = canonical_modes(kinds, {0: counts})
        est = estimate(graph_of(table.outer), case["cluster"], case["workload"], table.outer.config(assignment))
        assert table.peak_of(assignment) == est.memory.allocated_peak
        # Ticks round each layer's seconds to 1 µs: at most half a tick per term.
        assert abs(table.time_of(assignment) * TICK_SECONDS - est.time.step_time) <= (len(kinds) + 1) * TICK_SECONDS


def test_tight_memory_forces_checkpointing_of_the_earliest_layers():
    case = {"model": "meta-llama/Llama-3.2-1B", "cluster": parse_cluster("1xA100-40GB"),
            "workload": Workload(seq_len=1024, global_batch=4),
            "pins": Pins.of(engine=Engine.DEEPSPEED, zero=0, micro_batch=1, offload=Offload.NONE,
                         precision=(Precision.BF16_MIXED,)),
            "headroom": 0.32}
    tables, kinds, modes = tables_for(case)
    found = search(tables, kinds, modes, time_limit=10, configurations=len(tables))
    chosen = found.result.modes
    assert found.result.status == "OPTIMAL"
    checkpointed = [m is not Checkpoint.NONE for m in chosen]
    assert any(checkpointed) and not all(checkpointed)
    assert checkpointed == sorted(checkpointed, reverse=True)  # canonical: earliest layers first
    weight = tie_weight(tables, len(kinds))
    assert found.result.objective == objective(tables[found.result.table], chosen, tie_weight=weight)


def test_cpsat_equals_enumeration_where_op_level_sac_mixes_with_other_modes():
    # Llama-3.2-1B under DDP on one A100-40GB: as the headroom grows, the best plan moves from no recompute
    # through op-level SAC on the first layers to full recompute before op-level SAC. The memory-bound cases where
    # the enumeration mixes op-level SAC with another mode are the reference (which headrooms they are moves
    # with the cost constants, so they are found, not fixed).
    mixed = 0
    for headroom in (0.2, 0.24, 0.28, 0.3, 0.32, 0.36, 0.4, 0.44):
        case = {"model": "meta-llama/Llama-3.2-1B", "cluster": parse_cluster("1xA100-40GB"),
                "workload": Workload(seq_len=2048, global_batch=4),
                "pins": Pins.of(engine=Engine.DDP, micro_batch=1, offload=Offload.NONE,
                                precision=(Precision.BF16_MIXED,)), "headroom": headroom}
        tables, kinds, modes = tables_for(case, seed=1)
        assert Checkpoint.OP_SELECTIVE in modes
        best = enumerate_best(tables, kinds, modes)
        if best is None or Checkpoint.OP_SELECTIVE not in best.modes or len(set(best.modes)) < 2:
            continue
        mixed += 1
        found = search(tables, kinds, modes, time_limit=30, configurations=len(tables))
        assert found.result.status == "OPTIMAL" and found.result.objective == best.objective
        assert (found.result.table, found.result.modes) == (best.table, best.modes)
    assert mixed >= 2  # the reference covers op-level SAC beside no recompute and beside full recompute


@pytest.mark.slow
def test_cpsat_equals_enumeration_with_memory_savers_in_the_space():
    """Savers allowed (--allow-savers): every loss and activation-offload setting is an outer configuration, the
    offloading ones fully checkpointed only (`Outer.runs`); CP-SAT's optimum equals the enumeration's as the
    budget tightens, and the savers win: Liger's fused loss where allowed, torchtune's chunked loss without it."""
    from costmodels.config import Loss

    winners = set()
    for losses, headroom in ((tuple(Loss), 0.0), (tuple(Loss), 0.5), (tuple(Loss), 0.7), (tuple(Loss), 0.8),
                             ((Loss.HF, Loss.CHUNKED), 0.3), ((Loss.HF, Loss.CHUNKED), 0.6)):
        # pure bf16 beside bf16-mixed: torchtune's chunked loss runs in one dtype (`loss.refusals`)
        pins = Pins.of(engine=Engine.DDP, precision=(Precision.BF16_MIXED, Precision.BF16), loss=losses,
                       activation_offload=(False, True))
        case = {"model": "Qwen/Qwen2.5-0.5B", "cluster": parse_cluster("1xL4"),
                "workload": Workload(seq_len=2048, global_batch=4), "pins": pins, "headroom": headroom}
        tables, kinds, modes = tables_for(case, seed=1)
        settings = {(t.outer.loss, t.outer.activation_offload) for t in tables}
        assert settings >= {(Loss.HF, False), (Loss.CHUNKED, True)}
        assert all(t.outer.runs(Checkpoint.FULL) and not t.outer.runs(Checkpoint.NONE)
                   for t in tables if t.outer.activation_offload)
        best = enumerate_best(tables, kinds, modes)
        found = search(tables, kinds, modes, time_limit=30, configurations=len(tables))
        if best is None:
            assert found.result.table is None and found.result.status == "INFEASIBLE"
            continue
        assert found.result.status == "OPTIMAL" and found.result.objective == best.objective
        assert (found.result.table, found.result.modes) == (best.table, best.modes)
        winners.add(tables[best.table].outer.loss)
    assert {Loss.FUSED_LINEAR, Loss.CHUNKED} <= winners


def test_canonical_modes_place_the_leanest_mode_first_within_each_kind():
    modes = canonical_modes([0, 1, 0, 0, 1, 0], {0: (1, 2, 1), 1: (0, 1)})
    # kind 0 (layers 0, 2, 3, 5): full, op-selective twice, selective; kind 1 (layers 1, 4): op-selective, none
    assert modes == (Checkpoint.FULL, Checkpoint.OP_SELECTIVE, Checkpoint.OP_SELECTIVE, Checkpoint.OP_SELECTIVE,
                     Checkpoint.NONE, Checkpoint.SELECTIVE)


@pytest.mark.parametrize(("allowed", "expected"), [
    # compositions of n = 3 layers into the allowed checkpointed modes (and NONE, when allowed)
    ((Checkpoint.NONE, Checkpoint.FULL, Checkpoint.SELECTIVE, Checkpoint.OP_SELECTIVE), 20),  # C(3 + 3, 3)
    ((Checkpoint.NONE, Checkpoint.OP_SELECTIVE), 4),
    ((Checkpoint.FULL, Checkpoint.OP_SELECTIVE), 4),  # every layer checkpointed: f + o = 3
    ((Checkpoint.OP_SELECTIVE,), 1),
])
def test_all_counts_enumerate_each_canonical_assignment_once(allowed, expected):
    counts = all_counts([0, 0, 0], allowed)
    assignments = {canonical_modes([0, 0, 0], c) for c in counts}
    assert len(counts) == len(assignments) == expected
    assert all(set(a) <= set(allowed) for a in assignments)
