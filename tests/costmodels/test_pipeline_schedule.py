"""Pipeline schedules against torch.distributed.pipelining itself: the action orders, the in-flight micro-batches
and the refusals of the real schedule classes (built on recording stand-in stages, no process group), and the
simulated step time against a critical-path reference over torch's own orders."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from costmodels import Config, Engine
from costmodels.pipeline import (
    DEFAULT_WEIGHT_SHARE,
    StageActivations,
    StageTimes,
    boundaries_crossing_nodes,
    held_activation_bytes,
    in_flight_micro_batches,
    op_seconds,
    p2p_activation_bytes,
    pipeline_time,
    rank_moments,
    sets_in_flight,
    step_lower_bound,
)
from costmodels.pipeline_schedule import (
    SINGLE_STAGE,
    TORCH_CLASS,
    Op,
    Schedule,
    local_stages,
    schedule_order,
    schedule_problem,
    stage_ranks,
)

GRID = [(schedule, pp, m, v) for schedule in Schedule for pp in range(2, 5) for m in range(1, 9) for v in (1, 2)
        if not (schedule in SINGLE_STAGE and v != 1)]
# Deep pipelines as large runs use them (issue 37: pp 8 and 16, up to 4 stages per rank), with micro-batch counts
# below, at and around multiples of pp (torch's interleaved rounds are m // pp).
DEEP = [(schedule, pp, m, v) for schedule in Schedule for pp in (5, 8, 16)
        for v in ((1,) if schedule in SINGLE_STAGE else (2,) if schedule is Schedule.ZBV else (2, 3, 4))
        for m in sorted({pp - 1, pp, pp + 3, 2 * pp, 3 * pp}) if schedule_problem(schedule, pp, m, v) is None]


class RecordingStage:
    """Just enough of a torch `_PipelineStageBase` for a schedule's constructor and `_step_microbatches`: no
    peers to talk to (empty p2p op lists) and compute calls recorded instead of run."""

    def __init__(self, index: int, stages: int, pp: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, pp, index % pp
        self.is_first, self.is_last = index == 0, False
        self.submod, self.has_backward, self.stage_index_to_group_rank = None, True, {}
        self.log: list[Op] = []

    def get_fwd_recv_ops(self, chunk: int) -> list:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, chunk: int, *args, **kwargs) -> None:
        self.log.append(Op("F", self.stage_index, chunk))

    def backward_one_chunk(self, chunk: int, **kwargs) -> None:
        self.log.append(Op("B", self.stage_index, chunk))

    def perform_reduce_grad(self, scale: int) -> None:
        pass


def torch_schedule(schedule: Schedule, pp: int, m: int, v: int, rank: int = 0):
    """The real torch schedule object for `rank` (its constructor builds every rank's order)."""
    cls = getattr(torch_schedules, TORCH_CLASS[schedule])
    if schedule in SINGLE_STAGE:
        return cls(RecordingStage(rank, pp, pp), m, loss_fn=lambda out, target: out)
    stages = [RecordingStage(rank + k * pp, pp * v, pp) for k in range(v)]
    return cls(stages, m, loss_fn=lambda out, target: out)


def torch_order(schedule: Schedule, pp: int, m: int, v: int) -> tuple[tuple[Op, ...], ...]:
    """What torch runs on each rank: `_step_microbatches` with recording stages for the single-stage schedules
    (their `pipeline_order` IR is not what runs), the `pipeline_order` the runtime executes for the others."""
    if schedule in SINGLE_STAGE:
        orders = []
        for rank in range(pp):
            sched = torch_schedule(schedule, pp, m, v, rank)
            sched._initialize_stage = lambda *args, **kwargs: None
            sched._step_microbatches([()] * m, [{}] * m)
            orders.append(tuple(sched._stage.log))
        return tuple(orders)
    ir = torch_schedule(schedule, pp, m, v).pipeline_order
    return tuple(tuple(Op(a.computation_type.value, a.stage_index, a.microbatch_index) for a in ir[rank]
                       if a is not None and a.is_compute_op) for rank in range(pp))


def replay(ops: tuple[Op, ...], held: list[int], early: list[int]):
    """Torch's order on one rank, action by action: (the action, what the other in-flight micro-batches hold as
    it starts, what every one holds after it). A forward keeps its stage's `held`, I frees the `early` part of it
    and B or W the rest."""
    live: dict[tuple[int, int], int] = {}
    for op in ops:
        key = (op.stage, op.micro_batch)
        others = sum(v for k, v in live.items() if k != key)
        if op.kind == "F":
            live[key] = held[op.stage]
        elif op.kind == "I":
            live[key] -= early[op.stage]
        else:
            del live[key]
        yield op, others, sum(live.values())


def counted_peaks(order: tuple[tuple[Op, ...], ...], weights: list[int],
                  early: list[int] | None = None) -> tuple[int, ...]:
    """Reference peak per rank: the most held after any action (`replay`)."""
    early = early or [0] * len(weights)
    return tuple(max((after for _, _, after in replay(ops, weights, early)), default=0) for ops in order)


def torch_refuses(schedule: Schedule, pp: int, m: int, v: int) -> bool:
    try:
        torch_schedule(schedule, pp, m, v)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), GRID, ids=str)
