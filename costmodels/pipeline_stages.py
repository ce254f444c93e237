"""What each pipeline rank holds and runs: its stages' slices of the layer graph, the schedule's in-flight
micro-batches and receive buffers on top of one micro-batch's timeline, and the per-micro-batch stage times that
`pipeline.pipeline_time` simulates into a step with its bubble.

A rank's slice is priced by the same memory and time models as a whole model (its nodes are the model's nodes),
so nothing is re-estimated by formula where the lowering has the number. The in-flight composition follows the
schedule's action order (`pipeline.rank_moments`): the peak of a micro-batch's forward or backward through one
stage happens while the rank's other in-flight micro-batches hold, per stage, what they kept after their forward
or, under a zero-bubble schedule, after their input step. The sets held are exact; with several stages per rank
each stage's micro-batch carries its own model-wide tensors (the stage builds them), a weight step (W) is priced
as a backward of its micro-batch, and while a stage's first micro-batch produces its gradients the rank's other
stages' count as allocated already (bounds, where the lowering has no finer number).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from graphs import Checkpoint, Layer, LayerGraph, Role
from graphs.poly import ZERO

from . import context_parallel, precision
from .activations import evaluate
from .breakdown import MemoryBreakdown, PipelineRank, PipelineReport, TimeBreakdown
from .cluster import Cluster
from .config import Config, Workload
from .engines import rules_of
from .identity_memo import IdentityMemo
from .memory import memory_breakdown, memory_terms, model_wide_bytes, pipelined_gathered
from .pipeline import (
    Moment,
    PipelineTime,
    StageActivations,
    StageTimes,
    boundaries_crossing_nodes,
    boundary_p2p_seconds,
    p2p_activation_bytes,
    pipeline_time,
    rank_moments,
    receive_buffer_bytes,
    sets_in_flight,
)
from .pipeline_schedule import Schedule, stage_ranks
from .stage_split import balanced_split, megatron_split, rank_balanced_split
from .states import model_states
from .tensor_parallel import rank_layer
from .terms import MemoryTerms, Span
from .timing import TimeTerms, time_breakdown, time_terms


@dataclass(frozen=True, slots=True)
class RankSlice:
    """One pipeline rank's part of the model."""

    rank: int
    stages: tuple[int, ...]
    """Global stage ids on this rank, ascending."""
    layers: tuple[int, ...]
    """Global decoder-layer indices the rank runs, ascending (its stages' layers)."""
    graph: LayerGraph
    """The rank's nodes in model order: its decoder layers, with the embedding where stage 0 is and the final
    norm, head and loss where the last stage is."""
    stage_graphs: tuple[LayerGraph, ...]
    """Per local stage, its own nodes (the same nodes as `graph`, split by stage)."""
    buffers: int
    """Receive buffers the runtime allocates for the step: stage inputs and output gradients."""
    timeline: tuple[Schedule, int, int, int] | None = None
    """(schedule, pp, micro-batches, stages per rank) of its pipeline; None without one."""

    @property
    def moments(self) -> tuple[Moment, ...]:
        """The points of its schedule that can hold its peak (`pipeline.rank_moments`; empty without a pipeline):
        walked when its memory is asked for (a search drops most slices on their states or time first)."""
        if self.timeline is None:
            return ()
        schedule, pp, m, v = self.timeline
        return rank_moments(schedule, pp, m, v=v)[self.rank]

    @property
    def in_flight(self) -> int:
        """Micro-batch stage sets alive at once at most (micro-batches with one stage per rank), the running
        one included."""
        return sets_in_flight(self.moments)


