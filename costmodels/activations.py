"""The activation timeline of one micro-batch: live bytes as each node runs forward, then backward.

Every node's numbers come from the lowering (relative to the live memory when it starts). Walking the nodes in
order and summing gives the exact peak and where it is. Engine buffers that exist only while a node runs
(gathered ZeRO-3/FSDP parameters, unsharded gradients, reduce buckets) are added by `engine_buffers`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from graphs import Checkpoint, Layer, Poly, Role

from .config import Config


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeMemory:
    """One node's memory effect, in bytes at the configuration's micro-batch, sequence and TP degree."""

    decoder: bool
    saved: int
    fwd_net: int
    fwd_peak: int
    released_after_forward: int
    bwd_net: int
    bwd_peak: int
    """Backward peak when gradients are handed off as they are produced (reduced, or added to existing ones)."""
    bwd_peak_fresh: int
    """Backward peak when the node's new gradients stay allocated (first micro-batch, unsharded gradients)."""
    grads: int
    """Gradient bytes the node's backward produces (as traced)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Peak:
    """The largest live set over a micro-batch, above the persistent states, and what it holds."""

    bytes: int
    at: str
    activations: int
    """Saved activations (and the input batch) alive at the peak."""
    grads: int
    """Gradients that had been produced and kept by then (first micro-batch only)."""


def evaluate(poly: Poly, *, b: int, s: int, tp: int, sequence_parallel: bool) -> int:
    """Bytes (or FLOPs) of a lowered quantity at (b, s, tp). Sequence parallelism also splits the
    activations outside attention/MLP (the terms that grow with tokens) across TP ranks."""
    if not sequence_parallel:
        return poly(b, s, tp)
    return _sequence_split(poly)(b, s, tp)


@functools.lru_cache(maxsize=4096)
def _sequence_split(poly: Poly) -> Poly:
    """`poly` with every token-proportional term also divided by the TP degree (built once per polynomial)."""
    return Poly.of({(i, j, 1 if (k or (i and j)) else 0): c for (i, j, k), c in poly.terms})


def node_memory(layer: Layer, mode: Checkpoint, *, b: int, s: int, config: Config) -> NodeMemory:
    cost = layer.cost(mode)

    def at(poly: Poly) -> int:
        return evaluate(poly, b=b, s=s, tp=config.tp, sequence_parallel=config.sequence_parallel)

    def peak(candidates: tuple[Poly, ...]) -> int:
        return max((at(p) for p in candidates), default=0)

    return NodeMemory(decoder=layer.role is Role.DECODER, saved=at(cost.saved),
                      fwd_net=at(cost.fwd_net), released_after_forward=at(cost.released_after_forward),
                      fwd_peak=peak(cost.fwd_peak.candidates), bwd_net=at(cost.bwd_net),
                      bwd_peak=peak(cost.bwd_peak.candidates), bwd_peak_fresh=peak(cost.bwd_peak_fresh.candidates),
                      grads=at(cost.grads))


def walk(nodes: list[NodeMemory], *, start: int, forward_only: int, fresh_grads: bool,
         extra: tuple[tuple[int, int, int], ...], names: tuple[str, ...]) -> Peak:
    """The peak over forward then backward of one micro-batch (`walk_phases`, the larger of the two)."""
    forward, backward = walk_phases(nodes, start=start, forward_only=forward_only, fresh_grads=fresh_grads,
                                    extra=extra, names=names)
    return forward if forward.bytes >= backward.bytes else backward


def walk_phases(nodes: list[NodeMemory], *, start: int, forward_only: int, fresh_grads: bool,
                extra: tuple[tuple[int, int, int], ...], names: tuple[str, ...]) -> tuple[Peak, Peak]:
    """The peaks of one micro-batch's forward (from its start) and of its backward, each over its own events:
    a pipeline rank composes them with different other micro-batches in flight.

    `start` is the live activation bytes before the first node (input batch, model-wide tensors), of which
    `forward_only` are gone once the last decoder layer has run; `extra[i]` is the engine's (forward
    transient, kept from forward to backward, backward transient) bytes for node i.
    """
    # the peaks are kept as (bytes, node, activations, grads) and named once at the end: a search walks them often
    live, kept, saved, grads = start, 0, start, 0
    top, at, top_saved = start, -1, start
    last_decoder = max((i for i, node in enumerate(nodes) if node.decoder), default=-1)
    for i, (node, (fwd_extra, keep, _)) in enumerate(zip(nodes, extra, strict=True)):
        candidate = live + node.fwd_peak + fwd_extra + kept
        if candidate > top:
            top, at, top_saved = candidate, i, saved
        live += node.fwd_net
        kept += keep
        saved += node.saved
        if i == last_decoder:
            live -= forward_only
            saved -= forward_only
    forward = Peak(bytes=top, at="start" if at < 0 else f"forward {names[at]}", activations=top_saved, grads=0)
    live -= sum(node.released_after_forward for node in nodes)
    back: tuple[int, int, int, int] | None = None
    for i in reversed(range(len(nodes))):
        node, (_, keep, bwd_extra) = nodes[i], extra[i]
        node_peak = node.bwd_peak_fresh if fresh_grads else node.bwd_peak
        candidate = live + node_peak + bwd_extra + kept
        if back is None or candidate > back[0]:
            back = (candidate, i, saved, grads)
        live += node.bwd_net + (node.grads if fresh_grads else 0)
        grads += node.grads if fresh_grads else 0
        kept -= keep
        saved -= node.saved
    if back is None:  # no nodes
        return forward, Peak(bytes=live, at="end of forward", activations=saved, grads=0)
    return forward, Peak(bytes=back[0], at=f"backward {names[back[1]]}", activations=back[2], grads=back[3])