def test_schedule_problem_matches_torch_constructor_refusals(schedule, pp, m, v):
    assert (schedule_problem(schedule, pp, m, v) is not None) == torch_refuses(schedule, pp, m, v)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_schedule_order_equals_torch_runtime_order(schedule):
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        assert schedule_order(schedule, pp, m, v) == torch_order(schedule, pp, m, v), (pp, m, v)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_in_flight_closed_forms_equal_counts_over_torch_order(schedule):
    """1F1B min(pp - i, m), GPipe m, interleaved and zero-bubble warm-ups, against the real torch order."""
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        ones = [1] * len(stage_ranks(schedule, pp, v))
        assert in_flight_micro_batches(schedule, pp, m, v=v) == counted_peaks(torch_order(schedule, pp, m, v), ones)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_deep_pipelines_run_torchs_order_and_hold_its_in_flight_counts(schedule):
    """At pp 5, 8 and 16 with 2-4 stages per rank: the ported order is torch's, and each rank's most micro-batch
    chunk sets in flight (what the first rank's warm-up holds under interleaving) are counted over torch's order."""
    for _, pp, m, v in [case for case in DEEP if case[0] == schedule]:
        order = torch_order(schedule, pp, m, v)
        assert schedule_order(schedule, pp, m, v) == order, (pp, m, v)
        ones = [1] * len(stage_ranks(schedule, pp, v))
        counted = counted_peaks(order, ones)
        assert in_flight_micro_batches(schedule, pp, m, v=v) == counted, (pp, m, v)
        assert tuple(sets_in_flight(a) for a in rank_moments(schedule, pp, m, v=v)) == counted, (pp, m, v)


def test_one_f_one_b_in_flight_is_min_of_pp_minus_rank_and_m():
    assert in_flight_micro_batches(Schedule.ONE_F_ONE_B, 4, 8) == (4, 3, 2, 1)
    assert in_flight_micro_batches(Schedule.ONE_F_ONE_B, 4, 4) == (4, 3, 2, 1)
    assert in_flight_micro_batches(Schedule.GPIPE, 4, 3) == (3, 3, 3, 3)


def test_interleaved_rank0_holds_megatron_factor_over_one_f_one_b():
    """Megatron (Narayanan et al. 2021): rank 0 holds pp (1 + (pp - 1) / (pp v)) micro-batches' activations,
    in chunks of 1/v of them: pp v + pp - 1 chunk sets when pp divides m and m >= 2 pp (below that the m v
    sets of a step cap it)."""
    for pp, v, rounds in itertools.product((2, 4, 8), (2, 3, 4), (2, 3)):
        assert in_flight_micro_batches(Schedule.INTERLEAVED_1F1B, pp, pp * rounds, v=v)[0] == pp * v + pp - 1


@pytest.mark.parametrize("schedule", list(Schedule))
def test_held_bytes_with_uneven_stages_equal_weighted_counts_over_torch_order(schedule):
    rng = random.Random(13)
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        weights = [rng.randint(1, 10**9) for _ in stage_ranks(schedule, pp, v)]
        stages = [StageActivations(saved=w) for w in weights]
        assert held_activation_bytes(schedule, pp, m, v=v, stages=stages) == \
            counted_peaks(torch_order(schedule, pp, m, v), weights)


