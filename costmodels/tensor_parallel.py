"""Tensor parallelism's collectives: per-layer all-reduces of the boundary activation (Shoeybi et al. 2019)."""

from __future__ import annotations

from graphs import Checkpoint, Layer, LayerGraph, Role

from . import precision
from .activations import evaluate
from .cluster import Cluster
from .collectives import all_gather_seconds, all_reduce_seconds, tp_group
from .config import Config


def tp_comm_seconds(graph: LayerGraph, cluster: Cluster, config: Config, *, b: int, s: int) -> float:
    """Seconds of TP collectives per micro-batch (forward, backward and recompute); not overlapped.

    Each row-wise module all-reduces its output in forward and each column-wise group all-reduces its input
    gradient in backward (one per row-wise module in Megatron's pairing); full recompute repeats the forward
    ones. With sequence parallelism the all-reduce becomes a reduce-scatter plus an all-gather of equal cost.
    """
    if config.tp == 1:
        return 0.0
    group = tp_group(cluster, config.tp)
    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    total = 0.0
    for layer in graph.nodes():
        mode = next(modes) if layer.role is Role.DECODER else Checkpoint.NONE
        boundary = evaluate(layer.boundary, b=b, s=s, tp=1, sequence_parallel=False)
        calls = layer.tp_allreduces * (2 + (mode is Checkpoint.FULL))
        total += calls * all_reduce_seconds(cluster, group, boundary)
        total += _head_gather(graph, cluster, config, layer, b=b, s=s)
    return total


def _head_gather(graph: LayerGraph, cluster: Cluster, config: Config, layer: Layer, *, b: int, s: int) -> float:
    """The LM head's column-wise output is gathered (`colwise_gather_output`) so the loss sees all logits."""
    if layer.role is not Role.HEAD or not any(p.tp_dim is not None for p in layer.params):
        return 0.0
    logits = b * s * graph.dims.vocab * precision.compute_itemsize(config.precision)
    return all_gather_seconds(cluster, tp_group(cluster, config.tp), logits)