def stage_layers(graph: LayerGraph, workload: Workload, config: Config) -> tuple[int, ...]:
    """Decoder layers of each global stage: the configured split, else the one that balances forward and backward
    FLOPs, the embedding riding with the first stage and the norm, head and loss with the last. With one stage per
    rank, the best split Megatron's first/last flags express (ends free, middle stages equal:
    `stage_split.megatron_split`); with several, the split whose busiest rank is least busy
    (`stage_split.rank_balanced_split`; the costliest stage's, `balanced_split`, where layers differ in kind), which
    Megatron's `--pipeline-model-parallel-layout` and torchtitan's `module_fqns_per_model_part` both express: the
    flags' form would load both end stages with the layers the pp x v - 2 middle stages cannot share evenly (80
    layers over 32 stages: 11 and 9 layers at the ends, 2 in each middle stage)."""
    if config.pp_split:
        return config.pp_split
    stages = config.pp * config.pp_virtual
    if stages == 1:
        return (len(graph.decoder_layers()),)
    ranks = stage_ranks(config.pp_schedule, config.pp, config.pp_virtual) if config.pp_virtual > 1 else None
    return _balanced(graph, workload.seq_len, config.micro_batch, config.tp, stages, ranks)


@lru_cache(maxsize=1024)
def _balanced(graph: LayerGraph, seq_len: int, micro_batch: int, tp: int, stages: int,
              ranks: tuple[int, ...] | None) -> tuple[int, ...]:
    def flops(layer: Layer) -> float:
        cost = rank_layer(graph, layer, tp).cost()  # the head's FLOPs on one TP rank
        return float(sum(evaluate(work.flops, b=micro_batch, s=seq_len, tp=tp, sequence_parallel=False)
                         for work in (cost.forward, cost.backward)))

    nodes = graph.nodes()
    decoders = [i for i, layer in enumerate(nodes) if layer.role is Role.DECODER]
    first = sum(flops(layer) for layer in nodes[:decoders[0]])
    last = sum(flops(layer) for layer in nodes[decoders[-1] + 1:])
    by_kind: dict[int, float] = {}  # layers of one kind cost the same
    for i in decoders:
        if nodes[i].kind not in by_kind:
            by_kind[nodes[i].kind] = flops(nodes[i])
    costs = [by_kind[nodes[i].kind] for i in decoders]
    if ranks is None:
        return megatron_split(costs, stages, first_extra=first, last_extra=last)
    if len(by_kind) == 1:
        return rank_balanced_split(costs[0], len(costs), ranks, first_extra=first, last_extra=last)
    return balanced_split(costs, stages, first_extra=first, last_extra=last)


def boundary_bytes(graph: LayerGraph, workload: Workload, config: Config) -> int:
    """Bytes of the hidden states one GPU sends across a stage boundary per micro-batch (and gets back as their
    gradient): the compute dtype's [micro_batch, seq / cp (/ tp with sequence parallelism), hidden]."""
    return p2p_activation_bytes(micro_batch=config.micro_batch, seq_len=workload.seq_len, hidden=graph.dims.hidden,
                                dtype_bytes=precision.compute_itemsize(config.precision), tp=config.tp, cp=config.cp,
                                sequence_parallel=config.sequence_parallel)


def rank_slices(graph: LayerGraph, workload: Workload, config: Config) -> tuple[RankSlice, ...]:
    """Every pipeline rank's slice (one slice, the whole model, without pipeline parallelism)."""
    return _slices(graph, workload.seq_len, workload.global_batch, _key(config))


def _key(config: Config) -> tuple[object, ...]:
    # whose schedules run the pipeline (megatron-core's or torch's) decides the receive buffers and the schedules
    return (config.pp, config.pp_schedule, config.pp_virtual, config.pp_split, config.grad_accum,
            config.micro_batch, config.tp, config.cp, config.sequence_parallel, config.precision,
            rules_of(config.engine).megatron_schedules)


