"""Expert parallelism (EP) of MoE layers: each rank keeps `experts / ep` of every expert stack and tokens reach
their experts by all-to-all. Priced as Megatron runs it (megatron-core parallel_state.py): experts divided over
ep ranks carved from the data- and context-parallel ranks, expert tensor parallelism equal to tp (its default)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from graphs import Checkpoint, Layer, LayerGraph, ParamTensor

from . import collectives
from .activations import NodeMemory
from .cluster import Cluster
from .collectives import Group, all_gather_seconds, reduce_scatter_seconds, tp_group
from .compute import KernelSpeed
from .config import Config

# Routing-imbalance allowance on expert compute and expert activations when experts are spread over ranks: the
# busiest expert rank is priced at 1.25x its balanced share of token-expert pairs. 1.25 is the expert capacity
# factor of Switch Transformer's training runs (Fedus et al. 2022, JMLR 23(120), §2.2 and Table 1: capacity factor
# 1.25 beside 1.0 and 2.0); Megatron run with `--moe-expert-capacity-factor 1.25 --moe-pad-expert-input-to-capacity`
# computes exactly this on every expert. Balanced routing (each rank all experts, ep=1) needs no allowance.
ROUTING_IMBALANCE = 1.25
# Bytes the HF grouped-mm experts save per token-expert pair besides activations in the compute dtype: the
# int64 token index and its sort order (transformers 5 `grouped_mm` experts; tests/costmodels/test_expert_parallel.py
# reads them back with saved-tensor hooks).
INDEX_BYTES_PER_PAIR = 2 * 8
# All-to-alls per MoE layer per micro-batch: dispatch and combine in forward, their gradients in backward
# (Megatron MoEAlltoAllTokenDispatcher: token_dispatch and token_combine, each an autograd all-to-all).
ALL_TO_ALLS_FORWARD = 2
ALL_TO_ALLS_BACKWARD = 2


@dataclass(frozen=True, slots=True)
class ExpertTime:
    """Seconds one MoE layer adds per micro-batch under expert parallelism, in one checkpoint mode."""

    compute: float
    """The imbalance allowance on the expert GEMMs, forward and backward."""
    recompute: float
    """The allowance on the recomputed expert GEMMs (full checkpointing)."""
    all_to_all: float
    """Dispatch and combine all-to-alls, and with tp > 1 the expert-TP all-gather and reduce-scatter of the
    received tokens, not overlapped (Megatron overlaps them only with --overlap-moe-expert-parallel-comm)."""


def is_expert_stack(tensor: ParamTensor) -> bool:
    """Whether `tensor` is a stack of routed experts (experts, out, in): transformers 5's fused MoE experts are the
    only 3-D parameters of the lowered models (graphs/structure.py `shard_dim`)."""
    return len(tensor.shape) == 3


def expert_local_shape(shape: tuple[int, ...], ep: int) -> tuple[int, ...]:
    """The shape a rank keeps of an expert stack: its `experts / ep` local experts (ep divides experts:
    `refusals`), the other dims whole."""
    if ep == 1 or len(shape) != 3:
        return shape
    return (math.ceil(shape[0] / ep), *shape[1:])


def expert_dp(dp: int, ep: int) -> int:
    """Ranks an expert's states are sharded over: the data-parallel group with the ep ranks carved out (Megatron's
    expert data parallel, world / (etp x ep x pp); torchtitan's dp_shard_mod_ep)."""
    return max(1, dp // ep)


def state_ranks(tensor: ParamTensor, dp: int, ep: int) -> int:
    """Ranks `tensor`'s sharded states are split over: `dp`, or `expert_dp` for an expert stack under EP."""
    return expert_dp(dp, ep) if ep > 1 and is_expert_stack(tensor) else dp


def ep_group(cluster: Cluster, tp: int, ep: int) -> Group:
    """The ep ranks of one expert-parallel group: Megatron's expert rank order tp-ep-dp-pp puts them tp apart
    (expert_decoder_rank_generator, cp folded into ep x dp), so they leave the node once tp x ep exceeds it."""
    return Group(ep, tp * ep > cluster.gpus_per_node, max(1, cluster.gpus_per_node // tp))


def expert_dp_group(cluster: Cluster, config: Config) -> Group:
    """The ranks that reduce one expert's gradients: the expert-data-parallel group, tp x ep apart in Megatron's
    expert rank order (tp-ep-dp-pp), so a node holds gpus_per_node / (tp x ep) of them (at least one)."""
    ranks = expert_dp(config.dp * config.cp, config.ep)
    stride = config.tp * config.ep
    return Group(ranks, stride * ranks > cluster.gpus_per_node, max(1, cluster.gpus_per_node // stride))


def moe_layers(graph: LayerGraph) -> list[Layer]:
    return [layer for layer in graph.decoder_layers() if layer.moe]


def refusals(graph: LayerGraph, config: Config) -> list[str]:
    """Why `config.ep` cannot run on this model."""
    if config.ep == 1:
        return []
    experts = {layer.moe.experts for layer in moe_layers(graph) if layer.moe}
    if not experts:
        return [f"ep={config.ep} needs a mixture-of-experts model; {graph.model} is dense"]
    bad = sorted(e for e in experts if e % config.ep)
    if bad:
        return [f"ep={config.ep} must divide the {bad[0]} experts of {graph.model}'s MoE layers (each rank holds "
                "experts / ep of them)"]
    if config.tp > 1 and not config.sequence_parallel:
        # megatron-core TransformerConfig.__post_init__: "When using expert parallelism and tensor parallelism,
        # sequence parallelism must be used".
        return [f"ep={config.ep} with tp={config.tp} needs sequence_parallel (Megatron refuses it otherwise)"]
    return []


def expert_refusal(graph: LayerGraph, config: Config) -> tuple[str, str] | None:
    """(why, a way out) when `config.ep` cannot run on this model, else None."""
    problems = refusals(graph, config)
    if not problems:
        return None
    degrees = valid_degrees(graph, config.dp * config.cp)
    return problems[0], f"Choose ep from {degrees}: it must divide the experts and dp x cp."


def valid_degrees(graph: LayerGraph, ranks: int) -> list[int]:
    """Expert-parallel degrees `graph` allows over `ranks` data- and context-parallel ranks."""
    experts = math.gcd(*[layer.moe.experts for layer in moe_layers(graph) if layer.moe]) if moe_layers(graph) else 1
    return [d for d in range(1, ranks + 1) if ranks % d == 0 and experts % d == 0]


def dispatch_bytes(layer: Layer, config: Config, *, b: int, s: int, hidden: int, itemsize: int) -> int:
    """Bytes one rank sends in one all-to-all of `layer`: its b x s tokens' hidden states, once per routed expert
    (top_k), in the compute dtype; with sequence parallelism a TP rank holds s / tp of the tokens."""
    if config.ep == 1 or layer.moe is None:
        return 0
    tokens = math.ceil(b * s / config.tp) if config.sequence_parallel else b * s
    return tokens * layer.moe.top_k * hidden * itemsize


def expert_saved_bytes(layer: Layer, config: Config, *, b: int, s: int, hidden: int, itemsize: int) -> int:
    """Bytes the routed experts of `layer` save for backward on one rank under balanced routing: per token-expert
    pair the permuted input, the gate/up projection's output and the two halves the activation keeps (each
    `gate_up` wide, after TP), the routing weight, and the token indices."""
    if layer.moe is None:
        return 0
    gate_up = sum(_local_n(t, config.tp) for t in layer.params if is_expert_stack(t) and t.shape[2] == hidden)
    pairs = b * s * layer.moe.top_k
    return pairs * (itemsize * (hidden + 2 * gate_up + 1) + INDEX_BYTES_PER_PAIR)


def _local_n(tensor: ParamTensor, tp: int) -> int:
    """Output width of an expert stack on one TP rank (column-parallel stacks split it: `graphs.structure`)."""
    n = tensor.shape[1]
    return math.ceil(n / tp) if tensor.tp_dim == 1 else n


def expert_flops(layer: Layer, tp: int, *, b: int, s: int) -> float:
    """Forward FLOPs of `layer`'s routed experts on one TP rank under balanced routing: 2 n k per token-expert
    pair and stack (each rank runs b x s x top_k pairs whatever ep is, on its local experts)."""
    if layer.moe is None:
        return 0.0
    total = 0
    for tensor in layer.params:
        if is_expert_stack(tensor):
            _, n, k = tensor.shape
            n, k = (math.ceil(n / tp), k) if tensor.tp_dim == 1 else (n, math.ceil(k / tp)) if tensor.tp_dim == 2 \
                else (n, k)
            total += 2 * n * k
    return float(total * b * s * layer.moe.top_k)


def layer_time(cluster: Cluster, config: Config, layer: Layer, mode: Checkpoint, speed: KernelSpeed, *, b: int,
               s: int, hidden: int, itemsize: int) -> ExpertTime:
    """What expert parallelism adds to one MoE layer per micro-batch: the imbalance allowance on its expert GEMMs
    (backward twice the forward) and its all-to-alls, rerun with the forward under full recompute (op-level SAC
    saves all-to-all outputs: graphs/sac.py)."""
    if config.ep == 1 or layer.moe is None:
        return ExpertTime(0.0, 0.0, 0.0)
    extra = (ROUTING_IMBALANCE - 1) * expert_flops(layer, config.tp, b=b, s=s) / speed.matmul_flops
    sent = ROUTING_IMBALANCE * dispatch_bytes(layer, config, b=b, s=s, hidden=hidden, itemsize=itemsize)
    one = collectives.all_to_all_seconds(cluster, ep_group(cluster, config.tp, config.ep), sent)
    # Expert TP (= tp, sequence parallel): the dispatcher all-gathers the received tokens over the TP ranks
    # before the experts and reduce-scatters their output after (megatron-core MoEAlltoAllTokenDispatcher), and
    # the reverse in backward: one all-gather and one reduce-scatter of tp x `sent` bytes per all-to-all pair.
    group = tp_group(cluster, config.tp)
    one += (all_gather_seconds(cluster, group, config.tp * sent)
            + reduce_scatter_seconds(cluster, group, config.tp * sent)) / 2
    rerun = mode is Checkpoint.FULL
    count = ALL_TO_ALLS_FORWARD * (2 if rerun else 1) + ALL_TO_ALLS_BACKWARD
    return ExpertTime(compute=3 * extra, recompute=extra if rerun else 0.0, all_to_all=count * one)


def with_dispatch(node: NodeMemory, layer: Layer, mode: Checkpoint, config: Config, *, b: int, s: int, hidden: int,
                  itemsize: int) -> NodeMemory:
    """`node` with what expert parallelism adds to an MoE layer: the receive buffer of each all-to-all (one at a
    time, forward and backward; the send buffer is the permuted tokens the lowering already holds) and the
    imbalance allowance on the expert activations, saved until backward, or recomputed inside it under full
    checkpointing. Activations are otherwise not divided by ep: each rank still runs b x s x top_k pairs."""
    if config.ep == 1 or layer.moe is None:
        return node
    received = math.ceil(ROUTING_IMBALANCE * dispatch_bytes(layer, config, b=b, s=s, hidden=hidden,
                                                            itemsize=itemsize))
    extra = math.ceil((ROUTING_IMBALANCE - 1) * expert_saved_bytes(layer, config, b=b, s=s, hidden=hidden,
                                                                   itemsize=itemsize))
    # The lowering traced every expert's gradient; a rank produces only its local experts'.
    foreign = sum(t.local_numel(config.tp) * t.itemsize for t in layer.params if is_expert_stack(t) and t.trainable)
    foreign -= foreign // config.ep
    node = replace(node, grads=node.grads - foreign,
                   bwd_peak_fresh=max(node.bwd_peak, node.bwd_peak_fresh - foreign))
    if mode is Checkpoint.FULL:
        return replace(node, fwd_peak=node.fwd_peak + received, bwd_peak=node.bwd_peak + received + extra,
                       bwd_peak_fresh=node.bwd_peak_fresh + received + extra)
    return replace(node, saved=node.saved + extra, fwd_net=node.fwd_net + extra,
                   fwd_peak=node.fwd_peak + received + extra, bwd_net=node.bwd_net - extra,
                   bwd_peak=node.bwd_peak + received, bwd_peak_fresh=node.bwd_peak_fresh + received)


def expert_notes(config: Config) -> tuple[str, ...]:
    """What the estimate assumes for expert parallelism, in words."""
    if config.ep == 1:
        return ()
    return (f"expert parallelism ep={config.ep}: experts divided over ep ranks (expert tensor parallelism = "
            f"tp={config.tp}, Megatron's default), their gradients and optimizer states sharded over the "
            f"{expert_dp(config.dp * config.cp, config.ep)} expert-data-parallel ranks where the engine shards; "
            f"routing imbalance allowance x{ROUTING_IMBALANCE:g} on expert activations and compute; 4 all-to-alls "
            "per MoE layer and micro-batch (6 under full recompute), not overlapped",)
