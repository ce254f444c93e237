"""Context parallelism: each of `cp` ranks holds seq_len / cp tokens of every sequence, and attention passes keys
and values around a ring (torch 2.13's `_templated_ring_attention` with its p2p rotation, the scheme of Megatron/TE's
p2p CP; torchtitan's default all-gather rotation is not modelled) or re-shards sequence to heads with all-to-alls
(DeepSpeed-Ulysses). Per-rank shapes, FLOPs, traffic, overlap and buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

from graphs import Checkpoint, Layer, LayerGraph, ModeCost, Poly, Role, Work

from . import precision
from .activations import NodeMemory, evaluate
from .cluster import Cluster
from .collectives import all_to_all_seconds, cp_group, send_seconds
from .compute import KernelSpeed
from .config import Config, ContextParallel, Workload
from .terms import MemoryTerms

# Load-balanced causal sharding cuts each sequence into 2 x cp chunks and gives rank r chunks r and 2 cp - 1 - r
# (torch 2.13 `_context_parallel._load_balancer._HeadTailLoadBalancer`, torchtitan's default; Megatron-LM
# `get_batch_on_this_cp_rank`), so every rank does 1/cp of the causal attention work.
CHUNKS_PER_RANK = 2
# torch 2.13 `_ContextParallelOptions.convert_to_f32 = True`: the ring merges outputs and accumulates dK, dV and dQ
# in fp32, and passes dK, dV around the ring in fp32.
ACCUMULATE_ITEMSIZE = 4
# Attention implementations a CP runtime shards: SDPA (torch's CP dispatcher, torchtitan), flex attention
# (torchtitan's CP over FlexAttention) and Transformer Engine's flash attention ("te-flash", `graphs.megatron`:
# Megatron-LM runs CP through it); eager attention materialises the scores and megatron-core's local spec has no CP.
CP_ATTENTION = ("sdpa", "flex", "te-flash")


def local_seq_len(seq_len: int, cp: int) -> int:
    """Tokens of one sequence on one context-parallel rank."""
    return seq_len // cp


def rank_workload(workload: Workload, config: Config) -> Workload:
    """The workload as one context-parallel rank's shapes see it: sequences of seq_len / cp tokens."""
    if config.cp == 1:
        return workload
    return replace(workload, seq_len=local_seq_len(workload.seq_len, config.cp))


def kernel_seq_len(s_local: int, config: Config) -> int:
    """The sequence length one rank's attention kernels run at: the local chunks of a ring step, or the whole
    sequence (on heads / cp) after Ulysses' all-to-all."""
    return s_local * config.cp if config.cp_mode is ContextParallel.ALL_TO_ALL else s_local


def quadratic(poly: Poly) -> Poly:
    """The s^2 terms of `poly` (attention's score work)."""
    return Poly.of({m: c for m, c in poly.terms if m[1] == 2})


def balanced_work(work: Work, cp: int) -> Work:
    """`work` whose value at s / cp is one rank's share: linear terms are per token, but attention at s / cp
    covers only 1/cp^2 of the s^2 score work where a load-balanced rank does 1/cp of it, so its s^2 terms grow
    by cp."""
    extra = quadratic(work.attention_flops).scaled(Fraction(cp - 1))
    return replace(work, flops=work.flops + extra, attention_flops=work.attention_flops + extra)


def _balanced_cost(cost: ModeCost, cp: int) -> ModeCost:
    return replace(cost, forward=balanced_work(cost.forward, cp), backward=balanced_work(cost.backward, cp),
                   recompute=balanced_work(cost.recompute, cp))


