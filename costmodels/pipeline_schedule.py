"""Pipeline-parallel schedules as per-rank orders of compute actions, ported from torch.distributed.pipelining.

Each order is what the torch 2.13 runtime executes on one rank (its idle `None` slots dropped: the runtime skips
them and blocks on receives instead). Communication, FSDP unshard and gradient-reduction actions are left out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache


class Schedule(StrEnum):
    """A pipeline schedule that a real runtime offers (the torch class in `TORCH_CLASS`)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"


# torch.distributed.pipelining.schedules class names (torch 2.13); torchtitan's `pipeline_parallel_schedule`
# takes the same names without the "Schedule" prefix (get_schedule_class).
TORCH_CLASS = {
    Schedule.GPIPE: "ScheduleGPipe",
    Schedule.ONE_F_ONE_B: "Schedule1F1B",
    Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    Schedule.INTERLEAVED_ZB: "ScheduleInterleavedZeroBubble",
    Schedule.ZBV: "ScheduleZBVZeroBubble",
}
# One stage per rank (PipelineScheduleSingle); the others take a list of local stages (PipelineScheduleMulti).
SINGLE_STAGE = frozenset({Schedule.GPIPE, Schedule.ONE_F_ONE_B})
# Zero-bubble schedules split the backward into I (input gradient) and W (weight gradient) actions.
SPLIT_BACKWARD = frozenset({Schedule.INTERLEAVED_ZB, Schedule.ZBV})


@dataclass(frozen=True, slots=True)
class Op:
    """One compute action: F (forward), B (full backward), I (input-gradient backward) or W (weight gradient)."""

    kind: str
    stage: int
    micro_batch: int