@pytest.mark.parametrize("schedule", [Schedule.INTERLEAVED_ZB, Schedule.ZBV])
def test_held_bytes_with_loss_freed_at_input_step_equal_counts_over_torch_order(schedule):
    rng = random.Random(17)
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        weights = [rng.randint(1, 10**6) for _ in stage_ranks(schedule, pp, v)]
        early = [rng.randint(0, w) for w in weights]
        stages = [StageActivations(saved=w, freed_by_input=e) for w, e in zip(weights, early, strict=True)]
        assert held_activation_bytes(schedule, pp, m, v=v, stages=stages) == \
            counted_peaks(torch_order(schedule, pp, m, v), weights, early)


def busiest_moments(order: tuple[tuple[Op, ...], ...], held: list[int], early: list[int], running: dict[bool, list[int]]
                    ) -> tuple[int, ...]:
    """Reference per rank: over every action of torch's order, what the other in-flight micro-batches hold as it
    starts (`replay`) plus the running stage's own bytes for a forward or a backward action (`running[True]`,
    `running[False]`)."""
    return tuple(max(others + running[op.kind == "F"][op.stage] for op, others, _ in replay(ops, held, early))
                 for ops in order)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_rank_moments_hold_the_peak_of_any_stage_bytes_over_torch_order(schedule):
    """The moments the memory model composes (dominated ones dropped) give the same peak as every action of the
    real order, for any per-stage bytes: kept after a forward, freed by an input step, and the running
    micro-batch's own forward and backward peaks."""
    rng = random.Random(19)
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        ranks = stage_ranks(schedule, pp, v)
        for _ in range(3):
            held = [rng.randint(0, 10**6) for _ in ranks]
            early = [rng.randint(0, h) for h in held]
            running = {True: [rng.randint(0, 10**6) for _ in ranks], False: [rng.randint(0, 10**6) for _ in ranks]}
            expected = busiest_moments(torch_order(schedule, pp, m, v), held, early, running)
            for rank, moments in enumerate(rank_moments(schedule, pp, m, v=v)):
                mine = [s for s, r in enumerate(ranks) if r == rank]
                value = max(running[a.forward][mine[a.stage]] + sum(
                    f * held[s] + c * (held[s] - early[s]) for s, f, c in zip(mine, a.full, a.after_input,
                                                                             strict=True)) for a in moments)
                assert value == expected[rank], (schedule, pp, m, v, rank)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_sets_in_flight_of_the_moments_equal_the_closed_forms(schedule):
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        assert tuple(sets_in_flight(a) for a in rank_moments(schedule, pp, m, v=v)) == \
            in_flight_micro_batches(schedule, pp, m, v=v)


def test_stage_ranks_equal_torch_stage_to_rank_mapping():
    for schedule, pp, v in itertools.product(Schedule, range(1, 5), (1, 2, 3)):
        if schedule_problem(schedule, pp, pp, v) is None:
            style = "v" if schedule == Schedule.ZBV else "loop"
            mapping = generate_stage_to_rank_mapping(pp, pp * local_stages(schedule, v), style=style)
            assert stage_ranks(schedule, pp, v) == tuple(mapping[s] for s in range(len(mapping)))


def test_held_bytes_needs_one_entry_per_stage():
    with pytest.raises(ValueError, match="4 stages"):
        held_activation_bytes(Schedule.INTERLEAVED_1F1B, 2, 4, v=2, stages=[StageActivations(saved=1)] * 2)
    with pytest.raises(ValueError, match="freed_by_input <= saved"):
        StageActivations(saved=1, freed_by_input=2)