def rank_graph(graph: LayerGraph, cp: int) -> LayerGraph:
    """`graph` with every node's work rescaled by `balanced_work`: evaluated at s / cp it gives one rank's FLOPs
    (memory polynomials are per token already, and CP needs no s^2 memory: `refusals`). Memoised on the graph."""
    if cp == 1:
        return graph
    key = f"context_parallel:{cp}"
    if key not in graph._memo:
        by_kind: dict[int, tuple[tuple[Checkpoint, ModeCost], ...]] = {}  # layers of one kind share their costs
        layers = []
        for layer in graph.nodes():
            if id(layer.modes) not in by_kind:
                by_kind[id(layer.modes)] = tuple((mode, _balanced_cost(cost, cp)) for mode, cost in layer.modes)
            layers.append(replace(layer, modes=by_kind[id(layer.modes)]))
        graph._memo[key] = replace(graph, layers=tuple(layers), _memo={})
    return graph._memo[key]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionShapes:
    """One rank's attention tensors for one micro-batch under CP, in bytes at the compute dtype."""

    q: int
    """Queries (and the attention output): b x s/cp x heads/tp x head_dim."""
    kv: int
    """Keys and values together: 2 x b x s/cp x kv_heads/tp x head_dim."""
    lse: int
    """The fp32 log-sum-exp of the output: b x heads/tp x s/cp."""
    itemsize: int


def attention_shapes(graph: LayerGraph, config: Config, *, b: int, s_local: int) -> AttentionShapes:
    """The local query and key/value shards of one decoder layer's attention (TP splits the heads)."""
    dims, tp = graph.dims, config.tp
    itemsize = precision.compute_itemsize(config.precision)
    heads, kv_heads = math.ceil(dims.heads / tp), math.ceil(dims.kv_heads / tp)
    tokens = b * s_local
    return AttentionShapes(q=tokens * heads * dims.head_dim * itemsize,
                           kv=2 * tokens * kv_heads * dims.head_dim * itemsize, lse=tokens * heads * 4,
                           itemsize=itemsize)


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    """Bytes one rank sends for one decoder layer's attention per micro-batch."""

    forward: int
    backward: int


def ring_traffic(shapes: AttentionShapes, cp: int) -> Traffic:
    """Ring attention: forward passes the local K, V shard on cp - 1 times; backward passes K, V on again (cp - 1)
    and dK, dV in fp32 cp times, the last hop bringing each shard's gradient home (torch 2.13
    `_templated_ring_attention(_backward)`)."""
    dkv = shapes.kv // shapes.itemsize * ACCUMULATE_ITEMSIZE
    return Traffic(forward=(cp - 1) * shapes.kv, backward=(cp - 1) * shapes.kv + cp * dkv)


def ulysses_traffic(shapes: AttentionShapes, cp: int) -> Traffic:
    """DeepSpeed-Ulysses: forward all-to-alls q, k, v (sequence to head shards) and the output back; backward the
    same four gradients. An all-to-all keeps 1/cp of its buffer and sends the rest (Jacobs et al. 2023, s. 3.1)."""
    per_pass = (2 * shapes.q + shapes.kv) * (cp - 1) // cp
    return Traffic(forward=per_pass, backward=per_pass)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionTime:
    """One rank's attention kernel seconds for one decoder layer per micro-batch (forward, backward)."""

    forward: float
    backward: float


def ring_seconds(cluster: Cluster, config: Config, shapes: AttentionShapes,
                 attention: AttentionTime) -> tuple[float, float, float]:
    """(forward exposed, backward exposed, total) seconds of the ring's sends for one layer per micro-batch.

    A ring of cp steps computes one chunk of attention per step (each 1/cp of the rank's work under load-balanced
    sharding) while the next K, V shard travels: a hop shows only where it outlasts the chunk. Backward sends
    K, V and the running dK, dV at once, and the last dK, dV hop follows the last chunk, with nothing to hide it.
    """
    cp, group = config.cp, cp_group(cluster, config.tp, config.cp)
    dkv = shapes.kv // shapes.itemsize * ACCUMULATE_ITEMSIZE
    hop_f, hop_b, last = (send_seconds(cluster, group, n) for n in (shapes.kv, shapes.kv + dkv, dkv))
    forward = (cp - 1) * max(0.0, hop_f - attention.forward / cp)
    backward = (cp - 1) * max(0.0, hop_b - attention.backward / cp) + last
    return forward, backward, (cp - 1) * (hop_f + hop_b) + last


