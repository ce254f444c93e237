"""DeepSpeed ZeRO-3's parameter fetches as its PartitionedParameterCoordinator makes them: one all-gather per
module, just before the module runs, with the next modules prefetched only `stage3_prefetch_bucket_size` elements
ahead; backward gathers again and reduce-scatters each module's gradients on the same links. Simulated over the
model's modules, so a large module behind a small one, and each collective's own latency across nodes, show.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from graphs import Layer, LayerGraph

from .cluster import Cluster
from .collectives import Group, all_gather_seconds, reduce_scatter_seconds
from .config import Config
from .identity_memo import IdentityMemo
from .zero import local_shape, persistence_threshold, prefetch_bucket_elements


@dataclass(frozen=True, slots=True)
class Fetch:
    """One module's parameters as ZeRO-3 fetches them during one pass."""

    numel: int
    """Elements gathered (what the prefetch bucket counts)."""
    gather: float
    """Seconds of its all-gather."""
    compute: float
    """Seconds of its compute in this pass."""
    reduce: float = 0.0
    """Seconds of its gradients' reduce-scatter (backward only)."""


def exposed_seconds(fetches: Sequence[Fetch], *, bucket: int) -> float:
    """Seconds a pass over `fetches` (in execution order) waits on communication.

    `fetch_sub_module` (deepspeed/runtime/zero/partitioned_param_coordinator.py, DeepSpeed 0.19) gathers a module's
    parameters unless a prefetch already did, waits for them, then prefetches the next modules' until at least
    `bucket` elements are newly in flight (one module at least); the gathers queue on one stream. Gradients
    reduce-scatter after their module's backward (overlap_comm: another stream on the same links), and the
    pass ends when the last one has.
    """
    clock = link = busy = 0.0
    ready: dict[int, float] = {}
    ahead = 0  # the next module not yet gathered
    for i, fetch in enumerate(fetches):
        if i >= ahead:
            link = max(link, clock) + fetch.gather
            ready[i], ahead = link, i + 1
        clock = max(clock, ready[i])
        issued = 0
        while ahead < len(fetches) and (issued == 0 or issued < bucket):
            link = max(link, clock) + fetches[ahead].gather
            ready[ahead], issued, ahead = link, issued + fetches[ahead].numel, ahead + 1
        clock += fetch.compute
        busy += fetch.compute
        if fetch.reduce:
            link = max(link, clock) + fetch.reduce
    return max(clock, link) - busy


_MODULES: IdentityMemo[list[tuple[int, int]]] = IdentityMemo()


def modules(layer: Layer, config: Config, hidden: int) -> list[tuple[int, int]]:
    """(gathered, trainable) elements of each module of `layer` on one TP rank, in registration order (the order
    a transformer block runs its linears), less the parameters ZeRO-3 keeps whole (at most
    `stage3_param_persistence_threshold` elements: norms, biases). Memoised: the search asks per configuration."""
    return _MODULES.get((layer,), (config.tp, config.engine, hidden), lambda: _modules(layer, config, hidden))


def _modules(layer: Layer, config: Config, hidden: int) -> list[tuple[int, int]]:
    threshold = persistence_threshold(hidden)
    grouped: dict[str, list[int]] = {}
    for p in layer.params:
        if p.numel <= threshold:
            continue
        numel = math.prod(local_shape(p, tp=config.tp, dp=1, engine=config.engine))
        entry = grouped.setdefault(p.name.rsplit(".", 1)[0], [0, 0])
        entry[0] += numel
        entry[1] += numel if p.trainable else 0
    return [(gathered, trainable) for gathered, trainable in grouped.values()]


def pass_fetches(graph: LayerGraph, cluster: Cluster, config: Config, group: Group,
                 node_seconds: Sequence[float], *, itemsize: int, reduce_itemsize: int = 0) -> list[Fetch]:
    """The fetches of one pass in forward order: each node's modules, its compute split over them by size (a node
    without gathered parameters adds its compute to the fetch before it, or to the first); with `reduce_itemsize`,
    each carries its gradients' reduce-scatter."""
    fetches: list[Fetch] = []
    pending = 0.0  # compute of nodes without gathered parameters, not yet given to a fetch
    links: dict[tuple[int, int], tuple[float, float]] = {}  # (gather, reduce) seconds by module size
    for layer, seconds in zip(graph.nodes(), node_seconds, strict=True):
        own = modules(layer, config, graph.dims.hidden)
        total = sum(g for g, _ in own)
        if not total:
            pending += seconds
            if fetches:
                fetches[-1], pending = replace(fetches[-1], compute=fetches[-1].compute + pending), 0.0
            continue
        for k, (gathered, trainable) in enumerate(own):
            if (gathered, trainable) not in links:  # a model's modules come in a few sizes
                links[gathered, trainable] = (all_gather_seconds(cluster, group, gathered * itemsize),
                                              reduce_scatter_seconds(cluster, group, trainable * reduce_itemsize))
            gather, reduce = links[gathered, trainable]
            fetches.append(Fetch(numel=gathered, gather=gather, reduce=reduce,
                                 compute=seconds * gathered / total + (pending if k == 0 else 0.0)))
        pending = 0.0
    return fetches


# Simulated passes by graph, cluster and node times (by identity: the time model's memoised tuples) and what they
# read of a configuration: configurations that differ in offload or optimizer alone share them.
_PASSES: IdentityMemo[tuple[float, float]] = IdentityMemo()


def clear_caches() -> None:
    """Empty the simulated passes (`timing.clear_caches` calls this: tests that change a constant price afresh)."""
    _PASSES.clear()


def zero3_seconds(graph: LayerGraph, cluster: Cluster, config: Config, group: Group, *,
                  nodes: Sequence[tuple[float, float]], itemsize: int, reduce_itemsize: int) -> tuple[float, float]:
    """(exposed, total) communication seconds of one micro-batch's forward and backward under DeepSpeed ZeRO-3:
    forward gathers every module; backward (reversed) gathers each again and reduce-scatters its gradients."""
    return _PASSES.get((graph, cluster, nodes), (config.tp, config.engine, group, itemsize, reduce_itemsize),
                       lambda: _zero3_seconds(graph, cluster, config, group, nodes=nodes, itemsize=itemsize,
                                              reduce_itemsize=reduce_itemsize))


def _zero3_seconds(graph: LayerGraph, cluster: Cluster, config: Config, group: Group, *,
                   nodes: Sequence[tuple[float, float]], itemsize: int, reduce_itemsize: int) -> tuple[float, float]:
    bucket = prefetch_bucket_elements(graph.dims.hidden)
    forward = pass_fetches(graph, cluster, config, group, [f for f, _ in nodes], itemsize=itemsize)
    backward = pass_fetches(graph, cluster, config, group, [b for _, b in nodes], itemsize=itemsize,
                            reduce_itemsize=reduce_itemsize)[::-1]
    exposed = exposed_seconds(forward, bucket=bucket) + exposed_seconds(backward, bucket=bucket)
    total = sum(f.gather for f in forward) + sum(f.gather + f.reduce for f in backward)
    return exposed, total