@lru_cache(maxsize=256)
def _slices(graph: LayerGraph, seq_len: int, global_batch: int, key: tuple[object, ...]) -> tuple[RankSlice, ...]:
    pp, schedule, v, split, m, micro_batch, tp, cp, sp, prec, per_message = key
    # the split and the boundary's bytes read no micro-batch count: at least pp, so that the default engine's
    # schedule check passes where megatron-core's 1F1B runs fewer (`schedule_problem`)
    config = Config(pp=pp, pp_schedule=schedule, pp_virtual=v, pp_split=split,  # type: ignore[arg-type]
                    grad_accum=max(m, pp), micro_batch=micro_batch, tp=tp, cp=cp,  # type: ignore[arg-type]
                    sequence_parallel=sp, precision=prec)  # type: ignore[arg-type]
    workload = Workload(seq_len=seq_len, global_batch=global_batch)
    sizes = stage_layers(graph, workload, config)
    if pp == 1:
        return (RankSlice(rank=0, stages=(0,), layers=tuple(range(sum(sizes))), graph=graph, stage_graphs=(graph,),
                          buffers=0),)
    ranks = stage_ranks(schedule, pp, v)  # type: ignore[arg-type]
    bounds = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    hidden = boundary_bytes(graph, workload, config)
    stage_bytes = [StageActivations(saved=0, output=hidden if s < len(sizes) - 1 else 0) for s in range(len(sizes))]
    buffers = receive_buffer_bytes(schedule, pp, m, v=v, stages=stage_bytes,  # type: ignore[arg-type]
                                   per_message=per_message)
    slices = []
    for rank in range(pp):
        stages = tuple(s for s, r in enumerate(ranks) if r == rank)
        stage_graphs = tuple(sub_graph(graph, tuple(range(bounds[s], bounds[s + 1])), first=s == 0,
                                        last=s == len(sizes) - 1) for s in stages)
        layers = tuple(i for s in stages for i in range(bounds[s], bounds[s + 1]))
        whole = sub_graph(graph, layers, first=0 in stages, last=len(sizes) - 1 in stages)
        slices.append(RankSlice(rank=rank, stages=stages, layers=layers, graph=whole, stage_graphs=stage_graphs,
                                buffers=buffers[rank], timeline=(schedule, pp, m, v)))  # type: ignore[arg-type]
    return tuple(slices)


@lru_cache(maxsize=4096)
def sub_graph(graph: LayerGraph, layers: tuple[int, ...], *, first: bool, last: bool) -> LayerGraph:
    """The nodes of decoder `layers` (with the pre-decoder nodes when `first`, the post-decoder ones when `last`)
    as a graph of their own: its token ids and labels only where the embedding or the loss is. Its `dims` stay
    the model's (the architecture), so a slice is checked against the whole model's layers."""
    nodes = graph.nodes()
    decoders = [i for i, layer in enumerate(nodes) if layer.role is Role.DECODER]
    keep = [nodes[decoders[i]] for i in sorted(layers)]
    if first:
        keep = nodes[:decoders[0]] + keep
    if last:
        keep = keep + [_with_tied_head(nodes) if not first and layer.role is Role.HEAD else layer
                       for layer in nodes[decoders[-1] + 1:]]
    inputs = graph.inputs if (first or last) else ZERO
    return replace(graph, layers=tuple(keep), inputs=inputs, _memo={})  # dims stay the whole model's


def _with_tied_head(nodes: list[Layer]) -> Layer:
    """The LM head of a last stage away from the embedding: a model that ties them keeps its own copy of the
    embedding weight there (Megatron's output-layer copy on the last stage, its gradients all-reduced with the
    first stage's), which the whole-model graph counts once, on the embedding."""
    head = next(layer for layer in nodes if layer.role is Role.HEAD)
    if head.params:
        return head
    embedding = next(layer for layer in nodes if layer.role is Role.EMBEDDING)
    widest = max(embedding.params, key=lambda p: p.shape, default=None)
    return head if widest is None else replace(head, params=(replace(widest, node=head.name),))


