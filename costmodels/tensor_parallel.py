"""Tensor parallelism's collectives: per-layer all-reduces of the boundary activation (Shoeybi et al. 2019)."""

from __future__ import annotations

from graphs import Checkpoint, Layer, LayerGraph, Role

from . import precision
from .activations import evaluate
from .cluster import Cluster
from .collectives import all_gather_seconds, all_reduce_seconds, tp_group
from .config import Config


def tp_node_seconds(graph: LayerGraph, cluster: Cluster, config: Config, layer: Layer, mode: Checkpoint, *,
                    b: int, s: int) -> float:
    """Seconds of one node's TP collectives per micro-batch (forward, backward and recompute); not overlapped.

    Each row-wise module all-reduces its output in forward and each column-wise group all-reduces its input
    gradient in backward (one per row-wise module in Megatron's pairing); full recompute repeats the forward
    ones. With sequence parallelism the all-reduce becomes a reduce-scatter plus an all-gather of equal cost.
    """
    if config.tp == 1:
        return 0.0
    group = tp_group(cluster, config.tp)
    boundary = evaluate(layer.boundary, b=b, s=s, tp=1, sequence_parallel=False)
    calls = layer.tp_allreduces * (2 + (mode is Checkpoint.FULL))
    seconds = calls * all_reduce_seconds(cluster, group, boundary)
    if layer.role is Role.HEAD and any(p.tp_dim is not None for p in layer.params):
        # The LM head's column-wise output is gathered (`colwise_gather_output`) so the loss sees all logits.
        logits = b * s * graph.dims.vocab * precision.compute_itemsize(config.precision)
        seconds += all_gather_seconds(cluster, group, logits)
    return seconds
