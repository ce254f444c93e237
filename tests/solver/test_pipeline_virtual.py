"""Stages per rank of the interleaved schedules: `solve` against brute force over every schedule and count of
stages per rank torch runs, each priced alone by `estimate` (issue 37, deep pipelines priced too slow)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodels import Engine
from costmodels.pipeline_schedule import Schedule, schedule_problem
from solver import estimate, solve
from solver.search.pins import KNOBS, Pins
from solver.search.space import virtual_stages

# Llama-3.1-70B (80 layers) over 16 pipeline ranks of one 8-GPU tensor-parallel node each, 64 micro-batches per
# step, on Megatron with every layer recomputed: only the schedule and its stages per rank are left open.
MODEL, GPUS = "meta-llama/Llama-3.1-70B", "128xH100"
PINS = dict(tp=8, pp=16, cp=1, engine="megatron", zero=1, micro_batch=1, checkpoint="full", sequence_parallel=True,
            precision=("bf16-mixed",), optimizers=("adamw",), offload="none", compile="off", launcher="megatron")
SHAPE = dict(seq_len=4096, global_batch=64)


@pytest.fixture(scope="module")
def plan():
    return solve(MODEL, GPUS, time_limit=120, deterministic=True, **SHAPE, **PINS)


def every_schedule(plan) -> dict[tuple[Schedule, int], float]:
    """Step seconds of the plan's configuration at every (schedule, stages per rank) Megatron runs, each with the
    split `estimate` balances (the plan's modes: every layer recomputed)."""
    d = plan.decisions
    priced = {}
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B):
        # two stages per rank (any split), and every count whose stages hold equal layers (Megatron's rule)
        counts = (1,) if schedule is Schedule.ONE_F_ONE_B else (2, *(v for v in range(3, 81) if 80 % (d.pp * v) == 0))
        for v in counts:
            if schedule_problem(schedule, d.pp, d.grad_accum, v) is not None:
                continue
            config = replace(d, pp_schedule=schedule, pp_virtual=v, pp_split=())
            fields = {name: getattr(config, name) for name in KNOBS}
            priced[schedule, v] = estimate(MODEL, GPUS, fields, **SHAPE).time.step_time
    return priced


def test_deep_pipeline_solve_picks_the_cheapest_count_of_stages_per_rank(plan):
    """The search offered two stages per rank only; at 16 ranks five (a layer per stage) run faster (the bubble
    shrinks by v for v times the point-to-point hops), and the plan must be the cheapest of every count priced
    alone."""
    priced = every_schedule(plan)
    assert len(priced) == 3  # 1F1B, and interleaved with 2 or 5 stages per rank (80 layers over 16 ranks)
    cheapest = min(priced, key=priced.get)
    d = plan.decisions
    assert (d.pp_schedule, d.pp_virtual) == cheapest
    assert plan.estimate.time.step_time == pytest.approx(priced[cheapest], abs=2e-6)
    assert cheapest[1] > 2  # the case shows the defect: more than the two stages per rank the search offered


def test_every_count_of_stages_per_rank_is_open_unless_pinned():
    pins, fsdp2 = Pins.of(), Engine.FSDP2
    assert virtual_stages(Schedule.INTERLEAVED_1F1B, 16, 64, 80, pins, fsdp2) == (2, 5)
    assert virtual_stages(Schedule.INTERLEAVED_1F1B, 4, 64, 80, pins, fsdp2) == (2, 4, 5, 10, 20)
    assert virtual_stages(Schedule.INTERLEAVED_ZB, 4, 8, 16, pins, fsdp2) == (2, 4)
    assert virtual_stages(Schedule.INTERLEAVED_1F1B, 32, 256, 126, pins, fsdp2) == (2,)  # 405B: 126 layers
    assert virtual_stages(Schedule.ZBV, 16, 64, 80, pins, fsdp2) == (2,)
    assert virtual_stages(Schedule.ONE_F_ONE_B, 16, 64, 80, pins, fsdp2) == (1,)
    assert virtual_stages(Schedule.INTERLEAVED_1F1B, 16, 64, 80, Pins.of(pp_virtual=3), fsdp2) == (3,)
    # torch's interleaved schedules run m in rounds of m // pp: 9 micro-batches do not divide into 2 rounds
    assert virtual_stages(Schedule.INTERLEAVED_1F1B, 4, 9, 16, pins, fsdp2) == ()
    # torch's 1F1B needs as many micro-batches as stages; megatron-core's runs fewer (warm-up min(pp - rank - 1, m))
    assert virtual_stages(Schedule.ONE_F_ONE_B, 4, 2, 16, pins, fsdp2) == ()
    assert virtual_stages(Schedule.ONE_F_ONE_B, 4, 2, 16, pins, Engine.MEGATRON) == (1,)
