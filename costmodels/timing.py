"""Time per optimizer step: compute and recompute per node, TP and data-parallel collectives (overlapped where
the engine overlaps them), offload, and the optimizer step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from graphs import Checkpoint, Layer, LayerGraph, Role

from . import activation_offload, context_parallel, partial_offload, precision, prefetch
from .alignment import alignment_factor
from .attention_kernels import kernel_for
from .breakdown import TimeBreakdown
from .cluster import Cluster, node_view
from .collectives import (
    Group,
    all_gather_seconds,
    all_reduce_seconds,
    dp_group,
    reduce_scatter_seconds,
    replica_group,
)
from .compilation import compile_credited, memory_bound_speedup
from .compute import (
    EAGER_HOST_SECONDS_PER_KERNEL,
    KERNEL_LAUNCH_SECONDS,
    KernelSpeed,
    device_seconds,
    kernel_speed,
    launch_seconds,
    reduction_width,
    work_seconds,
)
from .config import Config, Precision, Workload
from .engines import DataParallelTraffic, rules_of
from .expert_parallel import expert_dp_group, is_expert_stack
from .expert_parallel import layer_time as expert_layer_time
from .fp8 import cast_bytes, te_cast_bytes
from .identity_memo import IdentityMemo
from .loss import timed_layer
from .offload import (
    copy_seconds,
    host_link,
    host_step_seconds,
    host_stepped,
    moved_itemsize,
    offload_seconds,
    params_live_on_host,
    steps_a_share,
)
from .offload_schedule import Unit, exposed_copy_seconds
from .optimizer_launches import step_launch_seconds
from .paging import paging_seconds
from .prefetch import zero3_seconds
from .states import paged_split
from .tensor_parallel import rank_layer, tp_node_seconds
from .terms import Gemm
from .zero import dp_traffic, local_elements, reduce_bucket_elements, shard_ranks, sharding

# The optimizer step streams each local parameter's states: fp32 param, grad, 2 moments read and param and
# moments written (28 bytes), plus the 16-bit copy and master weights under mixed precision (an upper bound;
# ZeRO paper's accounting of Adam state traffic).
OPTIMIZER_BYTES_PER_PARAM = 32


@dataclass(frozen=True, slots=True)
class NodeTime:
    """Seconds one node adds per step in one checkpoint mode (gradient accumulation included)."""

    compute: float
    recompute: float
    tp: float
    ep: float = 0.0
    """Expert-parallel all-to-alls of an MoE layer, not overlapped (`expert_parallel`)."""
    cp: float = 0.0
    """Context-parallel attention exchange not hidden behind attention (`context_parallel`)."""

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.ep + self.tp + self.cp


@dataclass(frozen=True, slots=True)
class TimeTerms:
    """Step time as a constant plus one term per decoder layer and mode: what the solver sums."""

    fixed: TimeBreakdown
    """Everything that does not depend on the decoder layers' checkpoint modes (their NONE-mode work
    excluded): non-decoder nodes, data-parallel collectives, offload, the optimizer step."""
    layers: tuple[tuple[tuple[Checkpoint, NodeTime], ...], ...]
    """For each decoder layer, its time in every mode it supports."""
    forward: float = 0.0
    """Seconds of one micro-batch's forward over every node (no recompute): a pipeline stage's F."""
    outside: float = 0.0
    """Part of `fixed` outside the micro-batches' compute: data-parallel collectives, offload, the optimizer step
    (what a pipeline rank spends after its schedule)."""


# The configuration fields `speed_for` reads (a test checks it): its results are cached on them (the engine, stage
# and compile as `kernel_key` reads them), with the graph and the cluster's `node_view` by identity (kernel rates,
# like node times, read a node, not how many there are).
SPEED_FIELDS = ("precision", "tp", "cp", "cp_mode", "engine", "compile", "zero", "loss")
_SPEEDS: IdentityMemo[KernelSpeed] = IdentityMemo()


def speed_for(graph: LayerGraph, cluster: Cluster, config: Config, *, b: int, s: int,
              head: bool = False) -> KernelSpeed:
    """Kernel rates for decoder layers (or, with `head`, for the LM head, whose GEMM spans the vocabulary)."""
    return _SPEEDS.get((graph, node_view(cluster)), (b, s, head, *kernel_key(config, SPEED_FIELDS)),
                       lambda: _speed_for(graph, cluster, config, b=b, s=s, head=head))


# What kernel rates and node times read of the engine, its ZeRO stage and torch.compile: whether Transformer Engine's
# kernels run (`EngineRules.transformer_engine`) and whether compile is credited (`compile_credited`). The caches
# key on these two instead of the three fields, so configurations whose engines run the same kernels (DDP, FSDP2 and
# DeepSpeed at any stage, compiled or not where compile is not credited) share their kernel rates and layer times.
_KERNEL_FIELDS = ("engine", "zero", "compile")


def kernel_key(config: Config, names: tuple[str, ...]) -> tuple[object, ...]:
    """The cache key of `names` (a `*_FIELDS` tuple) for `config`, with the engine, stage and compile fields read
    as the kernels they select."""
    return (*(getattr(config, name) for name in names if name not in _KERNEL_FIELDS),
            rules_of(config.engine).transformer_engine, compile_credited(config))


def _speed_for(graph: LayerGraph, cluster: Cluster, config: Config, *, b: int, s: int, head: bool) -> KernelSpeed:
    # fp8 converts the decoder layers' linears; the LM head stays in the compute dtype (as the torchrun script
    # and torchao's README leave it), which is the attention kernels' dtype.
    dtype = precision.attention_dtype_on(config.precision, cluster.gpu) if head else \
        precision.matmul_dtype_on(config.precision, cluster.gpu)
    dims = graph.dims
    widths = (dims.hidden, dims.vocab // config.tp) if head else \
        (dims.hidden, dims.intermediate // config.tp, dims.heads * dims.head_dim // config.tp)
    factor = alignment_factor(cluster.gpu, dtype, (b * s, *widths))
    attention = precision.attention_dtype_on(config.precision, cluster.gpu)
    layers = graph.decoder_layers()
    width = dims.hidden if head or not layers else \
        reduction_width([(g.routed, g.n, g.k) for g in layer_gemms(layers[0], config.tp)])
    kernel = kernel_for(cluster.gpu, transformer_engine=rules_of(config.engine).transformer_engine)
    speed = kernel_speed(cluster.gpu, matmul_dtype=dtype, attention_dtype=attention, tokens=b * s, width=width,
                         seq_len=context_parallel.kernel_seq_len(s, config), head_dim=dims.head_dim, alignment=factor,
                         profile=cluster.profile, attention_kernel=kernel)
    # An eager layer pays the measured host cost per op; a compiled one issues its kernels from the wrapper.
    host = KERNEL_LAUNCH_SECONDS if compile_credited(config) else EAGER_HOST_SECONDS_PER_KERNEL
    return replace(speed, host_per_kernel=host)


_GEMMS: IdentityMemo[tuple[Gemm, ...]] = IdentityMemo()
# The lowering's column-wise TP styles (`graphs.structure`): the linears that read the block's input (its norm).
_COLUMN_STYLES = ("colwise", "packed_colwise")


def layer_gemms(layer: Layer, tp: int) -> tuple[Gemm, ...]:
    """The matmul weights of a decoder layer on one TP rank: a Linear weight is (n, k) = (out, in), an expert
    stack (experts, n, k) of which `top_k` run per token. Column-parallel splits n and keeps the whole reduction
    k; row-parallel splits k (Shoeybi et al. 2019)."""
    return _GEMMS.get((layer,), (tp,), lambda: _layer_gemms(layer, tp))


def _layer_gemms(layer: Layer, tp: int) -> tuple[Gemm, ...]:
    top_k = layer.moe.top_k if layer.moe else 1
    gemms = []
    for tensor in layer.params:
        if len(tensor.shape) not in (2, 3):
            continue
        n, k = tensor.shape[-2:]
        dim = None if tensor.tp_dim is None else tensor.tp_dim - (len(tensor.shape) - 2)
        n, k = (-(-n // tp), k) if dim == 0 else (n, -(-k // tp)) if dim == 1 else (n, k)
        stack = len(tensor.shape) == 3
        gemms.append(Gemm(n=n, k=k, routed=top_k if stack else 1, copies=tensor.shape[0] if stack else 1,
                          norm_fed=not stack and tensor.tp_style in _COLUMN_STYLES))
    return tuple(gemms)


def node_time(graph: LayerGraph, cluster: Cluster, config: Config, layer: Layer, mode: Checkpoint,
              speed: KernelSpeed, *, b: int, s: int, memory_speedup: float = 1.0) -> NodeTime:
    cost = layer.cost(mode)
    kwargs = {"b": b, "s": s, "tp": config.tp, "sequence_parallel": config.sequence_parallel,
              "memory_speedup": memory_speedup}
    ga = config.grad_accum
    cast_fwd, cast_bwd = fp8_cast_seconds(layer, config, speed, b=b, s=s, memory_speedup=memory_speedup)
    recast = cast_fwd if mode is Checkpoint.FULL else 0.0  # full recompute reruns the forward's casts
    expert = expert_layer_time(cluster, config, layer, mode, speed, b=b, s=s, hidden=graph.dims.hidden,
                               itemsize=precision.compute_itemsize(config.precision))
    return NodeTime(compute=ga * (work_seconds(cost.forward, speed, **kwargs)
                                  + work_seconds(cost.backward, speed, **kwargs) + cast_fwd + cast_bwd
                                  + expert.compute),
                    recompute=ga * (work_seconds(cost.recompute, speed, **kwargs) + recast + expert.recompute),
                    ep=ga * expert.all_to_all,
                    tp=ga * tp_node_seconds(graph, cluster, config, layer, mode, b=b, s=s,
                                            column_gemms=column_gemm_seconds(layer, config.tp, speed, tokens=b * s)),
                    cp=ga * context_parallel.node_seconds(graph, cluster, config, layer, mode, speed, b=b,
                                                          s_local=s)[0])


# The configuration fields `node_time` reads (a test checks it): its results are cached on them (`kernel_key`), with
# the graph, the cluster's `node_view` and the layer by identity (held in the entry, so an id is not reused while
# cached). The solver prices the same layers under many configurations that differ only in what node times do not read
# (sharding, offload, optimizer), and `choose` on clusters that differ only in their node count.
NODE_TIME_FIELDS = ("tp", "sequence_parallel", "precision", "cp", "cp_mode", "ep", "grad_accum", "engine")
_NODE_TIMES: IdentityMemo[NodeTime] = IdentityMemo()


def cached_node_time(graph: LayerGraph, cluster: Cluster, config: Config, layer: Layer, mode: Checkpoint,
                     speed: KernelSpeed, *, b: int, s: int, memory_speedup: float = 1.0) -> NodeTime:
    """`node_time`, looked up by what it reads first."""
    return _NODE_TIMES.get((graph, node_view(cluster), layer),
                           (mode, speed, b, s, memory_speedup, *kernel_key(config, NODE_TIME_FIELDS)),
                           lambda: node_time(graph, cluster, config, layer, mode, speed, b=b, s=s,
                                             memory_speedup=memory_speedup))


def column_gemm_seconds(layer: Layer, tp: int, speed: KernelSpeed, *, tokens: int) -> tuple[float, ...]:
    """Seconds of one GEMM (forward, input gradient or weight gradient: the same FLOPs) of each column-parallel
    weight of a layer on one TP rank, what Transformer Engine hides its backward TP collectives behind."""
    return tuple(2 * tokens * g.routed * g.n * g.k / speed.matmul_flops for g in layer_gemms(layer, tp) if g.norm_fed)


def clear_caches() -> None:
    """Empty the memos of node times, kernel speeds, layer GEMMs, element counts and ZeRO-3's simulated passes
    (tests compare warm against cold)."""
    for memo in (_NODE_TIMES, _SPEEDS, _GEMMS, _NODE_TERMS, _COUNTS):
        memo.clear()
    prefetch.clear_caches()


def fp8_cast_seconds(layer: Layer, config: Config, speed: KernelSpeed, *, b: int, s: int,
                     memory_speedup: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of the fp8 casts of a decoder layer's matmul operands per micro-batch
    (memory-bound; torch.compile fuses them like the other element-wise kernels), as torchao's dynamic scaling or
    Transformer Engine's delayed scaling (engines that run TE) makes them. Zero outside fp8."""
    if config.precision is not Precision.FP8 or layer.role is not Role.DECODER:
        return 0.0, 0.0
    gemms = layer_gemms(layer, config.tp)
    forward, backward = te_cast_bytes(gemms, b * s, micro_batches=config.grad_accum) \
        if rules_of(config.engine).transformer_engine else cast_bytes(gemms, b * s)
    rate = speed.memory_bandwidth * memory_speedup
    return forward / rate, backward / rate


