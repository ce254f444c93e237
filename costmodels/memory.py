"""Peak memory per GPU: model states, the activation timeline with engine buffers, the optimizer step, and the
runtime overhead outside PyTorch's allocator."""

from __future__ import annotations

import math
import operator
from dataclasses import replace

from graphs import Checkpoint, Layer, LayerGraph, Poly, Role

from . import context_parallel, precision
from .activation_offload import host_bytes, moved_bytes, offload_terms
from .activations import NodeMemory, Peak, evaluate, node_memory, walk_phases
from .breakdown import MemoryBreakdown
from .cluster import Cluster
from .config import Config, Offload, Workload
from .engines import UnitBytes, rules_of
from .expert_parallel import with_dispatch
from .loss import loss_terms
from .optimizer_in_backward import in_backward_timeline
from .overhead import fragmentation_risk_bytes, reserved_bytes, runtime_overhead
from .post_training import post_training_terms
from .states import model_states
from .terms import MemoryTerms, ModelStates
from .zero import (
    local_elements,
    persistence_threshold,
    prefetch_bucket_elements,
    reduce_bucket_elements,
    shard_ranks,
    syncs_once_pipelined,
)


def memory_terms(graph: LayerGraph, workload: Workload, config: Config) -> MemoryTerms:
    """The memory terms of `config`; the memory-saving knobs apply in this order, each to the terms before it:
    the optimizer's states (paged, in backward: `model_states`), the in-backward timeline, the loss's head and
    loss nodes, then activation offload (which moves what the earlier steps left saved)."""
    held = layer_buffer_bytes(graph, workload.seq_len)  # sized for the whole sequence
    workload = context_parallel.rank_workload(workload, config)  # one rank's s / cp tokens from here on
    terms = replace(_plain_terms(graph, workload, config), buffers=held)
    if config.optimizer_in_backward:
        terms = in_backward_timeline(graph, config, terms)
    terms = loss_terms(graph, config, terms, config.loss, seq_len=workload.seq_len)
    if workload.post is not None and workload.post.fused_head:  # TRL's fused log-prob head and reference
        terms = post_training_terms(graph, config, terms, workload.post, seq_len=workload.seq_len)
    terms = landed_grads(graph, config, terms)  # after the loss's own head node, whose weight gradient lands too
    terms = context_parallel.cp_terms(graph, config, terms, b=config.micro_batch, s_local=workload.seq_len)
    if config.activation_offload:
        terms = offload_terms(terms)
    return terms


def _plain_terms(graph: LayerGraph, workload: Workload, config: Config) -> MemoryTerms:
    states = model_states(graph, config)
    b, s = config.micro_batch, workload.seq_len
    by_kind: dict[int, tuple[tuple[Checkpoint, NodeMemory], ...]] = {}  # layers of one kind cost the same
    nodes = []
    for layer in graph.nodes():
        if layer.role is not Role.DECODER:
            nodes.append(((Checkpoint.NONE, node_memory(layer, Checkpoint.NONE, b=b, s=s, config=config)),))
            continue
        if layer.kind not in by_kind:
            # expert parallelism's all-to-all buffers and routing-imbalance allowance on MoE layers
            by_kind[layer.kind] = tuple((mode, with_dispatch(node_memory(layer, mode, b=b, s=s, config=config), layer,
                                                             mode, config, b=b, s=s, hidden=graph.dims.hidden,
                                                             itemsize=precision.compute_itemsize(config.precision)))
                                        for mode in layer.checkpoint_modes)
        nodes.append(by_kind[layer.kind])
    start, forward_only = model_wide_bytes(graph, config, b=b, s=s)
    accumulate = states.accumulating_grads > 0
    walks = [(accumulate, 0)]
    if accumulate and config.grad_accum > 1:
        walks.append((False, states.accumulating_grads))  # later micro-batches: gradients already allocated
    return MemoryTerms(states=states, start=start, forward_only=forward_only, nodes=tuple(nodes),
                       names=tuple(layer.name for layer in graph.nodes()),
                       extra=tuple(engine_buffers(graph, config)), walks=tuple(walks))


