"""Alpha-beta costs of NCCL collectives over NVLink/PCIe inside a node and the network across nodes."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster

# nccl-tests all_reduce on an A100 node reaches ~235 GB/s bus bandwidth of the 300 GB/s per-direction NVLink
# (stas00/ml-engineering network/README, commit 744d01e): ~0.8 of the link. Applied to every link.
LINK_EFFICIENCY = 0.8
# Per-step latency of a ring collective (an assumption: a few microseconds per hop on NVLink, more on IB).
INTRA_NODE_LATENCY = 5e-6
INTER_NODE_LATENCY = 15e-6


@dataclass(frozen=True, slots=True)
class Group:
    """A communicator: `size` ranks, all in one node or spread over several."""

    size: int
    spans_nodes: bool


def tp_group(cluster: Cluster, tp: int) -> Group:
    """Tensor-parallel ranks are adjacent GPUs of one node."""
    return Group(tp, tp > cluster.gpus_per_node)


def dp_group(cluster: Cluster, tp: int, dp: int) -> Group:
    """Data-parallel peers of one TP rank; they leave the node once tp * dp exceeds a node."""
    return Group(dp, tp * dp > cluster.gpus_per_node)


def _link(cluster: Cluster, group: Group) -> tuple[float, float]:
    """(bytes/s per rank, latency per step) of the slowest link the ring crosses."""
    if group.spans_nodes:
        return cluster.inter_node_bandwidth * LINK_EFFICIENCY, INTER_NODE_LATENCY
    return cluster.gpu.intra_node_bandwidth * LINK_EFFICIENCY, INTRA_NODE_LATENCY


def all_reduce_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (n-1)/n of the buffer in 2 (n-1) steps."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = _link(cluster, group)
    n = group.size
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def all_gather_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring all-gather (or reduce-scatter) of a `nbytes` full buffer: (n-1)/n of it per rank."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = _link(cluster, group)
    n = group.size
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


reduce_scatter_seconds = all_gather_seconds