def time_terms(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> TimeTerms:
    """The step time of `config` for every choice of per-layer checkpoint modes.

    Data-parallel collectives overlap the forward and backward compute of the layers without counting
    recompute, so that the step time is a sum over layers (what makes the solver's model linear).
    """
    # One context-parallel rank: s / cp tokens, attention FLOPs its load-balanced share (`context_parallel`).
    graph, workload = context_parallel.rank_graph(graph, config.cp), context_parallel.rank_workload(workload, config)
    b, s, ga = config.micro_batch, workload.seq_len, config.grad_accum
    speed = speed_for(graph, cluster, config, b=b, s=s)
    memory_speedup = memory_bound_speedup(config)
    layers, fixed, nodes = _NODE_TERMS.get(
        (graph, node_view(cluster)), (b, s, memory_speedup, *kernel_key(config, NODE_TERMS_FIELDS)),
        lambda: _node_terms(graph, cluster, config, speed, b=b, s=s, memory_speedup=memory_speedup))
    fwd, bwd = sum(f for f, _ in nodes), sum(b for _, b in nodes)
    group = dp_group(cluster, config.tp, shard_ranks(config))
    fetched = zero3_fetch_seconds(graph, cluster, config, group, nodes)
    dp_mb, dp_step, dp_total = fetched or _dp_seconds(graph, cluster, config, forward=fwd, backward=bwd)
    partition = local_elements(graph.tensor_groups(trainable=True), tp=config.tp, dp=shard_ranks(config),
                               engine=config.engine, sharded=sharding(config).optimizer > 1, ep=config.ep)
    shard = local_elements(graph.tensor_groups(), tp=config.tp, dp=shard_ranks(config), engine=config.engine,
                           sharded=sharding(config).params > 1, ep=config.ep)
    # The step streams its states, or waits on its kernel launches when they take longer (small models); under
    # offload the GPU steps only the share it keeps (none but under Megatron's hybrid optimizer).
    on_gpu = partition - host_stepped(config, partition)
    optimizer = 0.0 if not on_gpu else \
        max(on_gpu * OPTIMIZER_BYTES_PER_PARAM / speed.memory_bandwidth,
            step_launch_seconds(sum(n for _, n in graph.tensor_groups(trainable=True)), config, elements=on_gpu))
    grad_bytes = precision.compute_itemsize(config.precision)
    if steps_a_share(config):  # the host share steps beside the GPU's
        offload = partial_offload.exposed_host_seconds(
            host_step=host_step_seconds(cluster, config, partition=partition),
            copies=copy_seconds(cluster, config, partition=partition, params=shard, grad_bytes=grad_bytes),
            gpu_step=optimizer)
    elif params_live_on_host(config) and config.pp == 1:
        offload = fsdp2_offload_seconds(graph, cluster, config, nodes, partition=partition, shard=shard)
    else:
        offload = offload_seconds(cluster, config, partition=partition, params=shard, grad_bytes=grad_bytes)
    # Memory savers' host traffic: paged optimizer states in and out, offloaded activations compute cannot hide.
    offload += paging_seconds(cluster, paged_split(graph, config)) + activation_offload.step_seconds(
        graph, cluster, config, speed, s=s, memory_speedup=memory_speedup)
    communication = fixed.tp + ga * dp_mb + dp_step
    total = fixed.compute + fixed.recompute + communication + offload + optimizer
    return TimeTerms(
        fixed=TimeBreakdown(compute=fixed.compute, recompute=fixed.recompute, communication=communication,
                            offload=offload, optimizer=optimizer, step_time=total,
                            communication_total=fixed.tp + dp_total,
                            details=(("dp_collectives_total", dp_total),)),
        layers=tuple(layers), forward=fwd, outside=ga * dp_mb + dp_step + offload + optimizer)


# The configuration fields `_node_terms` reads (a test checks it): its node times', its kernel speeds', the loss that
# prices the head and the micro-batch it is timed on. Cached on them (`kernel_key`): the solver times the same layers
# under many configurations that differ only in sharding, offload or optimizer.
NODE_TERMS_FIELDS = tuple(dict.fromkeys((*NODE_TIME_FIELDS, *SPEED_FIELDS, "micro_batch")))
NodeTerms = tuple[tuple[tuple[tuple[Checkpoint, NodeTime], ...], ...], NodeTime, tuple[tuple[float, float], ...]]
_NODE_TERMS: IdentityMemo[NodeTerms] = IdentityMemo(limit=2**12)


def _node_terms(graph: LayerGraph, cluster: Cluster, config: Config, speed: KernelSpeed, *, b: int, s: int,
                memory_speedup: float) -> NodeTerms:
    """Each decoder layer's times in its modes, the non-decoder nodes' summed time, and every node's (forward,
    backward) seconds of one micro-batch without recompute (what data-parallel collectives overlap)."""
    head_speed = speed_for(graph, cluster, config, b=b, s=s, head=True)
    fixed = NodeTime(0.0, 0.0, 0.0)
    layers, nodes = [], []
    by_kind: dict[int, tuple[tuple[tuple[Checkpoint, NodeTime], ...], float, float]] = {}
    kwargs = {"b": b, "s": s, "tp": config.tp, "sequence_parallel": config.sequence_parallel,
              "memory_speedup": memory_speedup}
    for layer in graph.nodes():
        if layer.role is Role.DECODER:
            if layer.kind not in by_kind:  # layers of one kind cost the same
                options = tuple((mode, cached_node_time(graph, cluster, config, layer, mode, speed, b=b, s=s,
                                                        memory_speedup=memory_speedup))
                                for mode in layer.checkpoint_modes)
                cast_fwd, cast_bwd = fp8_cast_seconds(layer, config, speed, b=b, s=s, memory_speedup=memory_speedup)
                by_kind[layer.kind] = (options, work_seconds(layer.cost().forward, speed, **kwargs) + cast_fwd,
                                       work_seconds(layer.cost().backward, speed, **kwargs) + cast_bwd)
            options, layer_fwd, layer_bwd = by_kind[layer.kind]
            layers.append(options)
            nodes.append((layer_fwd, layer_bwd))
        else:
            # The head and loss as `config.loss` computes them, on one TP rank's share of the vocabulary.
            layer = rank_layer(graph, timed_layer(graph, config, layer, s=s), config.tp)
            node_speed = head_speed if layer.role is Role.HEAD else speed
            nodes.append((work_seconds(layer.cost().forward, node_speed, **kwargs),
                          work_seconds(layer.cost().backward, node_speed, **kwargs)))
            t = cached_node_time(graph, cluster, config, layer, Checkpoint.NONE, node_speed, b=b, s=s,
                                 memory_speedup=memory_speedup)
            fixed = NodeTime(fixed.compute + t.compute, fixed.recompute + t.recompute, fixed.tp + t.tp)
    return tuple(layers), fixed, tuple(nodes)


def zero3_fetch_seconds(graph: LayerGraph, cluster: Cluster, config: Config, group: Group,
                        nodes: list[tuple[float, float]]) -> tuple[float, float, float] | None:
    """(exposed per micro-batch, exposed per step, total) collective seconds of an engine that fetches parameters
    module by module (DeepSpeed ZeRO-3: `prefetch`), or None for the others (and under expert parallelism, whose
    expert groups `_dp_seconds` prices)."""
    if not rules_of(config.engine).fetches_per_module or config.ep > 1 or not sharding(config).params > 1:
        return None
    exposed, total = zero3_seconds(graph, cluster, config, group, nodes=nodes,
                                   itemsize=precision.compute_itemsize(config.precision),
                                   reduce_itemsize=_reduce_itemsize(config))
    return exposed, 0.0, config.grad_accum * total


def fsdp2_offload_seconds(graph: LayerGraph, cluster: Cluster, config: Config, nodes: Sequence[tuple[float, float]],
                          *, partition: int, shard: int) -> float:
    """Seconds per step of FSDP2's CPUOffloadPolicy without a pipeline: the host optimizer step, the decoder
    layers' copies as its streams run them beside their compute and collectives (`offload_schedule`, compute
    without recompute as the collectives' overlap counts it), and the root unit's copies exposed (gathered first,
    reduced last). A pipeline's FSDP2 reduces once per step, after its schedule: its copies are priced exposed.

    The first micro-batch copies its gradients down without blocking; later ones accumulate into the host gradient,
    which `foreach_reduce` copies synchronously, as it does every copy under optimizer-in-backward's hooks.
    """
    units, (forward_lead, backward_lead, backward_tail) = offload_units(graph, cluster, config, nodes)
    kwargs = {"forward_lead": forward_lead, "backward_lead": backward_lead, "backward_tail": backward_tail,
              "regather": config.zero == 3}
    ga = config.grad_accum
    layers = exposed_copy_seconds(units, blocking=config.optimizer_in_backward, **kwargs) + \
        (ga - 1) * exposed_copy_seconds(units, blocking=True, **kwargs)
    link = host_link(cluster)
    itemsize = moved_itemsize(config, precision.compute_itemsize(config.precision))
    # the root unit holds what the decoder layers do not (embeddings, final norm, head)
    root_up = max(0.0, shard * itemsize / link - sum(u.up for u in units))
    root_down = max(0.0, partition * itemsize / link - sum(u.down for u in units))
    fetches = 2 if config.zero == 3 else 1
    return host_step_seconds(cluster, config, partition=partition) + layers + ga * (fetches * root_up + root_down)


def offload_units(graph: LayerGraph, cluster: Cluster, config: Config,
                  nodes: Sequence[tuple[float, float]]) -> tuple[list[Unit], tuple[float, float, float]]:
    """Each decoder layer's FSDP2 unit in forward order (its micro-batch compute from `nodes`, collectives and
    PCIe copies of its shard), and the root's compute around them: forward before the first layer, backward after
    the last and before the first."""
    group, link = dp_group(cluster, config.tp, shard_ranks(config)), host_link(cluster)
    replicas, split = _replicas(cluster, config), sharding(config)
    itemsize = moved_itemsize(config, precision.compute_itemsize(config.precision))
    param_itemsize, reduce_itemsize = precision.compute_itemsize(config.precision), _reduce_itemsize(config)
    elements = {"tp": config.tp, "engine": config.engine, "ep": config.ep}
    units, by_kind = [], {}  # layers of one kind cost the same
    decoder = [(i, layer) for i, layer in enumerate(graph.nodes()) if layer.role is Role.DECODER]
    for index, layer in decoder:
        if layer.kind not in by_kind:
            trainable = tuple(p for p in layer.params if p.trainable)
            gathered = local_elements(layer.params, dp=1, sharded=False, **elements)
            reduced = local_elements(trainable, dp=1, sharded=False, **elements)
            held = local_elements(layer.params, dp=shard_ranks(config), sharded=split.params > 1, **elements)
            owned = local_elements(trainable, dp=shard_ranks(config), sharded=split.optimizer > 1, **elements)
            forward, backward = nodes[index]
            gather = all_gather_seconds(cluster, group, gathered * param_itemsize)
            reduce = gradient_reduce_seconds(cluster, group, replicas, reduced * reduce_itemsize) if reduced else 0.0
            by_kind[layer.kind] = Unit(forward=forward, backward=backward, gather=gather, reduce=reduce,
                                       up=held * itemsize / link, down=owned * itemsize / link)
        units.append(by_kind[layer.kind])
    first, last = (decoder[0][0], decoder[-1][0]) if decoder else (len(nodes), len(nodes))
    return units, (sum(f for f, _ in nodes[:first]), sum(b for _, b in nodes[last + 1:]),
                   sum(b for _, b in nodes[:first]))


def time_breakdown(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> TimeBreakdown:
    """Seconds per optimizer step for `config` (gradient accumulation included)."""
    terms = time_terms(graph, cluster, workload, config)
    compute, recompute, tp, cp = terms.fixed.compute, terms.fixed.recompute, 0.0, 0.0
    ep = 0.0  # expert-parallel all-to-alls
    for options, mode in zip(terms.layers, config.layer_modes(len(terms.layers)), strict=True):
        chosen = dict(options)[mode]
        ep += chosen.ep
        compute, recompute, tp = compute + chosen.compute, recompute + chosen.recompute, tp + chosen.tp
        cp += chosen.cp
    f = terms.fixed
    communication = f.communication + ep + tp + cp
    return TimeBreakdown(compute=compute, recompute=recompute, communication=communication, offload=f.offload,
                         optimizer=f.optimizer, step_time=compute + recompute + communication + f.offload + f.optimizer,
                         communication_total=f.communication_total + ep + tp + cp,
                         details=(("tp_collectives_decoder_layers", tp), ("cp_exposed", cp), *f.details,
                                  ("ep_all_to_all_exposed", ep), *launch_details(graph, cluster, workload, config)))


def launch_details(graph: LayerGraph, cluster: Cluster, workload: Workload,
                   config: Config) -> tuple[tuple[str, float], ...]:
    """Per step: host seconds to launch every kernel of forward, backward and recompute, and the part of it the
    device waits for (phases whose kernels finish faster than the host issues them), both already in compute."""
    graph, workload = context_parallel.rank_graph(graph, config.cp), context_parallel.rank_workload(workload, config)
    b, s = config.micro_batch, workload.seq_len
    speeds = {head: speed_for(graph, cluster, config, b=b, s=s, head=head) for head in (False, True)}
    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    kwargs = {"b": b, "s": s, "tp": config.tp, "sequence_parallel": config.sequence_parallel,
              "memory_speedup": memory_bound_speedup(config)}
    host = exposed = 0.0
    for layer in graph.nodes():
        cost = layer.cost(next(modes) if layer.role is Role.DECODER else Checkpoint.NONE)
        for work in (cost.forward, cost.backward, cost.recompute):
            launch = launch_seconds(work, speeds[layer.role is Role.HEAD])
            host += launch
            exposed += max(0.0, launch - device_seconds(work, speeds[layer.role is Role.HEAD], **kwargs))
    return ("kernel_launch_host", config.grad_accum * host), ("kernel_launch_exposed", config.grad_accum * exposed)


def _dp_seconds(graph: LayerGraph, cluster: Cluster, config: Config, *, forward: float,
                backward: float) -> tuple[float, float, float]:
    """(exposed per micro-batch, exposed per step, total) data-parallel collective seconds.

    What each engine overlaps: ZeRO-3/FSDP2 prefetch the next unit's all-gather behind the current unit's
    compute and reduce-scatter each unit's gradients behind the next unit's backward, so all but the edges
    hide while compute lasts; the first gather of a pass has nothing to hide behind (the root unit: embeddings,
    final norm and head, with the first layer) and neither does the last reduce-scatter (the same units, after
    the last backward). DDP and ZeRO-0/1 all-reduce in buckets during the last micro-batch's backward (Megatron's
    distributed optimizer reduce-scatters them there); the last bucket is exposed. ZeRO-2 reduce-scatters its
    buckets during every backward, the last one exposed; ZeRO-1/2's (and the distributed optimizer's) all-gather
    of the updated parameters after the step is exposed whole. A pipelined FSDP2 syncs once per step instead.
    """
    elements = local_elements(graph.tensor_groups(), tp=config.tp, dp=1, engine=config.engine, sharded=False,
                              ep=config.ep)
    trainable = local_elements(graph.tensor_groups(trainable=True), tp=config.tp, dp=1, engine=config.engine,
                               sharded=False, ep=config.ep)
    param_itemsize, grad_itemsize = precision.compute_itemsize(config.precision), _reduce_itemsize(config)
    expert_params, expert_grads = _expert_elements(graph, config)
    traffic = dp_traffic(config, param_bytes=(elements - expert_params) * param_itemsize,
                         grad_bytes=(trainable - expert_grads) * grad_itemsize)
    experts = dp_traffic(config, param_bytes=expert_params * param_itemsize,  # over the expert-data-parallel group
                         grad_bytes=expert_grads * grad_itemsize)
    group = dp_group(cluster, config.tp, shard_ranks(config))
    egroup = expert_dp_group(cluster, config)
    gather_f = (all_gather_seconds(cluster, group, traffic.forward_gather)
                + all_gather_seconds(cluster, egroup, experts.forward_gather))
    gather_b = (all_gather_seconds(cluster, group, traffic.backward_gather)
                + all_gather_seconds(cluster, egroup, experts.backward_gather))
    replicas = _replicas(cluster, config)
    reduce_b = (gradient_reduce_seconds(cluster, group, replicas, traffic.backward_reduce)
                + reduce_scatter_seconds(cluster, egroup, experts.backward_reduce))
    allreduce = (all_reduce_seconds(cluster, group, traffic.step_allreduce)
                 + all_reduce_seconds(cluster, egroup, experts.step_allreduce)
                 + reduce_scatter_seconds(cluster, group, traffic.step_reduce)
                 + reduce_scatter_seconds(cluster, egroup, experts.step_reduce))
    gather_step = (all_gather_seconds(cluster, group, traffic.step_gather)
                   + all_gather_seconds(cluster, egroup, experts.step_gather))
    edge_params, edge_grads = _edge_elements(graph, config)
    first_gather = all_gather_seconds(cluster, group, edge_params * param_itemsize) if gather_f else 0.0
    last_reduce = 0.0
    if reduce_b:
        bucketed = config.zero in rules_of(config.engine).bucketed_reduce_stages
        last = min(trainable, _allreduce_bucket_elements(graph, config)) if bucketed else edge_grads
        last_reduce = gradient_reduce_seconds(cluster, group, replicas, last * grad_itemsize)
    last_bucket = 0.0
    if allreduce:
        bucket = min(trainable, _allreduce_bucket_elements(graph, config)) * grad_itemsize
        reduce = all_reduce_seconds if traffic.step_allreduce or experts.step_allreduce else reduce_scatter_seconds
        last_bucket = reduce(cluster, group, bucket)
    per_mb = (first_gather + max(0.0, gather_f - first_gather - forward)
              + last_reduce + max(0.0, gather_b + reduce_b - last_reduce - backward))
    once, once_total = _once_per_step_seconds(cluster, (group, replicas), egroup, traffic, experts,
                                              edge=edge_params * param_itemsize, forward=forward)
    per_step = last_bucket + max(0.0, allreduce - last_bucket - backward) + gather_step + once
    total = config.grad_accum * (gather_f + gather_b + reduce_b) + allreduce + gather_step + once_total
    return per_mb, per_step, total


def _once_per_step_seconds(cluster: Cluster, groups: tuple[Group, Group], egroup: Group, traffic: DataParallelTraffic,
                           experts: DataParallelTraffic, *, edge: int, forward: float) -> tuple[float, float]:
    """(exposed, total) seconds of the collectives a pipelined FSDP2 runs once per step: the gathers of the first
    forward, prefetched behind it but for the first unit's (`edge` bytes), and the reduce-scatter after the last
    backward (with its all-reduce across hybrid-sharding replicas), exposed whole; `groups` are the shard and
    replica groups."""
    group, replicas = groups
    gather = (all_gather_seconds(cluster, group, traffic.first_forward_gather)
              + all_gather_seconds(cluster, egroup, experts.first_forward_gather))
    reduce = (gradient_reduce_seconds(cluster, group, replicas, traffic.end_reduce)
              + reduce_scatter_seconds(cluster, egroup, experts.end_reduce))
    first = all_gather_seconds(cluster, group, edge) if gather else 0.0
    return first + max(0.0, gather - first - forward) + reduce, gather + reduce


def _replicas(cluster: Cluster, config: Config) -> Group:
    """The hybrid-sharding replica group of one rank (`hybrid_shard`; one rank without it)."""
    return replica_group(cluster, config.tp, shard_ranks(config), config.dp_replicate)


def gradient_reduce_seconds(cluster: Cluster, group: Group, replicas: Group, nbytes: float) -> float:
    """A reduce-scatter of `nbytes` of gradients over the shard `group`, then the all-reduce of each rank's
    1 / group.size shard across the hybrid-sharding `replicas` (none with one), which FSDP2 issues after it
    (`hybrid_shard`). Priced one after the other: the all-reduce waits for its reduce-scatter's output."""
    return reduce_scatter_seconds(cluster, group, nbytes) + all_reduce_seconds(cluster, replicas, nbytes / group.size)


# A graph's element counts by what they read of a configuration (tp, engine, ep): the edge units' and the expert
# stacks', asked for by every configuration's data-parallel time.
_COUNTS: IdentityMemo[tuple[int, int]] = IdentityMemo()


def _edge_elements(graph: LayerGraph, config: Config) -> tuple[int, int]:
    """(parameter, trainable) elements of the units at the edges of a pass: the root unit (every non-decoder
    node: embeddings, final norm, head) with the first decoder layer, unsharded within the TP shard."""
    return _COUNTS.get((graph,), ("edge", config.tp, config.engine, config.ep), lambda: _edge_counts(graph, config))


def _edge_counts(graph: LayerGraph, config: Config) -> tuple[int, int]:
    layers = graph.decoder_layers()
    edge = [p for layer in graph.nodes() if layer.role is not Role.DECODER for p in layer.params]
    edge += list(layers[0].params) if layers else []
    count = local_elements(edge, tp=config.tp, dp=1, engine=config.engine, sharded=False, ep=config.ep)
    trainable = local_elements([p for p in edge if p.trainable], tp=config.tp, dp=1, engine=config.engine,
                               sharded=False, ep=config.ep)
    return count, trainable


def _expert_elements(graph: LayerGraph, config: Config) -> tuple[int, int]:
    """(parameter, trainable) elements of the expert stacks one rank holds under EP, unsharded within its TP
    shard; (0, 0) without EP."""
    if config.ep == 1:
        return 0, 0
    return _COUNTS.get((graph,), ("experts", config.tp, config.engine, config.ep),
                       lambda: _expert_counts(graph, config))


def _expert_counts(graph: LayerGraph, config: Config) -> tuple[int, int]:
    stacks = [(t, n) for t, n in graph.tensor_groups() if is_expert_stack(t)]
    count = local_elements(stacks, tp=config.tp, dp=1, engine=config.engine, sharded=False, ep=config.ep)
    trainable = local_elements([(t, n) for t, n in stacks if t.trainable], tp=config.tp, dp=1,
                               engine=config.engine, sharded=False, ep=config.ep)
    return count, trainable


def _allreduce_bucket_elements(graph: LayerGraph, config: Config) -> int:
    """The engine's gradient bucket: Megatron's by data-parallel size, DDP's fixed bytes (`bucket_cap_mb`), or
    DeepSpeed's `reduce_bucket_size` elements (the HF integration's hidden^2, `zero.py`)."""
    rules = rules_of(config.engine)
    if rules.bucket_elements is not None:
        return rules.bucket_elements(shard_ranks(config))
    fixed = rules.allreduce_bucket_bytes
    if fixed is None:
        return reduce_bucket_elements(graph.dims.hidden)
    return fixed // _reduce_itemsize(config)


def _reduce_itemsize(config: Config) -> int:
    return precision.reduce_itemsize(config.precision, config.engine, config.optimizer)