def layer_buffer_bytes(graph: LayerGraph, seq_len: int) -> int:
    """Module buffers the graph's decoder layers hold for the run (`LayerGraph.layer_buffers`): allocated once
    beside the states, never per micro-batch, so a pipeline rank holds its own layers' whatever its in-flight
    micro-batches."""
    return graph.layer_buffers.scaled(len(graph.decoder_layers()))(1, seq_len)


def landed_grads(graph: LayerGraph, config: Config, terms: MemoryTerms) -> MemoryTerms:
    """`terms` where gradients land sharded (`EngineRules.grads_land_sharded`, FSDP2): each node's backward leaves
    its reduce-scattered shard in the reduce dtype instead of the unsharded gradients it traced, which are freed
    once reduced (its handed-off peak, with the engine's unsharded-gradient buffer)."""
    if not rules_of(config.engine).grads_land_sharded:
        return terms
    reduce = precision.reduce_itemsize(config.precision, config.engine, config.optimizer)
    # under torch's pipelining FSDP2 keeps each unit's gradients unsharded, upcast to the reduce dtype
    # (FSDPParam.to_accumulated_grad_if_needed), until the step's one reduce-scatter: they land whole
    whole = syncs_once_pipelined(config)
    shards: dict[object, int] = {}  # layers of one kind hold the same shard
    for layer in graph.nodes():
        key = layer.kind if layer.role is Role.DECODER else layer.name
        if key not in shards:
            shards[key] = reduce * local_elements([t for t in layer.params if t.trainable], tp=config.tp,
                                                  dp=1 if whole else shard_ranks(config), engine=config.engine,
                                                  sharded=not whole, ep=config.ep)
    keys = [layer.kind if layer.role is Role.DECODER else layer.name for layer in graph.nodes()]
    landed: dict[tuple[object, int], tuple[tuple[Checkpoint, NodeMemory], ...]] = {}  # layers of one kind share
    for key, options in zip(keys, terms.nodes, strict=True):
        if (key, id(options)) not in landed:
            landed[key, id(options)] = tuple((mode, replace(node, grads=shards[key], bwd_peak_fresh=node.bwd_peak))
                                             for mode, node in options)
    return replace(terms, nodes=tuple(landed[key, id(options)] for key, options in zip(keys, terms.nodes,
                                                                                         strict=True)))


def allocated_peak(terms: MemoryTerms, modes: tuple[Checkpoint, ...]) -> tuple[int, Peak, int]:
    """(allocated peak bytes, the micro-batch peak it comes from, gradient bytes allocated before it)."""
    choice = iter(modes)
    nodes = [dict(options)[next(choice)] if options[0][1].decoder else options[0][1] for options in terms.nodes]
    spans = terms.stage_spans()
    others = others_at_most(terms, nodes)
    candidates = []
    for fresh, before in terms.walks:
        for t, span in enumerate(spans):
            phases = walk_phases(nodes[span.first:span.stop], start=span.start, forward_only=span.forward_only,
                                 fresh_grads=fresh, extra=terms.extra[span.first:span.stop],
                                 names=terms.names[span.first:span.stop])
            for forward, peak in zip((True, False), phases, strict=True):
                if (t, forward) in others:
                    held = others[t, forward] + (span.other_grads if fresh else 0)
                    candidates.append((_with_others(peak, held, terms.buffers), before))
    step = Peak(bytes=terms.states.step_temp + terms.buffers, at="optimizer step", activations=0, grads=0)
    candidates.append((step, terms.states.accumulating_grads))
    peak, before = max(candidates, key=lambda item: item[0].bytes + item[1])
    return terms.states.gpu_total + before + peak.bytes, peak, before