def ulysses_seconds(cluster: Cluster, config: Config, shapes: AttentionShapes) -> tuple[float, float, float]:
    """(forward, backward, total) seconds of Ulysses' all-to-alls for one layer per micro-batch; DeepSpeed runs
    them between the projections and attention, which wait for them (none is hidden)."""
    group = cp_group(cluster, config.tp, config.cp)
    one_pass = sum(all_to_all_seconds(cluster, group, n) for n in (shapes.q, shapes.kv, shapes.q))
    return one_pass, one_pass, 2 * one_pass


def layer_seconds(cluster: Cluster, config: Config, shapes: AttentionShapes, attention: AttentionTime,
                  mode: Checkpoint) -> tuple[float, float]:
    """(exposed, total) CP communication seconds of one decoder layer per micro-batch in checkpoint `mode`: a
    layer whose attention is recomputed (full, selective) runs the forward exchange again in backward."""
    if config.cp == 1:
        return 0.0, 0.0
    if config.cp_mode is ContextParallel.RING:
        forward, backward, total = ring_seconds(cluster, config, shapes, attention)
    else:
        forward, backward, total = ulysses_seconds(cluster, config, shapes)
    again = mode in (Checkpoint.FULL, Checkpoint.SELECTIVE)
    return forward * (1 + again) + backward, total + again * forward


def buffer_bytes(shapes: AttentionShapes, config: Config) -> tuple[int, int]:
    """(forward, backward) bytes a decoder layer's CP attention holds at its peak beyond what local attention
    allocates (its output and log-sum-exp; its input gradients).

    Ring, as torch 2.13 `_templated_ring_attention` runs it: the K, V shard concatenated to send and the one
    received (double buffering); `_SDPAMerger` keeps the merged output in fp32 and, per step, the block's fp32
    copy, the correction product and the new output (four fp32 outputs), with the fp32 log-sum-exp. Backward: K, V
    received, concatenated to send and arriving (the rotater keeps the last one until the next exchange), the fp32
    dQ accumulator and its partially updated copy, four fp32 dK, dV shards (the one received, its updated copy,
    the one concatenated to send and the one arriving) and the last step's kernel gradients beside the returned
    ones. Ulysses: each all-to-all's output beside its input.
    """
    if config.cp == 1:
        return 0, 0
    if config.cp_mode is ContextParallel.ALL_TO_ALL:
        return 2 * shapes.q + shapes.kv, 2 * shapes.q + shapes.kv
    widen = ACCUMULATE_ITEMSIZE // shapes.itemsize
    fp32_q, fp32_kv = shapes.q * widen, shapes.kv * widen
    return 2 * shapes.kv + 4 * fp32_q + shapes.lse, 3 * shapes.kv + 2 * fp32_q + 4 * fp32_kv + shapes.q + shapes.kv


def cp_terms(graph: LayerGraph, config: Config, terms: MemoryTerms, *, b: int, s_local: int) -> MemoryTerms:
    """`terms` (already at one rank's s / cp tokens) with each decoder layer's CP buffers added to its engine
    transients (an upper bound, as they exist only while attention runs and are added to the layer's peak), and
    the ring's copy of the attention output (`output_copy_bytes`) where the layer keeps that output."""
    shapes = attention_shapes(graph, config, b=b, s_local=s_local)
    forward, backward = buffer_bytes(shapes, config)
    if not forward and not backward:
        return terms
    copy = output_copy_bytes(shapes, config)
    nodes = tuple(tuple((mode, _with_output_copy(node, mode, copy)) for mode, node in options)
                  if layer.role is Role.DECODER else options for layer, options in zip(graph.nodes(), terms.nodes,
                                                                                       strict=True))
    extra = tuple((f + forward, keep, bw + backward) if layer.role is Role.DECODER else (f, keep, bw)
                  for layer, (f, keep, bw) in zip(graph.nodes(), terms.extra, strict=True))
    return replace(terms, nodes=nodes, extra=extra)