def schedule_problem(schedule: Schedule, pp: int, m: int, v: int = 1, *, megatron: bool = False) -> str | None:
    """Why torch 2.13 refuses `schedule` with `pp` ranks, `m` micro-batches and `v` stages per rank, or None.
    `megatron`: as megatron-core runs it (Megatron-LM's pipelines), whose 1F1B
    (`forward_backward_pipelining_without_interleaving`) warms up min(pp - rank - 1, m) micro-batches and so also
    runs fewer micro-batches than stages, in the order `_one_f_one_b_ops` gives; its interleaved schedule is held
    to torch's rules."""
    for name, value in (("pp", pp), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r} must be a positive integer"
    if schedule in SINGLE_STAGE and v != 1:
        return f"{schedule} runs one stage per rank, not v={v}"
    if schedule == Schedule.ZBV and v != 2:
        return f"zbv runs exactly two stages per rank (a V), not v={v}"
    # Schedule1F1B.__init__: "Number of microbatches must be greater than or equal to the number of stages".
    if schedule == Schedule.ONE_F_ONE_B and m < pp and not megatron:
        return f"1f1b needs at least as many micro-batches as stages (m={m} < pp={pp})"
    # ScheduleInterleaved1F1B/InterleavedZeroBubble.__init__: m must be a multiple of max(1, m // pp) rounds.
    if schedule in (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZB) and m % max(1, m // pp):
        return f"{schedule} needs m={m} to be a multiple of its {m // pp} rounds (m // pp)"
    return None


def local_stages(schedule: Schedule, v: int = 1) -> int:
    """Stages (model chunks) each rank runs."""
    return 1 if schedule in SINGLE_STAGE else v


def stage_ranks(schedule: Schedule, pp: int, v: int = 1) -> tuple[int, ...]:
    """The rank of each global stage: looped (stage s on rank s mod pp), or a V for zbv (rank r holds stages r
    and 2 pp - 1 - r, so the last stage sits on rank 0: torch `generate_stage_to_rank_mapping(style="v")`)."""
    if schedule == Schedule.ZBV:
        return tuple(range(pp)) + tuple(reversed(range(pp)))
    return tuple(s % pp for s in range(pp * local_stages(schedule, v)))


@lru_cache(maxsize=4096)
def schedule_order(schedule: Schedule, pp: int, m: int, v: int = 1) -> tuple[tuple[Op, ...], ...]:
    """Each rank's compute actions in the order torch 2.13 runs them (megatron-core's 1F1B also where torch
    refuses it: fewer micro-batches than stages)."""
    if (problem := schedule_problem(schedule, pp, m, v, megatron=True)) is not None:
        raise ValueError(problem)
    match schedule:
        case Schedule.GPIPE:
            return tuple(_gpipe_ops(rank, m) for rank in range(pp))
        case Schedule.ONE_F_ONE_B:
            return tuple(_one_f_one_b_ops(rank, pp, m) for rank in range(pp))
        case Schedule.INTERLEAVED_1F1B | Schedule.INTERLEAVED_ZB:
            zero_bubble = schedule == Schedule.INTERLEAVED_ZB
            return tuple(_interleaved_ops(rank, pp, m, v, zero_bubble=zero_bubble) for rank in range(pp))
        case Schedule.ZBV:
            return tuple(_zbv_ops(rank, pp, m) for rank in range(pp))
    raise ValueError(f"unknown schedule {schedule!r}")


def _gpipe_ops(rank: int, m: int) -> tuple[Op, ...]:
    """ScheduleGPipe._step_microbatches: every forward, then every backward in micro-batch order."""
    return tuple(Op("F", rank, j) for j in range(m)) + tuple(Op("B", rank, j) for j in range(m))


def _one_f_one_b_ops(rank: int, pp: int, m: int) -> tuple[Op, ...]:
    """Schedule1F1B._step_microbatches: min(m, pp - rank) warm-up forwards, then B/F pairs, then the rest of B.
    (Its `_get_pipeline_order` IR numbers the last rank's forwards from 1 in torch 2.13; the runtime does not.)"""
    warmup = min(m, pp - rank)
    ops = [Op("F", rank, j) for j in range(warmup)]
    for j in range(m):
        ops.append(Op("B", rank, j))
        if warmup + j < m:
            ops.append(Op("F", rank, warmup + j))
    return tuple(ops)


def interleaved_warmup(rank: int, pp: int, m: int, v: int, *, factor: int) -> int:
    """Warm-up forwards of rank `rank` (torch `_get_warmup_ops`; Megatron's interleaved schedule uses the same
    (v - 1) pp + 2 (pp - 1 - rank) when pp divides m): `factor` is 2 for interleaved 1F1B, 1 for zero bubble."""
    per_round = m // max(1, m // pp)
    return min((v - 1) * per_round + factor * (pp - 1 - rank), m * v)


def _interleaved_ops(rank: int, pp: int, m: int, v: int, *, zero_bubble: bool) -> tuple[Op, ...]:
    """torch `_get_1f1b_rank_ops` for ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble (ZB1P: W of a
    backward is deferred by `rank` steps into the 1F1B phase and the cool-down)."""
    per_round = m // max(1, m // pp)
    warmup = interleaved_warmup(rank, pp, m, v, factor=1 if zero_bubble else 2)
    steps = m * v + warmup  # warm-up, then m v - warmup F/B steps, then a cool-down of `warmup` backwards
    count: dict[tuple[str, int], int] = defaultdict(int)
    ops: list[Op] = []

    def add(kind: str, stage: int) -> None:
        ops.append(Op(kind, stage, count[kind, stage]))
        count[kind, stage] += 1

    backward_stages: list[int] = []
    weights = 0
    for step in range(steps):
        if step < m * v:
            add("F", ((step // per_round) % v) * pp + rank)
        if step >= warmup:
            backward_stages.append(_interleaved_backward_stage(step - warmup, rank, pp, v, per_round))
            add("I" if zero_bubble else "B", backward_stages[-1])
            if zero_bubble and step - warmup >= rank:
                add("W", backward_stages[weights])
                weights += 1
    for stage in backward_stages[weights:] if zero_bubble else ():
        add("W", stage)
    return tuple(ops)


def _interleaved_backward_stage(k: int, rank: int, pp: int, v: int, per_round: int) -> int:
    """Stage of the k-th backward of a rank: the local chunks in reverse, `per_round` micro-batches each."""
    return (v - 1 - (k // per_round) % v) * pp + rank


def _zbv_ops(rank: int, pp: int, m: int) -> tuple[Op, ...]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations (ZB-V, Qi et al. 2024 section 6): built for
    max(2 pp - 1, m) micro-batches, then the actions of micro-batches >= m are dropped."""
    n = max(2 * pp - 1, m)
    chunk0, chunk1 = rank, 2 * pp - 1 - rank
    count: dict[tuple[str, int], int] = defaultdict(int)
    ops: list[Op] = []

    def add(kind: str, stage: int) -> None:
        ops.append(Op(kind, stage, count[kind, stage]))
        count[kind, stage] += 1

    for _ in range(2 * (pp - rank) - 1):
        add("F", chunk0)
    for _ in range(rank):
        add("F", chunk1)
        add("F", chunk0)
    for _ in range(pp - rank):
        add("F", chunk1)
        add("I", chunk1)
        add("W", chunk1)
    while count["F", chunk1] < count["F", chunk0] or count["F", chunk0] < n:
        if count["F", chunk0] < n:
            add("F", chunk0)
        add("I", chunk0)
        add("W", chunk0)
        add("F", chunk1)
        add("I", chunk1)
        add("W", chunk1)
    for _ in range(rank):
        add("I", chunk0)
        add("I", chunk1)
    for _ in range(pp - rank):
        add("I", chunk0)
        add("W", chunk0)
    while count["W", chunk1] < count["I", chunk1]:
        add("W", chunk1)
    while count["W", chunk0] < count["I", chunk0]:
        add("W", chunk0)
    return tuple(op for op in ops if op.micro_batch < m)
