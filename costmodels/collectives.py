"""Alpha-beta costs of NCCL collectives over NVLink/PCIe inside a node and the network across nodes."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .profile import CollectiveOp

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


def _link(cluster: Cluster, group: Group, op: CollectiveOp) -> tuple[float, float]:
    """(bytes/s per rank, latency per step) of the slowest link the ring crosses; inside a node, the profile's
    fit for `op` when the cluster has one (a profile measures one node, so inter-node links keep the constants)."""
    if group.spans_nodes:
        return cluster.inter_node_bandwidth * LINK_EFFICIENCY, INTER_NODE_LATENCY
    fit = cluster.profile.link(op) if cluster.profile is not None else None
    if fit is not None:
        return fit.bus_bandwidth, fit.latency
    return cluster.gpu.intra_node_bandwidth * LINK_EFFICIENCY, INTRA_NODE_LATENCY


def all_reduce_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (n-1)/n of the buffer in 2 (n-1) steps."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = _link(cluster, group, "all_reduce")
    n = group.size
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def all_gather_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring all-gather of a `nbytes` full buffer: (n-1)/n of it per rank in n-1 steps."""
    return _half_ring_seconds(cluster, group, nbytes, "all_gather")


def reduce_scatter_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring reduce-scatter of a `nbytes` full buffer: the same traffic as an all-gather."""
    return _half_ring_seconds(cluster, group, nbytes, "reduce_scatter")


def _half_ring_seconds(cluster: Cluster, group: Group, nbytes: float, op: CollectiveOp) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = _link(cluster, group, op)
    n = group.size
    return (n - 1) / n * nbytes / bandwidth + (n - 1) * latency