def test_refusals_name_the_rule():
    assert "at least as many micro-batches" in schedule_problem(Schedule.ONE_F_ONE_B, 4, 2)
    # megatron-core's 1F1B warms up min(pp - rank - 1, m) micro-batches: it runs m < pp (torch's refuses), so the
    # orders cover it and each runtime's refusal is the configuration's (`Config`)
    assert schedule_problem(Schedule.ONE_F_ONE_B, 4, 2, megatron=True) is None
    assert in_flight_micro_batches(Schedule.ONE_F_ONE_B, 4, 2) == (2, 2, 2, 1)
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        Config(engine=Engine.FSDP2, zero=2, pp=4, pp_schedule=Schedule.ONE_F_ONE_B, grad_accum=2)
    assert Config(engine=Engine.MEGATRON, pp=4, pp_schedule=Schedule.ONE_F_ONE_B, grad_accum=2).grad_accum == 2
    assert "two stages per rank" in schedule_problem(Schedule.ZBV, 2, 4, 3)
    assert "one stage per rank" in schedule_problem(Schedule.GPIPE, 2, 4, 2)
    assert "positive integer" in schedule_problem(Schedule.GPIPE, 0, 4)


# --- step time ---------------------------------------------------------------------------------------------------


def critical_path_seconds(schedule: Schedule, pp: int, m: int, v: int, times: StageTimes) -> float:
    """Reference step time: the longest path through torch's actions, with an edge from each action to the next
    on its rank and from each producer to its consumer (plus the p2p hop when they sit on different ranks)."""
    order = torch_order(schedule, pp, m, v)
    ranks = stage_ranks(schedule, pp, v)
    last = len(ranks) - 1
    graph = nx.DiGraph()
    producer = {}
    for ops in order:
        for op in ops:
            key = ("G" if op.kind in "BI" else op.kind, op.stage, op.micro_batch)
            producer[key] = op
            graph.add_edge(("start",), op, weight=0.0)
            graph.add_edge(op, ("end",), weight=op_seconds(op, times))
        for before, after in itertools.pairwise(ops):
            graph.add_edge(before, after, weight=op_seconds(before, times))

    def hop(boundary: int) -> float:
        return times.p2p[boundary] if times.p2p and ranks[boundary] != ranks[boundary + 1] else 0.0

    for ops in order:
        for op in ops:
            s, j = op.stage, op.micro_batch
            if op.kind == "F" and s > 0:
                source, extra = producer["F", s - 1, j], hop(s - 1)
            elif op.kind in "BI" and s < last:
                source, extra = producer["G", s + 1, j], hop(s)
            else:
                continue
            graph.add_edge(source, op, weight=op_seconds(source, times) + extra)
    return nx.dag_longest_path_length(graph)


def random_times(rng: random.Random, stages: int, *, p2p: bool) -> StageTimes:
    forward = tuple(rng.uniform(0.5, 2.0) for _ in range(stages))
    backward = tuple(f * rng.uniform(1.5, 3.0) for f in forward)
    weight = tuple(b * rng.uniform(0.3, 0.6) for b in backward)
    return StageTimes(forward=forward, backward=backward, weight=weight,
                      p2p=tuple(rng.uniform(0.0, 0.3) for _ in range(stages - 1)) if p2p else ())


@pytest.mark.parametrize("schedule", list(Schedule))
def test_step_time_with_uneven_stages_equals_critical_path_of_torch_order(schedule):
    rng = random.Random(7)
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        times = random_times(rng, len(stage_ranks(schedule, pp, v)), p2p=rng.random() < 0.5)
        # Tolerance: the two sum the same floats in different orders.
        assert pipeline_time(schedule, pp, m, v=v, times=times).step == \
            pytest.approx(critical_path_seconds(schedule, pp, m, v, times), rel=1e-12), (pp, m, v)


@pytest.mark.parametrize("schedule", list(Schedule))
def test_deep_pipeline_step_equals_critical_path_of_torch_order(schedule):
    """The bubble of pp 5, 8 and 16 pipelines with 2-4 stages per rank and p2p hops, as torch's order runs them."""
    rng = random.Random(23)
    for _, pp, m, v in [case for case in DEEP if case[0] == schedule]:
        times = random_times(rng, len(stage_ranks(schedule, pp, v)), p2p=True)
        # Tolerance: the two sum the same floats in different orders.
        assert pipeline_time(schedule, pp, m, v=v, times=times).step == \
            pytest.approx(critical_path_seconds(schedule, pp, m, v, times), rel=1e-12), (pp, m, v)


@pytest.mark.parametrize(("schedule", "pp", "m"), [(s, pp, m) for s in (Schedule.ONE_F_ONE_B, Schedule.GPIPE)
                                                   for pp in (2, 3, 4, 8) for m in (8, 9, 16, 32)])