def held_by_stage(terms: MemoryTerms, nodes: list[NodeMemory]) -> list[tuple[int, int]]:
    """Per stage, (bytes one micro-batch keeps from the end of its forward until its backward, the part of them
    still kept after a zero-bubble input step): `activations.walk`'s live set then."""
    held = []
    for span in terms.stage_spans():
        kept = [node.fwd_net - node.released_after_forward for node in nodes[span.first:span.stop]]
        full = terms.kept_base(span) + sum(kept)
        held.append((full, full - sum(kept[span.input_frees_from - span.first:])))
    return held


def others_at_most(terms: MemoryTerms, nodes: list[NodeMemory]) -> dict[tuple[int, bool], int]:
    """Per (running stage, forward), the most bytes the other in-flight micro-batches hold over its moments."""
    held = held_by_stage(terms, nodes)
    weights = tuple(full for full, _ in held) + tuple(after for _, after in held)  # per set: full, after input
    others: dict[tuple[int, bool], int] = {}
    for moment in terms.moment_list():
        value = sum(map(operator.mul, moment.full + moment.after_input, weights))
        key = (moment.stage, moment.forward)
        others[key] = max(others.get(key, value), value)
    return others


def _with_others(peak: Peak, others: int, buffers: int) -> Peak:
    """A micro-batch's peak with the other in-flight micro-batches' kept activations and the step's buffers."""
    if not others and not buffers:
        return peak
    return Peak(bytes=peak.bytes + others + buffers, at=peak.at, activations=peak.activations + others,
                grads=peak.grads)


def memory_breakdown(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, *,
                     terms: MemoryTerms | None = None) -> MemoryBreakdown:
    """The allocated and device peaks of one rank and their breakdown at the allocated peak; `terms` when the
    caller has them (a pipeline rank's, with its stages and schedule: `pipeline_stages.rank_memory_terms`)."""
    terms = terms or memory_terms(graph, workload, config)
    states = terms.states
    allocated, peak, grads_before = allocated_peak(terms, config.layer_modes(len(graph.decoder_layers())))
    grads = states.grads + grads_before + peak.grads
    temporary = allocated - states.params - grads - states.master - states.optimizer - peak.activations
    overhead = runtime_overhead(cluster, config)
    reserved = reserved_bytes(allocated, config.expandable_segments)
    risk = fragmentation_risk_bytes(allocated, config.expandable_segments)
    cpu, nvme = offload_bytes(cluster, config, states)
    cpu += activation_host_bytes(graph, cluster, workload, config)
    return MemoryBreakdown(parameters=states.params, gradients=grads, optimizer_states=states.master + states.optimizer,
                           activations=peak.activations, temporary=temporary, allocated_peak=allocated,
                           reserved_peak=reserved, overhead=overhead, device_peak=reserved + overhead,
                           peak_at=peak.at, cpu_bytes_per_node=cpu, nvme_bytes_per_node=nvme,
                           fragmentation_risk=risk)


