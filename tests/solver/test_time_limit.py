"""A time limit never turns into a false "nothing fits": INFEASIBLE needs the whole space built and searched;
a search cut short returns its best plan as FEASIBLE (with what it explored) or says no plan was found in time."""

from __future__ import annotations

import gc
import re

import pytest
from typer.testing import CliRunner

from costmodels import Offload, Workload, parse_cluster
from graphs import Checkpoint, resolve
from graphs.lowering import lower_resolved
from solver import Infeasible, solve
from solver.cli.app import app
from solver.search.diagnose import NoPlanInTime
from solver.search.pins import Pins
from solver.search.route import Lowerings, Route
from solver.search.space import outer_space
from solver.search.table_search import build_order, build_tables, search, tie_break_ranks

MODEL = "meta-llama/Llama-3.2-1B"
TINY = 1e-6  # seconds: the search builds one table and stops


def space_and_tables(model: str, gpus: str, *, headroom: float = 0.05, deadline: float | None = None,
                     seq_len: int = 1024, global_batch: int = 8, pins: Pins | None = None):
    resolved = resolve(model)
    cluster = parse_cluster(gpus)
    workload = Workload(seq_len=seq_len, global_batch=global_batch)
    graph = lower_resolved(resolved)
    space = outer_space(graph, cluster, workload, pins or Pins())
    tables = build_tables(space, Lowerings(Route(resolved=resolved)), cluster, workload, headroom=headroom,
                          deadline=deadline)
    kinds = [layer.kind for layer in graph.decoder_layers()]
    return space, tables, kinds


def test_a_cut_search_returns_its_plan_as_feasible_with_what_it_explored():
    plan = solve(MODEL, "8xA100", seq_len=1024, global_batch=64, time_limit=TINY)
    s = plan.solver
    assert s.status == "FEASIBLE"
    assert s.explored is not None and s.explored < s.configurations
    assert f"{s.explored} of {s.configurations} configurations explored" in s.summary()
    assert "raise --time-limit" in s.summary()


def test_the_whole_space_searched_is_optimal_and_says_nothing_about_the_limit():
    plan = solve(MODEL, "1xA100", seq_len=1024, global_batch=8, time_limit=60)
    assert plan.solver.status == "OPTIMAL"
    assert plan.solver.explored == plan.solver.configurations
    assert "time limit" not in plan.solver.summary()


def test_no_plan_in_time_is_not_infeasibility():
    # 70B on one T4 fits nothing; with a limit that builds one table nothing is proven either way.
    with pytest.raises(NoPlanInTime) as caught:
        solve("meta-llama/Llama-3.1-70B", "1xT4", seq_len=1024, global_batch=8, time_limit=TINY)
    assert not isinstance(caught.value, Infeasible)
    assert caught.value.diagnosis["explored"] < caught.value.diagnosis["configurations"]
    assert "does not mean nothing fits" in caught.value.message


def test_infeasible_only_after_the_whole_space_was_built():
    with pytest.raises(Infeasible) as caught:
        solve("meta-llama/Llama-3.1-70B", "1xT4", seq_len=1024, global_batch=8, time_limit=60)
    assert caught.value.diagnosis["explored"] == caught.value.diagnosis["configurations"]


def test_search_over_part_of_the_space_never_reports_infeasible():
    # Nothing fits either request. Complete -> INFEASIBLE; any part of the space -> UNKNOWN, whether the part has
    # viable tables (CP-SAT proves them infeasible: the 1B case) or none (70B on a T4).
    no_offload = Pins.of(checkpoint=Checkpoint.NONE, offload=Offload.NONE, param_offload=Offload.NONE)
    cases = (("meta-llama/Llama-3.2-1B", "1xL4", no_offload), ("meta-llama/Llama-3.1-70B", "1xT4", None))
    for model, gpus, pins in cases:
        space, tables, kinds = space_and_tables(model, gpus, pins=pins)
        complete = search(tables, kinds, space.modes, time_limit=10, configurations=len(space.outers))
        assert complete.result.status == "INFEASIBLE"
        viable = [t for t in tables if t.states_fit]
        part = viable[:2] if model.endswith("1B") else tables[:3]
        assert bool(viable) == model.endswith("1B")
        cut = search(part, kinds, space.modes, time_limit=10, configurations=len(space.outers))
        assert cut.result.status == "UNKNOWN" and cut.result.table is None