def test_equal_stages_bubble_fraction_is_pp_minus_1_over_m_plus_pp_minus_1(schedule, pp, m):
    """GPipe and 1F1B with equal stages: step (m + pp - 1)(f + b), idle share (pp - 1) / (m + pp - 1)
    (Narayanan et al. 2021, section 2.2)."""
    f, b = 1.25, 2.5
    result = pipeline_time(schedule, pp, m, times=StageTimes(forward=(f,) * pp, backward=(b,) * pp))
    assert result.step == pytest.approx((m + pp - 1) * (f + b), rel=1e-12)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    assert result.bubble == pytest.approx((pp - 1) * (f + b), rel=1e-12)


@pytest.mark.parametrize(("pp", "v", "rounds"), list(itertools.product((2, 4, 8, 16), (2, 3, 4), (1, 2))))
def test_interleaved_equal_stages_bubble_shrinks_by_v(pp, v, rounds):
    """Interleaved 1F1B, chunks of 1/v of a rank's layers, pp dividing m: bubble (pp - 1)(f + b) / v
    (Narayanan et al. 2021, section 2.2.1)."""
    f, b, m = 1.0, 2.0, pp * rounds
    times = StageTimes(forward=(f / v,) * (pp * v), backward=(b / v,) * (pp * v))
    result = pipeline_time(Schedule.INTERLEAVED_1F1B, pp, m, v=v, times=times)
    assert result.bubble == pytest.approx((pp - 1) * (f + b) / v, rel=1e-12)


def test_zero_bubble_beats_one_f_one_b_at_equal_stages():
    """ZB-V and interleaved zero bubble fill the 1F1B bubble with weight-gradient work (Qi et al. 2024)."""
    pp, m, f, b = 4, 16, 1.0, 2.0
    base = pipeline_time(Schedule.ONE_F_ONE_B, pp, m, times=StageTimes(forward=(f,) * pp, backward=(b,) * pp))
    half = StageTimes(forward=(f / 2,) * (2 * pp), backward=(b / 2,) * (2 * pp))
    for schedule in (Schedule.ZBV, Schedule.INTERLEAVED_ZB):
        assert pipeline_time(schedule, pp, m, v=2, times=half).bubble < base.bubble / 2


def test_heavy_last_stage_stretches_the_step_beyond_the_flat_bubble():
    pp, m = 4, 8
    even = pipeline_time(Schedule.ONE_F_ONE_B, pp, m, times=StageTimes(forward=(1.0,) * 4, backward=(2.0,) * 4))
    heavy = pipeline_time(Schedule.ONE_F_ONE_B, pp, m,
                          times=StageTimes(forward=(1.0, 1.0, 1.0, 1.5), backward=(2.0, 2.0, 2.0, 3.0)))
    # The slowest stage sets the steady state: at least m (f + b) of it plus the others' fill and drain.
    assert heavy.step >= m * 4.5 + 3 * 3.0
    assert heavy.step > even.step + m * 1.5 - 1e-9


@pytest.mark.parametrize("schedule", list(Schedule))
def test_step_lower_bound_never_exceeds_the_simulated_step(schedule):
    rng = random.Random(11)
    for _, pp, m, v in [case for case in GRID if case[0] == schedule and schedule_problem(*case) is None]:
        times = random_times(rng, len(stage_ranks(schedule, pp, v)), p2p=rng.random() < 0.5)
        # Tolerance: the two sum the same floats in different orders.
        assert step_lower_bound(schedule, pp, m, v=v, times=times) <= \
            pipeline_time(schedule, pp, m, v=v, times=times).step * (1 + 1e-12)