def activation_host_bytes(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> int:
    """Pinned host RAM per node that offloaded activations take (0 without activation offload)."""
    if not config.activation_offload:
        return 0
    moved = moved_bytes(graph, config, b=config.micro_batch, s=context_parallel.rank_workload(workload, config).seq_len)
    return host_bytes(moved, min(cluster.gpus_per_node, config.world_size))


def model_wide_bytes(graph: LayerGraph, config: Config, *, b: int, s: int) -> tuple[int, int]:
    """(bytes alive before the first node, part of it gone before backward) of model-wide tensors."""
    def at(poly: Poly) -> int:
        return evaluate(poly, b=b, s=s, tp=config.tp, sequence_parallel=config.sequence_parallel)

    checkpointed = any(m is not Checkpoint.NONE for m in config.layer_modes(len(graph.decoder_layers())))
    start = at(graph.inputs) + at(graph.shared) + at(graph.checkpoint_shared) + at(graph.forward_shared)
    return start, at(graph.forward_shared) + (0 if checkpointed else at(graph.checkpoint_shared))


def offload_bytes(cluster: Cluster, config: Config, states: ModelStates) -> tuple[int, int]:
    """Host RAM and NVMe per node for the offloaded states of its ranks."""
    ranks = min(cluster.gpus_per_node, config.world_size)
    factor = rules_of(config.engine).host_buffer_factor
    return math.ceil(states.cpu * ranks * factor), states.nvme * ranks


def _gathered(graph: LayerGraph, config: Config, layer: Layer) -> int:
    """Bytes of one node's parameters gathered whole (within its TP shard) in the compute dtype."""
    tensors = [t for t in layer.params if not t.quantized  # kept whole on every rank (states._param_bytes)
               and not (config.zero in rules_of(config.engine).small_params_whole_stages
                        and t.numel <= persistence_threshold(graph.dims.hidden))]
    itemsize = precision.compute_itemsize(config.precision)
    return itemsize * local_elements(tensors, tp=config.tp, dp=1, engine=config.engine, sharded=False, ep=config.ep)


def _unsharded_grads(config: Config, layer: Layer) -> int:
    """An FSDP2 unit's full gradients before reduce-scatter, plus their fp32 copy when reducing in fp32."""
    elements = local_elements([t for t in layer.params if t.trainable], tp=config.tp, dp=1, engine=config.engine,
                              sharded=False, ep=config.ep)
    fp32_reduce = precision.is_mixed(config.precision) and rules_of(config.engine).reduce_fp32_when_mixed
    reduce_copy = 4 if fp32_reduce else 0
    return elements * (precision.compute_itemsize(config.precision) + reduce_copy)


def engine_buffers(graph: LayerGraph, config: Config) -> list[tuple[int, int, int]]:
    """Per node: (forward transient, kept from forward to backward, backward transient) engine bytes
    (`EngineRules.buffers`)."""
    layers = graph.nodes()
    rules = rules_of(config.engine)
    gathered = grads = [0] * len(layers)
    if rules.sharded(config.zero)[0]:  # parameters gathered per unit
        keys = [layer.kind if layer.kind is not None else layer.name for layer in layers]
        per_kind: dict[object, tuple[int, int]] = {}  # layers of one kind gather the same bytes
        for layer, key in zip(layers, keys, strict=True):
            if key not in per_kind:
                per_kind[key] = (_gathered(graph, config, layer), _unsharded_grads(config, layer))
        gathered = [per_kind[key][0] for key in keys]
        grads = [per_kind[key][1] for key in keys]
    if syncs_once_pipelined(config):  # gathered for the whole step (`pipelined_gathered`); backward's unsharded
        # gradients in the compute dtype, added into the accumulated ones `landed_grads` holds, then freed
        itemsize = precision.compute_itemsize(config.precision)
        return [(0, 0, itemsize * local_elements([t for t in layer.params if t.trainable], tp=config.tp, dp=1,
                                                 engine=config.engine, sharded=False, ep=config.ep))
                for layer in layers]
    prefetch = precision.compute_itemsize(config.precision) * prefetch_bucket_elements(graph.dims.hidden)
    return rules.buffers(config.zero, UnitBytes(gathered=gathered, grads=grads, bucket=_bucket_bytes(graph, config),
                                                prefetch=prefetch))


def pipelined_gathered(graph: LayerGraph, config: Config) -> int:
    """Parameters a pipeline rank keeps gathered from its first forward until the step's reduce-scatter, where its
    engine syncs once per step (FSDP2 under torch's pipelining: `set_reshard_after_backward(False)`), else 0."""
    if not syncs_once_pipelined(config):
        return 0
    return sum(_gathered(graph, config, layer) for layer in graph.nodes())


def _bucket_bytes(graph: LayerGraph, config: Config) -> int:
    """ZeRO's double-buffered reduce bucket (overlap_comm=true), capped by the gradients there are."""
    trainable = sum(t.numel * n for t, n in graph.tensor_groups(trainable=True))
    elements = min(reduce_bucket_elements(graph.dims.hidden), trainable)
    return 2 * elements * precision.grad_itemsize(config.precision, config.engine)


__all__ = ["Offload", "memory_breakdown"]