def rank_memory_terms(slice_: RankSlice, workload: Workload, config: Config) -> MemoryTerms:
    """The memory terms of a pipeline rank: its slice's, with its stages (when it runs several), the moments of
    its schedule and its receive buffers. `config` is the whole model's (its modes, if any, per model layer)."""
    own = rank_config(config, slice_)
    stage_configs = tuple(rank_config(config, slice_, stage=local) for local in range(len(slice_.stage_graphs))) \
        if len(slice_.stage_graphs) > 1 else ()
    graphs, unscheduled = (slice_.graph, *slice_.stage_graphs), tuple(_unscheduled(c) for c in (own, *stage_configs))

    def scheduled() -> MemoryTerms:
        terms = _SLICE_TERMS.get(graphs, (workload, *unscheduled),
                                 lambda: _slice_memory_terms(slice_, workload, own, stage_configs))
        # receive buffers, and the parameters an engine that syncs once per step keeps gathered all step (FSDP2)
        return replace(terms, moments=slice_.moments,
                       buffers=terms.buffers + slice_.buffers + pipelined_gathered(slice_.graph, own))

    # one object per rank shape, schedule and position: its peaks are walked once (`tables.Table.peak_of`)
    return _RANK_TERMS.get(graphs, (workload, *unscheduled, slice_.timeline, slice_.rank, slice_.buffers), scheduled)


# A rank's terms before its schedule's moments and receive buffers, by its slice's and stages' graphs (identities)
# and configurations: a search prices ranks of one shape, on the same graphs, under many schedules and splits; and
# with them, by its schedule and position.
_SLICE_TERMS: IdentityMemo[MemoryTerms] = IdentityMemo(limit=4096)
_RANK_TERMS: IdentityMemo[MemoryTerms] = IdentityMemo(limit=4096)
# A pipeline's schedule: the schedule, its stages per rank and the split.
SCHEDULE_FIELDS = ("pp_schedule", "pp_virtual", "pp_split")
# What a slice's memory and time terms read of a configuration: all but its schedule (the slice and its stages are
# the split; their moments and buffers are added after).
UNSCHEDULED_FIELDS = tuple(f.name for f in fields(Config) if f.name not in SCHEDULE_FIELDS)


def _unscheduled(config: Config) -> tuple[object, ...]:
    return tuple(getattr(config, name) for name in UNSCHEDULED_FIELDS)


def _slice_memory_terms(slice_: RankSlice, workload: Workload, own: Config,
                        stage_configs: tuple[Config, ...]) -> MemoryTerms:
    """The memory terms of a rank's slice (`own`: its configuration), with a span per stage when it runs several
    (`stage_configs`: theirs)."""
    terms = memory_terms(slice_.graph, workload, own)
    if not stage_configs:
        return terms
    s = context_parallel.rank_workload(workload, own).seq_len
    total = terms.states.accumulating_grads
    spans, first = [], 0
    for stage, stage_config in zip(slice_.stage_graphs, stage_configs, strict=True):
        nodes = stage.nodes()
        start, forward_only = model_wide_bytes(stage, stage_config, b=own.micro_batch, s=s)
        trains = [i for i, layer in enumerate(nodes) if any(p.trainable for p in layer.params)]
        own_grads = model_states(stage, stage_config).accumulating_grads
        spans.append(Span(first=first, stop=first + len(nodes), start=start, forward_only=forward_only,
                          input_frees_from=first + (trains[-1] + 1 if trains else 0),
                          other_grads=max(0, total - own_grads)))
        first += len(nodes)
    if first != len(terms.nodes):
        raise ValueError(f"{slice_.rank=}'s stages have {first} nodes, its slice {len(terms.nodes)}")
    return replace(terms, spans=tuple(spans))


def rank_config(config: Config, slice_: RankSlice, *, stage: int | None = None) -> Config:
    """`config` for pricing one rank's slice (or one of its stages) as a model of its own: the checkpoint modes
    of its layers."""
    modes = config.checkpoint
    if not modes:
        return config
    if stage is None:
        return replace(config, checkpoint=tuple(modes[i] for i in slice_.layers))
    sizes = [len(g.decoder_layers()) for g in slice_.stage_graphs]
    start = sum(sizes[:stage])
    return replace(config, checkpoint=tuple(modes[i] for i in slice_.layers[start:start + sizes[stage]]))