def test_a_partial_search_that_finds_the_true_optimum_still_says_feasible():
    space, tables, kinds = space_and_tables(MODEL, "1xA100")
    full = search(tables, kinds, space.modes, time_limit=30, configurations=len(tables))
    assert full.result.status == "OPTIMAL"
    winner = full.result.table
    partial = search(tables, kinds, space.modes, time_limit=30, configurations=len(tables) + 1)
    assert partial.result.status == "FEASIBLE" and partial.result.table == winner


def test_tables_are_built_leanest_first():
    space, _, _ = space_and_tables(MODEL, "8xA100", global_batch=64)
    order = [space.outers[i] for i in build_order(space.outers)]
    first = order[0]
    assert first.micro_batch == 1 and first.zero == max(o.zero for o in space.outers)
    assert first.param_offload is not Offload.NONE or not any(o.param_offload is not Offload.NONE
                                                               for o in space.outers)
    assert [o.micro_batch for o in order] == sorted(o.micro_batch for o in order)
    # The first table built under the tiniest deadline is that leanest configuration.
    _, tables, _ = space_and_tables(MODEL, "8xA100", global_batch=64, deadline=0.0)
    assert len(tables) == 1 and tables[0].outer == first


def test_equal_step_times_prefer_more_memory_headroom():
    _, tables, _ = space_and_tables(MODEL, "8xA100", global_batch=64)
    ranked = tie_break_ranks(list(reversed(tables)))
    persistent = [t.states.gpu_total + t.states.step_temp for t in ranked]
    assert persistent == sorted(persistent)
    assert [t.rank for t in ranked] == list(range(len(ranked)))


def test_cli_exit_codes_for_a_cut_search():
    runner = CliRunner()
    found = runner.invoke(app, ["solve", "--model", MODEL, "--gpus", "8xA100", "--seq-len", "1024",
                                "--global-batch", "64", "--time-limit", str(TINY)])
    assert found.exit_code == 0, found.output
    text = re.sub(r"[│\s]+", " ", found.output)  # the report wraps inside its box at the console's width
    assert "configurations explored" in text and "raise --time-limit" in text
    none = runner.invoke(app, ["solve", "--model", "meta-llama/Llama-3.1-70B", "--gpus", "1xT4", "--seq-len", "1024",
                               "--global-batch", "8", "--time-limit", str(TINY)])
    assert none.exit_code == 4, none.output
    assert "No plan within the time limit" in none.output and "Nothing fits" not in none.output


@pytest.mark.slow
@pytest.mark.parametrize(("model", "gpus", "options"), [
    ("meta-llama/Llama-3.1-405B", "1024xH100", {"time_limit": 0.5}),
    ("meta-llama/Llama-3.1-70B", "2x8xH100", {"time_limit": 1.0}),
    ("meta-llama/Llama-3.1-70B", "2x8xH100", {"global_batch": 55440}),
])
def test_the_reported_time_limit_cases_plan_instead_of_saying_nothing_fits(model, gpus, options):
    # Each printed "Nothing fits ... try about N GPUs" (exit 3) before: a partial search reported as infeasible.
    try:
        plan = solve(model, gpus, **options)
    except NoPlanInTime:
        return  # allowed: nothing proven, said as such
    assert plan.solver.status in ("OPTIMAL", "FEASIBLE")
    if plan.solver.status == "FEASIBLE":
        assert "raise --time-limit" in plan.solver.summary()


