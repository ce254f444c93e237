"""The pipeline search (a per-rank CP-SAT decomposition) against brute force over every combination of the ranks'
checkpoint assignments through the schedule simulation, on random instances small enough to enumerate; and the
plan it returns priced by `estimate` as the search priced it."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest

from costmodels import Engine, Precision, Workload, estimate, parse_cluster
from costmodels.engines import rules_of
from costmodels.pipeline_schedule import Schedule, local_stages, schedule_problem
from costmodels.pipeline_stages import stage_layers
from costmodels.stage_split import megatron_splits
from costmodels.verdict import memory_budget
from graphs import Checkpoint, resolve
from solver.search.pins import Pins
from solver.search.pipeline_search import (
    best_recompute,
    block_recompute,
    candidate,
    edge_compute,
    fastest_compute,
    one_kind,
    pipeline_search,
    registry_runs,
    split_array,
    split_bounds,
    stage_bound,
    step_ticks,
)
from solver.search.reference import (
    enumerate_pipelines,
    every_block_recompute,
    every_split_best,
    every_split_candidate,
)
from solver.search.route import Lowerings, Route
from solver.search.space import Outer, outer_space
from solver.search.tables import TICK_SECONDS

# Small models whose ranks hold a few layers each, so every combination of the ranks' assignments enumerates.
MODELS = ["gpt2", "meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"]
CLUSTERS = ["2xL4", "4xL4", "4xA100-40GB", "8xA100-40GB", "2x4xA10G"]


def instance(seed: int) -> dict:
    """A random pipeline instance that some launcher runs (redrawn until its space has pipeline configurations)."""
    rng = random.Random(seed)
    while True:
        case = _draw(rng)
        if space_of(case)[1].pipelines:
            return case


def _draw(rng: random.Random) -> dict:
    cluster = parse_cluster(rng.choice(CLUSTERS))
    pp = rng.choice([p for p in (2, 4) if cluster.world_size % p == 0])
    precision = Precision.BF16_MIXED if cluster.gpu.peak_flops("bf16") else Precision.FP16_MIXED
    engine = rng.choice([Engine.DDP, Engine.MEGATRON])  # torchtitan runs every schedule, Megatron two
    schedule = rng.choice([None, *(Schedule if engine is Engine.DDP else (Schedule.ONE_F_ONE_B,
                                                                         Schedule.INTERLEAVED_1F1B))])
    return {
        "model": rng.choice(MODELS), "cluster": cluster,
        "workload": Workload(seq_len=rng.choice([512, 1024, 2048]),
                             global_batch=cluster.world_size // pp * rng.choice([4, 8])),
        # A few configurations per instance: one engine, precision and micro-batch size; modes none and full,
        # with op-level SAC in some (every rank's assignments then multiply).
        "pins": Pins.of(pp=pp, tp=1, cp=1, engine=engine, zero=0,
                        precision=(precision,), micro_batch=rng.choice([1, 2]), pp_schedule=schedule,
                        optimizers=("adamw",), offload="none"),
        "modes": rng.choice([(Checkpoint.NONE, Checkpoint.FULL), (Checkpoint.NONE, Checkpoint.FULL),
                             (Checkpoint.NONE, Checkpoint.OP_SELECTIVE, Checkpoint.FULL)]),
        "headroom": round(rng.uniform(0.3, 0.97), 2),  # from loose to nothing fits
    }


def tight(case: dict, graph_of, space, modes: tuple[Checkpoint, ...], fraction: float) -> float:
    """A headroom whose budget sits `fraction` of the way from the first configuration's leanest peak to its
    fastest one (on its most loaded rank), so that ranks must mix recompute with none."""
    outer = space.pipelines[0]
    found = candidate(outer, graph_of(outer), case["cluster"], case["workload"], headroom=0.0, modes=modes)
    if found is None:
        return 0.0
    lean = max(r.table.peak_of(tuple(modes[-1] for _ in r.kinds)) for r in found.ranks)
    fast = max(r.table.peak_of(tuple(modes[0] for _ in r.kinds)) for r in found.ranks)
    target = lean + fraction * (fast - lean)
    low, high = 0.0, 0.99
    for _ in range(30):  # the budget falls as the headroom grows
        middle = (low + high) / 2
        if memory_budget(case["cluster"], outer.config(), middle) > target:
            low = middle
        else:
            high = middle
    return low


def space_of(case: dict):
    resolved = resolve(case["model"])
    graph_of = Lowerings(Route(resolved=resolved, op_selective=True))
    space = outer_space(graph_of(Outer()), case["cluster"], case["workload"], case["pins"])
    return graph_of, space


def balanced(outers, graph_of, workload: Workload) -> tuple[Outer, ...]:
    """The configurations pinned to their balanced split (the search then tries no other)."""
    return tuple(replace(o, pp_split=stage_layers(graph_of(o), workload, o.config())) for o in outers)


def solved(seed: int) -> tuple[dict, object, object]:
    """A seed's instance (two in three with a budget between its leanest and fastest peak, the rest from loose
    to nothing fits), its brute-force best and the search's result, both at each configuration's balanced
    split (the splits' search is compared below)."""
    case = instance(seed)
    graph_of, space = space_of(case)
    modes = tuple(m for m in case["modes"] if m in space.modes)
    if seed % 3:
        case["headroom"] = tight(case, graph_of, space, modes, random.Random(seed).uniform(0.1, 0.9))
    outers = balanced(space.pipelines, graph_of, case["workload"])
    found = [c for o in outers if (c := candidate(o, graph_of(o), case["cluster"], case["workload"],
                                                  headroom=case["headroom"], modes=modes)) is not None]
    best = enumerate_pipelines(found, modes)
    result = pipeline_search(outers, graph_of, case["cluster"], case["workload"], headroom=case["headroom"],
                             modes=modes, incumbent=None, deadline=time.perf_counter() + 120)
    return case, best, result


SEEDS = range(30)


@pytest.mark.parametrize("seed", SEEDS)
def test_pipeline_search_equals_brute_force_over_every_rank_assignment(seed):
    _, best, result = solved(seed)
    if best is None:
        assert result.outer is None and result.status == "INFEASIBLE"
        return
    assert result.status == "OPTIMAL"
    assert result.step_ticks == best.step_ticks


@pytest.mark.parametrize("seed", range(10))
def test_the_splits_search_equals_every_split_searched_alone(seed):
    # Every split Megatron's flags express, each configuration and split built and solved on its own: the search's
    # bounds, its order over the splits and the rank tables it shares between them lose nothing.
    case = instance(seed)
    graph_of, space = space_of(case)
    modes = tuple(m for m in case["modes"] if m in space.modes)
    if seed % 3:
        case["headroom"] = tight(case, graph_of, space, modes, random.Random(seed).uniform(0.1, 0.9))
    outers = space.pipelines[:6]
    result = pipeline_search(outers, graph_of, case["cluster"], case["workload"], headroom=case["headroom"],
                             modes=modes, incumbent=None, deadline=time.perf_counter() + 120)
    best = every_split_best(outers, graph_of, case["cluster"], case["workload"], headroom=case["headroom"],
                            modes=modes)
    assert result.status == ("OPTIMAL" if best is not None else "INFEASIBLE")
    assert result.step_ticks == best


def test_every_splits_bound_at_once_equals_its_stage_bound():
    # `split_bounds` prices hundreds of splits with numpy; `stage_bound` one split, stage by stage.
    compared = 0
    for seed in range(8):
        case = instance(seed)
        graph_of, space = space_of(case)
        modes = tuple(m for m in case["modes"] if m in space.modes)
        for outer in space.pipelines[:8]:
            graph = graph_of(outer)
            if local_stages(outer.pp_schedule, outer.pp_virtual) > 1 or not one_kind(graph):
                continue
            fastest = fastest_compute(outer, graph, case["cluster"], case["workload"], modes, {})
            edges = edge_compute(outer, graph, case["cluster"], case["workload"], {})
            splits = megatron_splits(len(graph.decoder_layers()), outer.pp)
            at_once = split_bounds(outer, fastest, edges, split_array(len(graph.decoder_layers()), outer.pp))
            # the two add the same floats in another order: a tick apart at most
            assert all(abs(a - stage_bound(outer, graph, case["workload"], fastest, edges, split)) <= 1
                       for a, split in zip(at_once, splits, strict=True))
            compared += len(splits)
    assert compared >= 100


def llama_on_four_a100s(headroom: float) -> dict:
    """Llama-3.2-1B over four pipeline ranks on Megatron, memory tight at headroom 0.65-0.71."""
    return {"model": "meta-llama/Llama-3.2-1B", "cluster": parse_cluster("4xA100-40GB"),
            "workload": Workload(seq_len=2048, global_batch=16), "headroom": headroom,
            "pins": Pins.of(pp=4, tp=1, cp=1, engine=Engine.MEGATRON, zero=0, precision=(Precision.BF16_MIXED,),
                            micro_batch=1, optimizers=("adamw",), offload="none")}


def test_where_memory_binds_another_split_runs_faster_or_fits_alone():
    # Llama-3.2-1B on 4 A100-40GB: the FLOP-balanced split's first rank holds four micro-batches of five layers;
    # a lighter first stage recomputes less (headroom 0.65) or fits where the balanced split cannot (0.7).
    # (1F1B's one stage per rank: interleaved stages split layers to balance the ranks, `stage_layers`)
    case = llama_on_four_a100s(headroom=0.0)
    graph_of, space = space_of(case)
    single = tuple(o for o in space.pipelines if o.pp_virtual == 1)
    modes = (Checkpoint.NONE, Checkpoint.FULL)
    steps = {}
    for headroom in (0.65, 0.7):
        for outers in (single, balanced(single, graph_of, case["workload"])):
            result = pipeline_search(outers, graph_of, case["cluster"], case["workload"], headroom=headroom,
                                     modes=modes, incumbent=None, deadline=time.perf_counter() + 60)
            steps[headroom, outers is single] = result.step_ticks, result.outer
    (searched, outer), (at_balanced, balanced_outer) = steps[0.65, True], steps[0.65, False]
    assert searched < at_balanced and outer.pp_split != balanced_outer.pp_split
    assert steps[0.7, True][0] is not None and steps[0.7, False][0] is None


@pytest.mark.parametrize("pp", [2, 4])
def test_the_splits_search_equals_brute_force_over_every_split_and_rank_assignment(pp):
    # gpt2's 12 layers: every split and every combination of its ranks' assignments through the simulation, with a
    # budget tight enough that the balanced split must recompute.
    case = {"model": "gpt2", "cluster": parse_cluster("4xA100-40GB"), "headroom": 0.0,
            "workload": Workload(seq_len=1024, global_batch=4 // pp * 8), "modes": (Checkpoint.NONE, Checkpoint.FULL),
            "pins": Pins.of(pp=pp, tp=1, cp=1, engine=Engine.DDP, zero=0, precision=(Precision.BF16_MIXED,),
                            micro_batch=2, pp_schedule=Schedule.ONE_F_ONE_B, optimizers=("adamw",), offload="none")}
    graph_of, space = space_of(case)
    modes = case["modes"]
    outers = space.pipelines[:2]
    compared = 0
    for fraction in (0.2, 0.6):
        headroom = tight(case, graph_of, space, modes, fraction)
        found = every_split_candidate(outers, graph_of, case["cluster"], case["workload"], headroom=headroom,
                                      modes=modes)
        best = enumerate_pipelines(found, modes)
        result = pipeline_search(outers, graph_of, case["cluster"], case["workload"], headroom=headroom,
                                 modes=modes, incumbent=None, deadline=time.perf_counter() + 120)
        assert best is not None and result.status == "OPTIMAL"
        assert result.step_ticks == best.step_ticks
        compared += len(found)
    assert compared >= 2 * (11 if pp == 2 else 25)


@pytest.mark.parametrize("seed", range(12))
def test_block_recompute_by_bisection_equals_trying_every_block(seed):
    # Budgets from the leanest to the fastest peak, so that the best block size falls anywhere in each stage.
    case = instance(seed)
    graph_of, space = space_of(case)
    modes = tuple(m for m in case["modes"] if m in space.modes)
    compared = 0
    for fraction in (0.0, 0.3, 0.7, 1.0):
        headroom = tight(case, graph_of, space, modes, fraction)
        for outer in space.pipelines[:4]:
            found = candidate(outer, graph_of(outer), case["cluster"], case["workload"], headroom=headroom,
                              modes=modes)
            if found is None:
                continue
            runs = registry_runs(graph_of(outer))
            assert block_recompute(found, modes, runs) == every_block_recompute(found, modes, runs)
            compared += 1
    assert compared


def test_ranks_solved_per_layer_that_no_launcher_runs_fall_back_to_runnable_blocks():
    # A launcher rule the per-layer probe does not meet (here: some layer must recompute) makes the per-rank CP-SAT
    # answer (no recompute anywhere, memory being loose) unrunnable: the runnable blocks come back, not proven best.
    case = instance(0)
    graph_of, space = space_of(case)
    outer = space.pipelines[0]
    found = candidate(outer, graph_of(outer), case["cluster"], case["workload"], headroom=0.0,
                      modes=(Checkpoint.NONE, Checkpoint.FULL))
    runs = registry_runs(graph_of(outer))

    def some_recompute(config) -> bool:
        return Checkpoint.FULL in config.checkpoint and runs(config)

    loose, proved = best_recompute(found, (Checkpoint.NONE, Checkpoint.FULL), runs, deadline=time.perf_counter() + 60)
    assert proved and all(m is Checkpoint.NONE for rank in loose for m in rank)
    kept, proved = best_recompute(found, (Checkpoint.NONE, Checkpoint.FULL), some_recompute,
                                  deadline=time.perf_counter() + 60)
    assert not proved and some_recompute(found.config(kept))
    assert kept == block_recompute(found, (Checkpoint.NONE, Checkpoint.FULL), some_recompute)


@pytest.mark.parametrize("seed", range(12))
def test_the_ranks_states_together_hold_at_least_the_whole_models(seed):
    # What lets `pipeline_search` refuse a configuration whose whole-model states exceed pp budgets without slicing it.
    from costmodels.pipeline_stages import rank_slices
    from costmodels.states import model_states

    case = instance(seed)
    graph_of, space = space_of(case)
    for outer in space.pipelines:
        for engine, zero in ((outer.engine, outer.zero), (Engine.MEGATRON, 1), (Engine.FSDP2, 2)):
            if schedule_problem(outer.pp_schedule, outer.pp, outer.grad_accum, outer.pp_virtual,
                                megatron=rules_of(engine).megatron_schedules) is not None:
                continue  # a layout only its own engine runs (megatron-core's 1F1B with m < pp)
            config = replace(outer, engine=engine, zero=zero).config()
            graph = graph_of(outer)
            ranks = [model_states(s.graph, config) for s in rank_slices(graph, case["workload"], config)]
            whole = model_states(graph, config)
            assert sum(r.gpu_total for r in ranks) >= whole.gpu_total


def test_the_random_instances_cover_every_schedule_and_ranks_that_mix_recompute():
    cases = [solved(seed) for seed in SEEDS]
    schedules = {case_["pins"].value("pp_schedule") or r.outer.pp_schedule for case_, _, r in cases if r.outer}
    assert schedules == set(Schedule)
    mixed = [b for _, b, _ in cases if b is not None and len({m for rank in b.modes for m in rank}) > 1]
    infeasible = [b for _, b, _ in cases if b is None]
    assert len(mixed) >= 10 and infeasible


def test_the_plan_is_priced_by_estimate_as_the_search_priced_it():
    case = llama_on_four_a100s(headroom=0.71)
    graph_of, space = space_of(case)
    modes = (Checkpoint.NONE, Checkpoint.FULL)
    result = pipeline_search(space.pipelines, graph_of, case["cluster"], case["workload"], headroom=case["headroom"],
                             modes=modes, incumbent=None, deadline=time.perf_counter() + 60)
    assert result.outer is not None
    assert Checkpoint.FULL in result.modes and Checkpoint.NONE in result.modes  # tight: some layers recompute
    found = candidate(result.outer, graph_of(result.outer), case["cluster"], case["workload"],
                      headroom=case["headroom"], modes=modes)
    config = result.outer.config(result.modes)
    priced = estimate(graph_of(result.outer), case["cluster"], case["workload"], config)
    assert abs(priced.time.step_time - result.step_ticks * TICK_SECONDS) <= 2 * TICK_SECONDS
    assert priced.pipeline is not None and len(priced.pipeline.ranks) == 4
    for rank, table in zip(priced.pipeline.ranks, found.ranks, strict=True):
        own = tuple(result.modes[i] for i in table.slice.layers)
        assert rank.memory.allocated_peak == table.table.peak_of(own) <= table.table.budget
    # each rank's modes are its fastest that fit: one more layer without recompute no longer fits
    assert step_ticks(found, [tuple(result.modes[i] for i in r.slice.layers) for r in found.ranks]) == \
        result.step_ticks


# Context and expert parallelism without a pipeline are whole-model configurations: the CP-SAT model over their
# tables against enumerate_best, with budgets between each instance's leanest and fastest peak.
def _tiny_moe(folder) -> str:
    from tests.graphs.reference import write_config
    from tests.graphs.tiny_configs import tiny_values

    values = {**tiny_values("mixtral"), "num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 1024}
    return str(write_config(folder / "mixtral", values))


def whole_model_case(seed: int, moe_path: str) -> dict:
    rng = random.Random(seed)
    cluster = parse_cluster(rng.choice(["4xA100-40GB", "8xA100-40GB", "2x4xA100"]))
    precision = Precision.BF16_MIXED if cluster.gpu.peak_flops("bf16") else Precision.FP16_MIXED
    moe = seed % 2 == 0
    # Megatron runs CP and EP (its DDP or its distributed optimizer).
    pins = dict(tp=1, pp=1, engine=Engine.MEGATRON, zero=rng.choice([0, 1]), precision=(precision,),
                micro_batch=1, optimizers=("adamw",), offload="none")
    pins.update(ep=rng.choice([2, 4]), cp=1) if moe else pins.update(cp=2, cp_mode=rng.choice(["ring", "all-to-all"]))
    return {"model": moe_path if moe else rng.choice(["meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B"]),
            "cluster": cluster, "pins": Pins.of(**pins), "fraction": rng.uniform(0.1, 0.9),
            "workload": Workload(seq_len=rng.choice([2048, 4096]), global_batch=cluster.world_size * 2)}


@pytest.mark.parametrize("seed", range(12))
def test_cpsat_equals_enumeration_with_context_or_expert_parallelism(seed, tmp_path_factory):
    from solver.search.reference import enumerate_best
    from solver.search.table_search import build_tables, search

    case = whole_model_case(seed, _tiny_moe(tmp_path_factory.mktemp("moe")))
    graph_of, space = space_of(case)
    layout = "ep" if seed % 2 == 0 else "cp"
    assert space.outers and all(getattr(o, layout) > 1 for o in space.outers)
    modes = tuple(m for m in (Checkpoint.NONE, Checkpoint.FULL) if m in space.modes)
    kinds = [layer.kind for layer in graph_of(Outer()).decoder_layers()]
    loose = build_tables(space, graph_of, case["cluster"], case["workload"], headroom=0.0)
    leanest = min(loose, key=lambda t: t.peak_of(tuple(Checkpoint.FULL for _ in kinds)))
    lean = leanest.peak_of(tuple(Checkpoint.FULL for _ in kinds))
    fast = leanest.peak_of(tuple(Checkpoint.NONE for _ in kinds))
    target, low, high = lean + case["fraction"] * (fast - lean), 0.0, 0.99
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if memory_budget(case["cluster"], leanest.outer.config(), middle) > target \
            else (low, middle)
    tables = build_tables(space, graph_of, case["cluster"], case["workload"], headroom=low)
    best = enumerate_best(tables, kinds, modes)
    found = search(tables, kinds, modes, time_limit=60.0, configurations=len(tables))
    assert best is not None and found.result.status == "OPTIMAL"
    assert found.result.objective == best.objective
    assert (found.result.table, found.result.modes) == (best.table, best.modes)


@pytest.mark.parametrize("seed", range(0, 30, 3))
def test_peak_lower_bound_is_never_above_any_assignment(seed):
    """`search.peak_lower_bound` proves tables infeasible without CP-SAT: it must not exceed the peak of any
    assignment (checked against every canonical assignment of each rank, in-flight micro-batches included)."""
    from solver.search.space import all_counts, canonical_modes
    from solver.search.table_search import peak_lower_bound

    case = instance(seed)
    graph_of, space = space_of(case)
    modes = tuple(m for m in case["modes"] if m in space.modes)
    for outer in space.pipelines[:3]:
        found = candidate(outer, graph_of(outer), case["cluster"], case["workload"], headroom=0.0, modes=modes)
        for rank in found.ranks if found else ():
            peaks = [rank.table.peak_of(canonical_modes(rank.kinds, c)) for c in all_counts(rank.kinds, modes)]
            assert peak_lower_bound(rank.table, modes) <= min(peaks)
            assert peak_lower_bound(rank.table, modes[-1:]) == rank.table.peak_of(tuple(modes[-1:] * len(rank.kinds)))


# Ranks whose moment with the most micro-batches in flight is not the one that holds the most (uneven stages).
SEVERAL_STAGES = [("Qwen/Qwen2.5-0.5B", Schedule.INTERLEAVED_1F1B, 4), ("meta-llama/Llama-3.2-1B",
                                                                      Schedule.INTERLEAVED_ZB, 4),
                  ("meta-llama/Llama-3.2-1B", Schedule.ZBV, 6)]


@pytest.mark.parametrize(("model", "schedule", "m"), SEVERAL_STAGES, ids=str)
def test_peak_lower_bound_of_a_rank_running_several_stages_is_its_peak_with_one_mode(model, schedule, m):
    """With one mode allowed, the bound of a rank that runs several stages equals its peak, though its moments
    hold different mixes of its stages' micro-batches; with two it stays below every assignment."""
    from solver.search.space import all_counts, canonical_modes
    from solver.search.table_search import peak_lower_bound

    graph = Lowerings(Route(resolved=resolve(model), op_selective=True))(Outer())
    outer = Outer(pp=2, pp_schedule=schedule, pp_virtual=2, grad_accum=m, micro_batch=1, dp=1,
                  precision=Precision.BF16_MIXED, engine=Engine.DDP)
    modes = (Checkpoint.NONE, Checkpoint.FULL)
    found = candidate(outer, graph, parse_cluster("2xA100-40GB"), Workload(seq_len=1024, global_batch=m),
                      headroom=0.0, modes=modes)
    for rank in found.ranks:
        assert len(rank.slice.stages) == 2
        for mode in modes:
            assert peak_lower_bound(rank.table, (mode,)) == rank.table.peak_of((mode,) * len(rank.kinds))
        peaks = [rank.table.peak_of(canonical_modes(rank.kinds, c)) for c in all_counts(rank.kinds, modes)]
        assert peak_lower_bound(rank.table, modes) <= min(peaks)