def stage_p2p_seconds(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> tuple[float, ...]:
    """Seconds of each stage boundary's activation send per micro-batch: NVLink inside a node, the GPU's NIC across
    nodes (the pipeline is the outermost rank dimension: tp x cp x dp GPUs per pipeline rank)."""
    crossing = boundaries_crossing_nodes(config.pp_schedule, config.pp, v=config.pp_virtual,
                                         gpus_per_rank=config.tp * config.cp * config.dp,
                                         gpus_per_node=cluster.gpus_per_node)
    nbytes = boundary_bytes(graph, workload, config)
    return tuple(boundary_p2p_seconds(cluster, nbytes, crosses_nodes=c) for c in crossing)



def stage_seconds(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch through one stage's nodes in their modes."""
    terms = time_terms(graph, cluster, workload, config)
    return stage_split_seconds(terms, config.layer_modes(len(terms.layers)), config.grad_accum)


def stage_split_seconds(terms: TimeTerms, modes: tuple[Checkpoint, ...], micro_batches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch from a stage's time terms: its compute over the step, less
    the work outside the schedule, per micro-batch; the backward carries the recompute and the tensor-parallel
    collectives."""
    in_schedule = terms.fixed.step_time - terms.outside + sum(
        dict(options)[mode].total for options, mode in zip(terms.layers, modes, strict=True))
    return terms.forward, max(0.0, in_schedule / micro_batches - terms.forward)


def pipeline_step(schedule: Schedule, pp: int, m: int, v: int, stages: list[tuple[float, float]],
                  p2p: tuple[float, ...], outside: list[float]) -> tuple[PipelineTime, float]:
    """The simulated schedule and the step: the schedule, then the slowest rank's work outside it."""
    times = StageTimes(forward=tuple(f for f, _ in stages), backward=tuple(b for _, b in stages), p2p=p2p)
    simulated = pipeline_time(schedule, pp, m, v=v, times=times)
    return simulated, simulated.step + max(outside)


def pipeline_estimate(graph: LayerGraph, cluster: Cluster, workload: Workload,
                      config: Config) -> tuple[MemoryBreakdown, TimeBreakdown, PipelineReport]:
    """Memory of the rank with the largest device peak, the step time (the simulated schedule, then the slowest
    rank's work outside it) with the busiest rank's breakdown and the bubble, and every rank's share."""
    slices = rank_slices(graph, workload, config)
    sizes = stage_layers(graph, workload, config)
    stages = [(0.0, 0.0)] * len(sizes)
    memories, outside = [], []
    for slice_ in slices:
        for local, stage in enumerate(slice_.stages):
            stages[stage] = stage_seconds(slice_.stage_graphs[local], cluster, workload,
                                          rank_config(config, slice_, stage=local))
        own = rank_config(config, slice_)
        memories.append(memory_breakdown(slice_.graph, cluster, workload, own,
                                         terms=rank_memory_terms(slice_, workload, config)))
        outside.append(time_terms(slice_.graph, cluster, workload, own).outside)
    p2p = stage_p2p_seconds(graph, cluster, workload, config)
    m, v = config.grad_accum, config.pp_virtual
    simulated, step = pipeline_step(config.pp_schedule, config.pp, m, v, stages, p2p, outside)
    critical = max(range(config.pp), key=lambda r: (simulated.busy[r] + outside[r], -r))
    own = time_breakdown(slices[critical].graph, cluster, workload, rank_config(config, slices[critical]))
    bubble = max(0.0, step - own.step_time)
    time = replace(own, bubble=bubble, step_time=own.step_time + bubble,
                   details=(*own.details, ("pipeline_schedule", simulated.step), ("pipeline_rank", critical)))
    ranks = tuple(PipelineRank(rank=s.rank, stages=s.stages, layers=len(s.layers), in_flight=s.in_flight,
                               memory=memories[s.rank], busy=simulated.busy[s.rank], outside=outside[s.rank])
                  for s in slices)
    report = PipelineReport(schedule=str(config.pp_schedule), pp=config.pp, virtual=v, micro_batches=m,
                            stage_layers=sizes, stage_forward=tuple(f for f, _ in stages),
                            stage_backward=tuple(b for _, b in stages), p2p=p2p,
                            schedule_seconds=simulated.step, bubble_fraction=simulated.bubble_fraction, ranks=ranks)
    worst = max(memories, key=lambda b: (b.device_peak, b.allocated_peak))
    return worst, time, report