def output_copy_bytes(shapes: AttentionShapes, config: Config) -> int:
    """Bytes of the attention-output copy the ring adds on every rank but the last. SDPA's kernels return the
    output laid out as (b, s, heads, d), so the o_proj input (b, s, heads x d) is a view of the saved output; torch
    2.13's ring merges a rank's partial steps with `torch.cat` (`_partial_update`), which returns the (b, heads, s,
    d) layout, so that input becomes a copy kept beside the output (measured on gloo ranks, the tests)."""
    return shapes.q if config.cp > 1 and config.cp_mode is ContextParallel.RING else 0


def _with_output_copy(node: NodeMemory, mode: Checkpoint, copy: int) -> NodeMemory:
    """A decoder layer with the ring's output copy: kept from forward to backward where the layer saves the
    attention output (no recompute, op-level SAC), made again during a full recompute."""
    if mode in (Checkpoint.NONE, Checkpoint.OP_SELECTIVE):
        return replace(node, saved=node.saved + copy, fwd_net=node.fwd_net + copy, fwd_peak=node.fwd_peak + copy,
                       bwd_net=node.bwd_net - copy)
    if mode is Checkpoint.FULL:
        return replace(node, bwd_peak=node.bwd_peak + copy, bwd_peak_fresh=node.bwd_peak_fresh + copy)
    return node


def node_seconds(graph: LayerGraph, cluster: Cluster, config: Config, layer: Layer, mode: Checkpoint,
                 speed: KernelSpeed, *, b: int, s_local: int) -> tuple[float, float]:
    """(exposed, total) CP communication seconds of one node per micro-batch; `layer` is `rank_graph`'s, so its
    attention FLOPs at s / cp are the rank's share (0 outside decoder layers and at cp = 1)."""
    if config.cp == 1 or layer.role is not Role.DECODER:
        return 0.0, 0.0
    cost = layer.cost(mode)
    kernel = [evaluate(w.attention_flops, b=b, s=s_local, tp=config.tp, sequence_parallel=False)
              / speed.attention_flops for w in (cost.forward, cost.backward)]
    shapes = attention_shapes(graph, config, b=b, s_local=s_local)
    return layer_seconds(cluster, config, shapes, AttentionTime(forward=kernel[0], backward=kernel[1]), mode)


def notes(config: Config) -> tuple[str, ...]:
    """What the context-parallel costs assume, in words (none at cp = 1)."""
    if config.cp == 1:
        return ()
    if config.cp_mode is ContextParallel.ALL_TO_ALL:
        how = ("all-to-all (Ulysses): q, k, v and the output re-sharded from sequence to heads and back in every "
               "layer, not overlapped")
    else:
        how = ("ring: K, V shards passed on cp - 1 times per layer (dK, dV in fp32 in backward), each hop hidden "
               "behind one chunk of attention where it is shorter; buffers and merges as torch 2.13's ring runs them")
    return (f"context parallelism cp={config.cp}: each rank holds seq_len / cp tokens (two load-balanced chunks "
            f"per sequence) and 1/cp of the causal attention work; {how}",)


def refusals(graph: LayerGraph, config: Config) -> list[str]:
    """Why context parallelism cannot run this model as configured (empty when cp = 1)."""
    if config.cp == 1:
        return []
    reasons = []
    if graph.attention not in CP_ATTENTION:
        reasons.append(f"cp={config.cp} needs SDPA or flex attention (torch's and torchtitan's CP shard those), not "
                       f"{graph.attention}")
    ranks = config.tp * config.cp
    dims = graph.dims
    if config.cp_mode is ContextParallel.ALL_TO_ALL and (dims.heads % ranks or dims.kv_heads % ranks):
        reasons.append(f"cp_mode=all-to-all gives each of tp x cp = {ranks} ranks whole heads: {graph.model} has "
                       f"{dims.heads} query and {dims.kv_heads} key/value heads (use cp_mode=ring)")
    return reasons


def sequence_problem(seq_len: int, cp: int) -> str | None:
    """Why `seq_len` cannot be split over `cp` ranks with load-balanced causal sharding, or None."""
    if cp > 1 and seq_len % (CHUNKS_PER_RANK * cp):
        return (f"seq_len {seq_len} must divide into 2 x cp = {CHUNKS_PER_RANK * cp} equal chunks (load-balanced "
                "causal sharding gives each context-parallel rank two)")
    return None

