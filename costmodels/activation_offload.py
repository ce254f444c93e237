"""Activation offloading to host memory, as torchtune runs it (`enable_activation_offloading: True`).

torchtune 0.6.1 training/_activation_offloading.py `OffloadActivations` is a `saved_tensors_hooks` pair around the
model's forward: `pack_tensor` copies every saved tensor of at least 1024 bytes that is not a parameter or buffer
to pinned host memory (on a side stream, keeping the device tensor in a stash until the copy is done) and
`unpack_tensor` copies it back when backward needs it (one node ahead on the side stream), freeing it once the
node that used it has run. The output projection runs under a `NoOpManager` and the loss outside the context, so
neither is offloaded. torchtune refuses offloading without activation checkpointing ("enable_activation_offloading
should only be True when enable_activation_checkpointing is True"): what moves is each layer's checkpointed input
(with the model-wide tensors it was called with), and the final norm's saved tensors.

The model keeps, on the device, the activations of the node in flight plus one more node: the stash in forward
(the previous node's tensors until their copy completes) and the prefetch in backward (the next node's tensors).
Transfers overlap compute: each node costs max(compute, bytes / host link) in each direction.
"""

from __future__ import annotations

from dataclasses import replace

from graphs import Checkpoint, LayerGraph, Poly

from .activations import NodeMemory, evaluate
from .cluster import Cluster
from .compute import KernelSpeed, work_seconds
from .config import Config
from .offload import host_link
from .terms import MemoryTerms

# torchtune `OffloadActivations(min_offload_size=1024)`: smaller saved tensors stay on the device.
MIN_OFFLOAD_BYTES = 1024
# Nodes whose saved tensors stay on the device: the head (NoOpManager) and the loss (computed outside).
NOT_OFFLOADED = ("head", "loss")


def refusals(graph: LayerGraph, config: Config) -> list[str]:
    """Why `config` cannot offload activations (empty when it can)."""
    reasons = []
    modes = config.layer_modes(len(graph.decoder_layers()))
    if any(mode is not Checkpoint.FULL for mode in modes):
        reasons.append("activation offloading needs full activation checkpointing on every layer (torchtune "
                       "refuses it otherwise: each un-checkpointed layer would copy every saved tensor)")
    return reasons


def offloaded(node: NodeMemory, name: str) -> int:
    """Device bytes one node's forward sends to the host: its saved activations (the lowering counts each
    storage once, and a storage smaller than MIN_OFFLOAD_BYTES is one the lowering's per-node totals cannot
    single out; at training shapes every checkpointed input is far above it)."""
    return 0 if name in NOT_OFFLOADED else node.saved


def offload_terms(terms: MemoryTerms, *, stash: bool = True, prefetch: bool = True) -> MemoryTerms:
    """`memory_terms(...)` with activations offloaded: a node's saved bytes leave the device after its forward and
    come back for its backward; `stash` keeps the previous node's on the device during a node's forward, and
    `prefetch` the next (in backward order) node's during its backward."""
    # per node, the most it offloads over its modes: what a neighbour's stash or prefetch holds
    moved = [max(offloaded(node, name) for _, node in options)
             for name, options in zip(terms.names, terms.nodes, strict=True)]
    nodes = tuple(tuple((mode, _offloaded_node(node, offloaded(node, name))) for mode, node in options)
                  for name, options in zip(terms.names, terms.nodes, strict=True))
    extra = []
    for i, (fwd, kept, bwd) in enumerate(terms.extra):
        previous = moved[i - 1] if i > 0 else 0
        extra.append((fwd + (previous if stash else 0), kept, bwd + (previous if prefetch else 0)))
    return replace(terms, nodes=nodes, extra=tuple(extra))


def _offloaded_node(node: NodeMemory, moved: int) -> NodeMemory:
    """The node with `moved` saved bytes off the device between its forward and its backward."""
    return replace(node, saved=node.saved - moved, fwd_net=node.fwd_net - moved, bwd_net=node.bwd_net + moved,
                   bwd_peak=node.bwd_peak + moved, bwd_peak_fresh=node.bwd_peak_fresh + moved)


def moved_bytes(graph: LayerGraph, config: Config, *, b: int, s: int) -> list[int]:
    """Bytes each node copies to the host per micro-batch (and back in backward): its saved activations, plus,
    for a checkpointed layer, the model-wide tensors it was called with (torchtune copies each saved tensor,
    including every layer's copy of the shared rotary tables and masks)."""
    def at(poly: Poly) -> int:
        return evaluate(poly, b=b, s=s, tp=config.tp, sequence_parallel=config.sequence_parallel)

    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    shared = at(graph.checkpoint_shared)
    result = []
    for layer in graph.nodes():
        mode = next(modes) if layer.index is not None else Checkpoint.NONE
        if layer.name in NOT_OFFLOADED:
            result.append(0)
            continue
        result.append(at(layer.cost(mode).saved) + (shared if mode is Checkpoint.FULL else 0))
    return result


def exposed_seconds(transfers: list[tuple[int, float, float]], link: float) -> float:
    """Seconds the host copies add per micro-batch: for each node (bytes, forward seconds, backward seconds incl.
    recompute), the copy to the host overlaps its forward and the copy back its backward, so each direction
    costs max(0, bytes / link - compute)."""
    return sum(max(0.0, moved / link - forward) + max(0.0, moved / link - backward)
               for moved, forward, backward in transfers)


def host_bytes(moved: list[int], ranks_per_node: int) -> int:
    """Pinned host memory per node: one micro-batch's offloaded activations for each rank on the node."""
    return sum(moved) * ranks_per_node


def offload_seconds(graph: LayerGraph, cluster: Cluster, config: Config, speed: KernelSpeed, *, s: int,
                    memory_speedup: float = 1.0) -> float:
    """Exposed host-copy seconds per optimizer step: `exposed_seconds` per micro-batch over the host link (the
    profile's pinned copies, else the catalog's PCIe link at the offload model's efficiency), times the
    accumulation steps. Each node's compute is its forward, and its backward with its recompute."""
    b = config.micro_batch
    kwargs = {"b": b, "s": s, "tp": config.tp, "sequence_parallel": config.sequence_parallel,
              "memory_speedup": memory_speedup}
    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    transfers = []
    for layer, moved in zip(graph.nodes(), moved_bytes(graph, config, b=b, s=s), strict=True):
        cost = layer.cost(next(modes) if layer.index is not None else Checkpoint.NONE)
        transfers.append((moved, work_seconds(cost.forward, speed, **kwargs),
                          work_seconds(cost.backward, speed, **kwargs) + work_seconds(cost.recompute, speed, **kwargs)))
    return config.grad_accum * exposed_seconds(transfers, host_link(cluster))


def step_seconds(graph: LayerGraph, cluster: Cluster, config: Config, speed: KernelSpeed, *, s: int,
                 memory_speedup: float = 1.0) -> float:
    """`offload_seconds` of `config` with every layer fully checkpointed (the only way torchtune offloads, which
    `Config` enforces once the modes are decided); 0 without activation offload."""
    if not config.activation_offload:
        return 0.0
    full = replace(config, checkpoint=(Checkpoint.FULL,) * len(graph.decoder_layers()))
    return offload_seconds(graph, cluster, full, speed, s=s, memory_speedup=memory_speedup)