class LoadedClock:
    """perf_counter() of a machine under heavy load: every reading is `step` seconds after the last."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def load_the_search_clock(monkeypatch, step: float = 1000.0) -> None:
    import solver.search.alternatives
    import solver.search.pipeline_search
    import solver.search.solve
    import solver.search.table_search

    clock = LoadedClock(step)
    for module in (solver.search.alternatives, solver.search.pipeline_search, solver.search.solve,
                   solver.search.table_search):
        monkeypatch.setattr(module, "time", clock)


def test_lowering_is_reported_apart_and_never_eats_the_limit(monkeypatch):
    """Issue 38 items 13-14: a slow (cold) lowering once used up the alternatives' share of the limit."""
    import time

    import solver.search.solve as solve_module

    lower_needed = solve_module.lower_needed

    def slow_lowering(prepared):
        time.sleep(2.5)  # longer than the whole limit
        lower_needed(prepared)

    monkeypatch.setattr(solve_module, "lower_needed", slow_lowering)
    # 2 s: the search alone takes ~0.6 s on an idle core here, twice that beside CI's other worker; and a full
    # collection of the earlier tests' objects in this worker is not the search's
    gc.collect()
    plan = solve(MODEL, "8xA100", seq_len=1024, global_batch=64, time_limit=2.0)
    assert plan.solver.lowering_seconds >= 2.5
    assert plan.alternatives  # computed within the limit, which starts after the lowering
    summary = plan.solver.summary()
    assert f"{plan.solver.wall_seconds:.2f} s of search (limit 2 s)" in summary
    assert f"after {plan.solver.lowering_seconds:.2f} s of lowering (outside the limit)" in summary


def test_deterministic_search_gives_the_unhurried_plan_under_any_load(monkeypatch):
    unhurried = solve(MODEL, "8xA100", seq_len=1024, global_batch=64, time_limit=60)
    assert unhurried.solver.status == "OPTIMAL"
    load_the_search_clock(monkeypatch)
    hurried = solve(MODEL, "8xA100", seq_len=1024, global_batch=64, time_limit=60)
    assert hurried.solver.status == "FEASIBLE" and hurried.solver.explored < hurried.solver.configurations
    steady = solve(MODEL, "8xA100", seq_len=1024, global_batch=64, time_limit=60, deterministic=True)
    assert steady.solver.deterministic and not unhurried.solver.deterministic
    assert steady.solver.status == "OPTIMAL" and steady.solver.explored == unhurried.solver.explored
    assert steady.decisions == unhurried.decisions and steady.estimate == unhurried.estimate
    assert [a.decisions for a in steady.alternatives] == [a.decisions for a in unhurried.alternatives]
    assert "deterministic: 60 s of CP-SAT work per model" in steady.solver.summary()


def test_work_budget_runs_cp_sat_on_one_worker_without_a_wall_clock_limit(monkeypatch):
    import solver.search.model as model

    seen = []

    class Spy(model.cp_model.CpSolver):
        def solve(self, *args, **kwargs):
            seen.append((self.parameters.num_workers, self.parameters.max_deterministic_time,
                         self.parameters.max_time_in_seconds))
            return super().solve(*args, **kwargs)

    monkeypatch.setattr(model.cp_model, "CpSolver", Spy)
    space, tables, kinds = space_and_tables(MODEL, "1xA100")
    pm = model.build_model(tables[:1], kinds, space.modes)
    with model.work_budget(3.0):
        model.solve(pm, time_limit=0.5)
    model.solve(pm, time_limit=0.5)
    default = model.cp_model.CpSolver().parameters
    assert seen == [(1, 3.0, default.max_time_in_seconds), (2, default.max_deterministic_time, 0.5)]


def test_cli_deterministic_flag_is_recorded_in_the_plan():
    result = CliRunner().invoke(app, ["solve", "--model", MODEL, "--gpus", "1xA100", "--seq-len", "1024",
                                      "--global-batch", "8", "--deterministic", "--time-limit", "5", "--json"])
    assert result.exit_code == 0, result.output
    import json

    assert json.loads(result.stdout)["solver"]["deterministic"] is True