def test_gpipe_step_is_the_two_flow_shops_and_one_f_one_b_lies_between_its_bounds():
    """Without p2p, GPipe is a forward then a backward flow shop, each sum + (m - 1) max of its stage times; 1F1B
    lies between the lower bound and sum(f + b) + (m - 1) max(f + b), equal for equal stages."""
    rng = random.Random(19)
    for _ in range(200):
        pp = rng.randint(2, 6)
        m = rng.randint(pp, 16)
        times = random_times(rng, pp, p2p=False)
        f, b = times.forward, times.backward
        gpipe = sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
        assert pipeline_time(Schedule.GPIPE, pp, m, times=times).step == pytest.approx(gpipe, rel=1e-12)
        one_f_one_b = pipeline_time(Schedule.ONE_F_ONE_B, pp, m, times=times).step
        upper = sum(f) + sum(b) + (m - 1) * max(x + y for x, y in zip(f, b, strict=True))
        assert step_lower_bound(Schedule.ONE_F_ONE_B, pp, m, times=times) <= one_f_one_b * (1 + 1e-12)
        assert one_f_one_b <= upper * (1 + 1e-12)
    even = StageTimes(forward=(1.0,) * 4, backward=(2.0,) * 4)
    assert step_lower_bound(Schedule.ONE_F_ONE_B, 4, 8, times=even) == pipeline_time(Schedule.ONE_F_ONE_B, 4, 8,
                                                                                     times=even).step == 33.0


def test_weight_share_default_is_half_of_backward():
    times = StageTimes(forward=(1.0, 1.0), backward=(4.0, 4.0))
    assert op_seconds(Op("W", 1, 0), times) == DEFAULT_WEIGHT_SHARE * 4.0
    assert op_seconds(Op("I", 1, 0), times) == 4.0 - DEFAULT_WEIGHT_SHARE * 4.0
    # torch's first stage computes no input gradient: its W is the whole backward.
    assert (op_seconds(Op("I", 0, 0), times), op_seconds(Op("W", 0, 0), times)) == (0.0, 4.0)


def test_stage_times_refuse_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per stage"):
        StageTimes(forward=(1.0, 1.0), backward=(1.0,))
    with pytest.raises(ValueError, match="boundary"):
        StageTimes(forward=(1.0, 1.0), backward=(1.0, 1.0), p2p=(0.1, 0.1))
    with pytest.raises(ValueError, match="stages"):
        pipeline_time(Schedule.ONE_F_ONE_B, 4, 8, times=StageTimes(forward=(1.0,) * 2, backward=(1.0,) * 2))


# --- point-to-point ----------------------------------------------------------------------------------------------


def test_p2p_bytes_follow_megatron_tensor_shape():
    """[seq / cp (/ tp with sequence parallelism), micro_batch, hidden] in the p2p dtype."""
    assert p2p_activation_bytes(micro_batch=2, seq_len=4096, hidden=8192, dtype_bytes=2) == 2 * 4096 * 8192 * 2
    assert p2p_activation_bytes(micro_batch=1, seq_len=4096, hidden=8192, dtype_bytes=2, tp=8,
                                sequence_parallel=True, cp=2) == 4096 // 2 // 8 * 8192 * 2
    assert p2p_activation_bytes(micro_batch=1, seq_len=4096, hidden=8192, dtype_bytes=2, tp=8) == 4096 * 8192 * 2


def test_boundaries_cross_nodes_where_pipeline_ranks_change_node():
    # 4 GPUs per pipeline rank, 8 per node: ranks 0-1 on node 0, 2-3 on node 1.
    assert boundaries_crossing_nodes(Schedule.ONE_F_ONE_B, 4, gpus_per_rank=4, gpus_per_node=8) == (False, True, False)
    # Interleaved loops back from rank 3 to rank 0 between chunks.
    assert boundaries_crossing_nodes(Schedule.INTERLEAVED_1F1B, 2, v=2, gpus_per_rank=8, gpus_per_node=8) == \
        (True, True, True)
    # The V's turn stays on the last rank.
    assert boundaries_crossing_nodes(Schedule.ZBV, 2, v=2, gpus_per_rank=8, gpus_per_node=8) == (True, False, True)


def test_local_stages_per_schedule():
    assert [local_stages(s, 2) for s in Schedule] == [1, 1, 2, 2, 2]


def test_torch_schedule_names_resolve_through_get_schedule_class():
    """torchtitan's `pipeline_parallel_schedule` goes through torch's get_schedule_class: the class name less
    its "Schedule" prefix must name the same class."""
    for schedule in Schedule:
        name = TORCH_CLASS[schedule].removeprefix("Schedule")
        assert torch_schedules.get_schedule_class(name) is getattr(torch_schedules, TORCH_CLASS[schedule])
