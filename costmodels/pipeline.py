"""Pipeline parallelism's costs: the activations each rank holds at its peak (receive buffers and in-flight
micro-batches), and the step time of a schedule with uneven stages, bubble included, simulated over the real
action order of `pipeline_schedule`. Weights, gradients and optimizer states of a stage are left to the engines.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .cluster import Cluster
from .collectives import INTER_NODE_LATENCY, INTRA_NODE_LATENCY, LINK_EFFICIENCY
from .pipeline_schedule import (
    SPLIT_BACKWARD,
    Op,
    Schedule,
    interleaved_warmup,
    schedule_order,
    schedule_problem,
    stage_ranks,
)


def in_flight_micro_batches(schedule: Schedule, pp: int, m: int, *, v: int = 1) -> tuple[int, ...]:
    """Per rank i, the most (stage, micro-batch) activation sets held at once (each set one of the rank's chunks
    when it runs several): closed forms of the torch 2.13 orders, checked against them in the tests."""
    if (problem := schedule_problem(schedule, pp, m, v, megatron=True)) is not None:
        raise ValueError(problem)
    match schedule:
        case Schedule.GPIPE:
            return (m,) * pp
        case Schedule.ONE_F_ONE_B:
            # Warm-up of pp - i forwards before the first backward (Narayanan et al. 2021, section 2.2).
            return tuple(min(pp - i, m) for i in range(pp))
        case Schedule.INTERLEAVED_1F1B:
            # Warm-up forwards, then one more forward before each backward of the steady phase.
            return tuple(min(interleaved_warmup(i, pp, m, v, factor=2) + 1, m * v) for i in range(pp))
        case Schedule.INTERLEAVED_ZB:
            # ZB1P: warm-up with one hop per rank, and rank i defers its first i weight steps (which free).
            return tuple(min(interleaved_warmup(i, pp, m, v, factor=1) + 1 + i, m * v) for i in range(pp))
        case Schedule.ZBV:
            # ZB-V holds pp micro-batches' worth, 2 pp half-stage sets, once m >= 2 pp - 1 (Qi et al. 2024, s. 6).
            return tuple(min(m + 1 + i, 2 * pp, 2 * m) for i in range(pp))
    raise ValueError(f"unknown schedule {schedule!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageActivations:
    """Bytes one micro-batch of one global stage holds, split by how torch.distributed.pipelining keeps them."""

    saved: int
    """Autograd-saved bytes, less the received stage input: a layer that saves its input saves the receive
    buffer, which `receive_buffer_bytes` counts."""
    output: int = 0
    """The stage output (hidden states; the model output on the last stage): `fwd_cache` keeps it until the
    backward, and the next stage receives it into a buffer of the same size."""
    freed_by_input: int = 0
    """The part of `saved` a zero-bubble input step (I) frees: what only nodes after the stage's last weight
    saved (the loss on the last stage), since `stage_backward_input` detaches the stage output and keeps the
    rest of the graph for W (retain_graph=True)."""

    def __post_init__(self) -> None:
        if not 0 <= self.freed_by_input <= self.saved or self.output < 0:
            raise ValueError(f"stage bytes must be non-negative with freed_by_input <= saved: {self}")


def held_activation_bytes(schedule: Schedule, pp: int, m: int, *, v: int = 1,
                          stages: Sequence[StageActivations]) -> tuple[int, ...]:
    """Per rank, the peak bytes of in-flight activations over one step, in torch's action order. F adds a
    stage's saved bytes and output; B frees both; I frees `freed_by_input` (and the last stage's output, which
    it no longer keeps) and W the rest (`backward_state` keeps other stages' outputs until W). On a same-rank
    boundary (the turn of a V) the next stage's forward takes the output over as its receive buffer."""
    ranks = stage_ranks(schedule, pp, v)
    if len(stages) != len(ranks):
        raise ValueError(f"stages has {len(stages)} entries; {schedule} with pp={pp}, v={v} has {len(ranks)} stages")
    last = len(ranks) - 1
    peaks = []
    for ops in schedule_order(schedule, pp, m, v):
        live: dict[tuple[int, int], list[int]] = {}  # (stage, micro-batch) -> [saved, output] still held
        held = peak = 0
        for op in ops:
            key, stage = (op.stage, op.micro_batch), stages[op.stage]
            before = sum(live[key]) if key in live else 0
            if op.kind == "F":
                live[key] = [stage.saved, stage.output]
                if op.stage > 0 and ranks[op.stage - 1] == ranks[op.stage]:
                    held -= live[op.stage - 1, op.micro_batch][1]
                    live[op.stage - 1, op.micro_batch][1] = 0
            elif op.kind == "I":
                live[key] = [stage.saved - stage.freed_by_input, 0 if op.stage == last else live[key][1]]
            else:
                live[key] = [0, 0]
            held += sum(live[key]) - before
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


@dataclass(frozen=True, slots=True)
class Moment:
    """One point of a rank's step where one of its stages runs a micro-batch: what the memory model composes.
    Its other in-flight micro-batches hold, per local stage, what a forward kept (`full`) or what a zero-bubble
    input step left of it (`after_input`)."""

    stage: int
    """The running stage, as an index into the rank's stages (ascending global ids)."""
    forward: bool
    """Forward (F), or a backward action (B, I or W: each priced as a backward of its micro-batch)."""
    full: tuple[int, ...]
    after_input: tuple[int, ...]

    def held(self) -> tuple[int, ...]:
        """Per stage its full sets, then per stage its sets in all. A moment dominates another of the same stage
        and direction, holding at least what it does whatever the stages' bytes, when each of these is at least
        the other's (a set after its input step holds no more than a full one)."""
        return self.full + tuple(map(operator.add, self.full, self.after_input))


@lru_cache(maxsize=1024)
def rank_moments(schedule: Schedule, pp: int, m: int, *, v: int = 1) -> tuple[tuple[Moment, ...], ...]:
    """Per rank, the moments of its torch 2.13 action order that no other one dominates (`Moment.held`),
    in the order they first occur: the peak of any per-stage bytes over the step is the peak over these. The same
    walk as `held_activation_bytes`: F makes its set full, I leaves it after its input step, B and W free it."""
    ranks = stage_ranks(schedule, pp, v)
    result = []
    for rank, ops in enumerate(schedule_order(schedule, pp, m, v)):
        local = {s: k for k, s in enumerate(s for s, r in enumerate(ranks) if r == rank)}
        state: dict[tuple[int, int], str] = {}
        counts = {"F": [0] * len(local), "I": [0] * len(local)}  # sets held per local stage, by state
        seen: dict[tuple[int, bool, tuple[int, ...], tuple[int, ...]], None] = {}  # a Moment's fields, in order
        for op in ops:
            key, stage = (op.stage, op.micro_batch), local[op.stage]
            if key in state:  # its own set is not among the others
                counts[state.pop(key)][stage] -= 1
            seen[stage, op.kind == "F", tuple(counts["F"]), tuple(counts["I"])] = None
            if op.kind in "FI":
                state[key] = op.kind
                counts[op.kind][stage] += 1
        result.append(_undominated([Moment(*fields) for fields in seen]))
    return tuple(result)


def _undominated(moments: list[Moment]) -> tuple[Moment, ...]:
    """`moments` less those another one dominates, in their order. A dominator has at least as many sets and as
    many full ones, and distinct moments never dominate each other, so scanning the largest first and comparing
    with those kept so far is exact."""
    def size(moment: Moment) -> tuple[int, int]:
        return sum(moment.full) + sum(moment.after_input), sum(moment.full)

    kept: dict[tuple[int, bool], list[tuple[int, ...]]] = {}  # per stage and direction, the kept ones' `held`
    survivors = set()
    for moment in sorted(moments, key=size, reverse=True):
        group, held = kept.setdefault((moment.stage, moment.forward), []), moment.held()
        if not any(all(map(operator.ge, other, held)) for other in group):  # a kept one dominates it
            group.append(held)
            survivors.add(moment)
    return tuple(moment for moment in moments if moment in survivors)


def sets_in_flight(moments: tuple[Moment, ...]) -> int:
    """The most micro-batch stage sets alive at once over these moments, the running one included."""
    return max((sum(a.full) + sum(a.after_input) + 1 for a in moments), default=1)


def receive_buffer_bytes(schedule: Schedule, pp: int, m: int, *, v: int = 1,
                         stages: Sequence[StageActivations], per_message: bool = False) -> tuple[int, ...]:
    """Per rank, the receive buffers torch allocates once for every micro-batch of a step and keeps: each
    non-first stage's input (the previous stage's output) and each non-last stage's output gradient
    (`_setup_forward_recv_info` and `_create_grad_recv_info`, per micro-batch, in torch 2.13).

    `per_message`: a runtime that makes a tensor for each message instead (megatron-core's
    `P2PCommunicator._communicate`). A stage input then lives with its micro-batch's activations until that
    backward (the schedule's `input_tensors`), so it belongs to the stage's `saved` bytes (a layer graph counts a
    kept input with the layer that made it: a stage's slice counts its last layer's output instead, the same
    bytes, which Megatron frees once sent), and an output gradient lives through the one backward that uses it:
    one at a time per rank.
    With several stages per rank (Megatron's interleaved schedule, which Megatron-LM runs with
    --overlap-p2p-communication, its default), the receives for the next forward's input and the next backward's
    gradient are posted while the current ones compute, and received tensors stay in the schedule's receive slots
    (`fwd_recv_buffer`, `bwd_recv_buffer`) until the next replaces them: priced as two inputs and two gradients per
    rank (megatron-core 0.16.1 over gloo, three ranks of two stages: four messages beside the saved tensors on the
    last rank at its peak, three inputs and a gradient; two on the others)."""
    ranks = stage_ranks(schedule, pp, v)
    if len(stages) != len(ranks):
        raise ValueError(f"stages has {len(stages)} entries; {schedule} with pp={pp}, v={v} has {len(ranks)} stages")
    per_rank, inputs_in, gradients_in = [0] * pp, [0] * pp, [0] * pp
    for s, rank in enumerate(ranks):
        inputs = stages[s - 1].output if s > 0 else 0
        gradients = stages[s].output if s < len(ranks) - 1 else 0
        per_rank[rank] += m * (inputs + gradients)
        inputs_in[rank], gradients_in[rank] = max(inputs_in[rank], inputs), max(gradients_in[rank], gradients)
    if not per_message:
        return tuple(per_rank)
    if v == 1:
        return tuple(gradients_in)
    return tuple(2 * (i + g) for i, g in zip(inputs_in, gradients_in, strict=True))


def activation_bytes(schedule: Schedule, pp: int, m: int, *, v: int = 1,
                     stages: Sequence[StageActivations]) -> tuple[int, ...]:
    """Per rank, peak activation-related bytes of a steady-state step: receive buffers plus in-flight sets."""
    held = held_activation_bytes(schedule, pp, m, v=v, stages=stages)
    buffers = receive_buffer_bytes(schedule, pp, m, v=v, stages=stages)
    return tuple(a + b for a, b in zip(held, buffers, strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineTime:
    """One step of a pipeline schedule, simulated."""

    step: float
    """Seconds from the first forward to the last backward on any rank."""
    busy: tuple[float, ...]
    """Compute seconds of each rank."""

    @property
    def bubble(self) -> float:
        """Seconds the busiest rank waits: the step less its compute."""
        return self.step - max(self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: 1 - sum(busy) / (pp * step); (pp - 1) / (m + pp - 1) for even 1F1B."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step) if self.step > 0 else 0.0


# A matmul's backward is two GEMMs of the forward's size, input gradient and weight gradient (dX = dY W^T,
# dW = X^T dY), so a zero-bubble W is half of a transformer stage's backward unless the caller measured it.
DEFAULT_WEIGHT_SHARE = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """Seconds one micro-batch spends in each global stage."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    """Full backward (input and weight gradients, recompute included)."""
    weight: tuple[float, ...] | None = None
    """The weight-gradient part of `backward` (zero-bubble W); None takes DEFAULT_WEIGHT_SHARE of it."""
    p2p: tuple[float, ...] = ()
    """Seconds to move one micro-batch's activation (or its gradient) across boundary s -> s + 1 when the two
    stages sit on different ranks; empty means free."""

    def __post_init__(self) -> None:
        n = len(self.forward)
        if len(self.backward) != n or (self.weight is not None and len(self.weight) != n):
            raise ValueError("forward, backward and weight need one entry per stage")
        if self.p2p and len(self.p2p) != n - 1:
            raise ValueError(f"p2p needs {n - 1} boundary entries for {n} stages, got {len(self.p2p)}")
        if any(t < 0 for t in (*self.forward, *self.backward, *(self.weight or ()), *self.p2p)):
            raise ValueError("stage times must be non-negative")


def op_seconds(op: Op, times: StageTimes) -> float:
    """Compute seconds of one action. The first stage's I is empty in torch (no input gradient), so its W runs
    the whole backward (`backward_one_chunk(full_backward=False)` skips the input pass on the first stage)."""
    full = times.backward[op.stage]
    weight = times.weight[op.stage] if times.weight is not None else DEFAULT_WEIGHT_SHARE * full
    match op.kind:
        case "F":
            return times.forward[op.stage]
        case "B":
            return full
        case "I":
            return 0.0 if op.stage == 0 else full - weight
        case _:
            return full if op.stage == 0 else weight


def pipeline_time(schedule: Schedule, pp: int, m: int, *, v: int = 1, times: StageTimes) -> PipelineTime:
    """Simulate one step: each rank runs its actions in torch's order, each as soon as its input has arrived
    (a forward after the previous stage's forward, a backward after the next stage's, plus the p2p hop between
    ranks), so uneven stages give their real bubble instead of a flat (pp - 1) / m. Cached: a search simulates the
    same stage times again (a configuration's fastest modes, then its chosen ones)."""
    if len(times.forward) != len(stage_ranks(schedule, pp, v)):
        raise ValueError(f"times cover {len(times.forward)} stages; {schedule} with pp={pp}, v={v} has "
                         f"{len(stage_ranks(schedule, pp, v))}")
    return _simulated(schedule, pp, m, v, times)


@lru_cache(maxsize=4096)
def _simulated(schedule: Schedule, pp: int, m: int, v: int, times: StageTimes) -> PipelineTime:
    orders, outputs = _step_program(schedule, pp, m, v)
    seconds = {kind: tuple(op_seconds(Op(kind, stage, 0), times) for stage in range(len(times.forward)))
               for kind in "FBIW"}
    done: list[float | None] = [None] * outputs
    clock, busy, next_op = [0.0] * pp, [0.0] * pp, [0] * pp
    remaining = sum(len(ops) for ops in orders)
    while remaining:
        progressed = False
        for rank, ops in enumerate(orders):
            while next_op[rank] < len(ops):
                output, kind, stage, source, hop = ops[next_op[rank]]
                ready = 0.0 if source < 0 else done[source]
                if ready is None:
                    break
                if hop >= 0 and times.p2p:
                    ready += times.p2p[hop]
                took = seconds[kind][stage]
                clock[rank] = max(clock[rank], ready) + took
                busy[rank] += took
                done[output] = clock[rank]
                next_op[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(f"{schedule} order deadlocks with pp={pp}, m={m}, v={v}")
    return PipelineTime(step=max(clock), busy=tuple(busy))


Action = tuple[int, str, int, int, int]
"""(its output's index, kind, stage, the index of the output it waits for or -1, the boundary its input crosses
between ranks or -1)."""


@lru_cache(maxsize=256)
def _step_program(schedule: Schedule, pp: int, m: int, v: int) -> tuple[tuple[tuple[Action, ...], ...], int]:
    """Each rank's actions in torch's order with their dependencies resolved to indices (`_input_of`), and how many
    outputs there are: what `pipeline_time` simulates for any stage times."""
    ranks = stage_ranks(schedule, pp, v)
    index: dict[tuple[str, int, int], int] = {}
    orders = []
    for ops in schedule_order(schedule, pp, m, v):
        actions = []
        for op in ops:
            output = index.setdefault(("G" if op.kind in "BI" else op.kind, op.stage, op.micro_batch), len(index))
            source, hop = _input_of(op, len(ranks))
            crossing = hop is not None and ranks[hop] != ranks[hop + 1]
            actions.append((output, op.kind, op.stage, -1 if source is None else
                            index.setdefault(source, len(index)), hop if crossing else -1))
        orders.append(tuple(actions))
    return tuple(orders), len(index)


def _input_of(op: Op, stages: int) -> tuple[tuple[str, int, int] | None, int | None]:
    """What `op` waits for and the boundary it crosses: F needs the previous stage's F, B or I the next stage's
    input gradient (the last stage its own F), W its own I; the first stage's F waits for nothing."""
    s, j = op.stage, op.micro_batch
    match op.kind:
        case "F" if s == 0:
            return None, None
        case "F":
            return ("F", s - 1, j), s - 1
        case "W":
            return ("G", s, j), None
        case _ if s == stages - 1:
            return ("F", s, j), None
        case _:
            return ("G", s + 1, j), s


def step_lower_bound(schedule: Schedule, pp: int, m: int, *, v: int = 1, times: StageTimes) -> float:
    """A bound no schedule order can beat, for cuts in a search: some rank must run m micro-batches of each of
    its stages, after the first micro-batch has crossed the stages before its earliest one and (without a split
    backward, whose W can run last) before that micro-batch's gradient crosses them back. Tight for equal stages
    under GPipe and 1F1B: (m + pp - 1)(f + b)."""
    ranks = stage_ranks(schedule, pp, v)
    hops = [times.p2p[k] if times.p2p and ranks[k] != ranks[k + 1] else 0.0 for k in range(len(ranks) - 1)]
    best = 0.0
    for rank in range(pp):
        mine = [s for s, r in enumerate(ranks) if r == rank]
        first = min(mine)
        fill = sum(times.forward[k] + hops[k] for k in range(first))
        drain = 0.0 if schedule in SPLIT_BACKWARD else sum(times.backward[k] + hops[k] for k in range(first))
        best = max(best, fill + m * sum(times.forward[s] + times.backward[s] for s in mine) + drain)
    return best


def p2p_activation_bytes(*, micro_batch: int, seq_len: int, hidden: int, dtype_bytes: int, tp: int = 1,
                         cp: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes each GPU sends across one stage boundary per micro-batch (and receives back as its gradient): the
    hidden states [seq / cp (/ tp under sequence parallelism), micro_batch, hidden], as Megatron-core's
    `get_tensor_shapes` sizes its p2p buffers; without sequence parallelism every TP rank sends a full copy."""
    seq = seq_len // cp // (tp if sequence_parallel else 1)
    return micro_batch * seq * hidden * dtype_bytes


def p2p_seconds(nbytes: int, *, bandwidth: float, latency: float) -> float:
    """Seconds of one point-to-point send of `nbytes` over a link of `bandwidth` bytes/s."""
    return nbytes / bandwidth + latency if nbytes > 0 else 0.0


def boundary_p2p_seconds(cluster: Cluster, nbytes: int, *, crosses_nodes: bool) -> float:
    """One boundary's send on this cluster: NVLink inside a node, each GPU's own NIC across nodes (rail-optimised
    fabrics give every GPU of a stage its own NIC, so the TP ranks' sends run in parallel)."""
    if crosses_nodes:
        return p2p_seconds(nbytes, bandwidth=cluster.inter_node_bandwidth * LINK_EFFICIENCY,
                           latency=INTER_NODE_LATENCY)
    return p2p_seconds(nbytes, bandwidth=cluster.gpu.intra_node_bandwidth * LINK_EFFICIENCY,
                       latency=INTRA_NODE_LATENCY)


def boundaries_crossing_nodes(schedule: Schedule, pp: int, *, v: int = 1, gpus_per_rank: int,
                              gpus_per_node: int) -> tuple[bool, ...]:
    """Per stage boundary, whether it leaves a node when the pipeline dimension is outermost (Megatron's
    tp-cp-ep-dp-pp order, torchtitan's mesh): GPU k of pipeline rank r is global rank r * gpus_per_rank + k."""
    ranks = stage_ranks(schedule, pp, v)

    def crosses(a: int, b: int) -> bool:
        return any((a * gpus_per_rank + k) // gpus_per_node != (b * gpus_per_rank + k) // gpus_per_node
                   for k in range(gpus_per_rank))

    return tuple(crosses(ranks[s], ranks[s + 1]) for s in range(len(ranks) - 1))
