"""Alpha-beta costs of NCCL collectives over NVLink/PCIe inside a node and the network across nodes."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .profile import CollectiveOp

# nccl-tests all_reduce on an A100 node reaches ~235 GB/s bus bandwidth of the 300 GB/s per-direction NVLink
# (stas00/ml-engineering network/README, commit 744d01e): ~0.8 of the link. Applied to every link.
LINK_EFFICIENCY = 0.8
# Per-step latency of a ring collective: the time of an 8-byte all_reduce (nothing but latency) divided by its
# 2 (n-1) ring steps. Inside a node: 12.49 us on the 8 NVSwitch-connected Hopper GPUs of one HGX H20 node
# (nccl-tests all_reduce_perf, 8 B float sum, out-of-place; github.com/deepseek-ai/DeepEP/issues/303) gives
# 12.49 / 14 = 0.89 us. Across nodes: 19.90 us between two A100 80GB nodes over HDR InfiniBand, one GPU each
# (all_reduce_perf, 8 B; github.com/NVIDIA/nccl-tests/issues/150) gives 19.90 / 2 = 9.95 us.
INTRA_NODE_LATENCY = 12.49e-6 / 14
INTER_NODE_LATENCY = 19.90e-6 / 2


@dataclass(frozen=True, slots=True)
class Group:
    """A communicator: `size` ranks, all in one node or spread over several with `per_node` in each."""

    size: int
    spans_nodes: bool
    per_node: int = 1
    """Ranks of the group inside each node (when it spans nodes)."""


def tp_group(cluster: Cluster, tp: int) -> Group:
    """Tensor-parallel ranks are adjacent GPUs of one node (a whole node each when tp exceeds one)."""
    return Group(tp, tp > cluster.gpus_per_node, min(tp, cluster.gpus_per_node))


def dp_group(cluster: Cluster, tp: int, dp: int) -> Group:
    """Data-parallel peers of one TP rank; they leave the node once tp * dp exceeds a node, with a node's
    gpus_per_node / tp of them in each node."""
    return Group(dp, tp * dp > cluster.gpus_per_node, max(1, cluster.gpus_per_node // tp))


def replica_group(cluster: Cluster, tp: int, shard: int, replicas: int) -> Group:
    """The ranks holding the same shard in each of `replicas` hybrid-sharding groups of `shard` data-parallel ranks
    (torch's 2-D mesh puts the replicate dim outermost): they sit tp x shard ranks apart, so they leave the node once
    a node holds less than all of them, with gpus_per_node / (tp x shard) of them in each node (at least one)."""
    stride = tp * shard
    return Group(replicas, stride * replicas > cluster.gpus_per_node, max(1, cluster.gpus_per_node // stride))


def cp_group(cluster: Cluster, tp: int, cp: int) -> Group:
    """Context-parallel peers of one TP rank sit next to the TP ranks (Megatron's rank order tp-cp-ep-dp-pp;
    torchtitan's mesh puts cp inside dp likewise), so they leave the node once tp * cp exceeds it."""
    return Group(cp, tp * cp > cluster.gpus_per_node, max(1, cluster.gpus_per_node // tp))


def send_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """One hop of a ring of point-to-point sends: each rank sends `nbytes` to its neighbour while receiving as
    many; where the ring leaves a node the hop rides the sender's own NIC (one per GPU, rail-optimised)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = _link(cluster, Group(group.size, group.spans_nodes, 1), "all_gather")
    return nbytes / bandwidth + latency


def all_to_all_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """All-to-all of a `nbytes` buffer per rank: each keeps 1/n and sends 1/n to each peer, those in its node
    over NVLink and the others through its own NIC at once; one latency per peer (NCCL issues n-1 sends)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    n = group.size
    intra, latency = _link(cluster, Group(n, False), "all_gather")
    if not group.spans_nodes:
        return (n - 1) / n * nbytes / intra + (n - 1) * latency
    nic, latency = _link(cluster, Group(n, True, 1), "all_gather")
    inside = group.per_node
    return max((inside - 1) / n * nbytes / intra, (n - inside) / n * nbytes / nic) + (n - 1) * latency


def _link(cluster: Cluster, group: Group, op: CollectiveOp) -> tuple[float, float]:
    """(bus bytes/s per rank, latency per step) of a ring; inside a node, the profile's fit for `op` when the
    cluster has one (a profile measures one node).

    Across nodes NCCL runs one channel per NIC (rail-optimised fabrics: one NIC per GPU, as in DGX/HGX nodes),
    so the `per_node` ranks of a group move the data that must leave a node through `per_node` NICs at once;
    inside the node the ring still rides NVLink. The bus bandwidth is the slower of the two: a 16-GPU FSDP group
    over two DGX H100 nodes gets min(NVLink, 8 x 50 GB/s), not one NIC's 50 GB/s (nccl-tests' multi-node
    all_reduce busbw on such nodes is of the order of the NIC aggregate, not of one NIC)."""
    fit = cluster.profile.link(op) if cluster.profile is not None else None
    intra = (fit.bus_bandwidth, fit.latency) if fit is not None else \
        (cluster.gpu.intra_node_bandwidth * LINK_EFFICIENCY, INTRA_NODE_LATENCY)
    if not group.spans_nodes:
        return intra
    nics = group.per_node * cluster.inter_node_bandwidth * LINK_EFFICIENCY
    return min(intra[0], nics), INTER_NODE_LATENCY


def ring_latency(cluster: Cluster, group: Group, op: CollectiveOp) -> float:
    """Latency of one pass around a ring: a chunk crosses n - 1 hops. Inside a node each is an NVLink hop; a ring
    over several nodes (NCCL orders it node by node) leaves each node once, so of its hops only nodes - 1 cross the
    network and the others stay on NVLink (2 nodes of 1 GPU: one network hop, the nccl-tests figure above)."""
    n = group.size
    intra = _link(cluster, Group(n, False), op)[1]
    if not group.spans_nodes:
        return (n - 1) * intra
    nodes = -(-n // group.per_node)
    return (n - nodes) * intra + (nodes - 1) * INTER_NODE_LATENCY


def all_reduce_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring all-reduce: each rank sends and receives 2 (n-1)/n of the buffer in two passes of the ring."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, _ = _link(cluster, group, "all_reduce")
    n = group.size
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * ring_latency(cluster, group, "all_reduce")


def all_gather_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring all-gather of a `nbytes` full buffer: (n-1)/n of it per rank in n-1 steps."""
    return _half_ring_seconds(cluster, group, nbytes, "all_gather")


def reduce_scatter_seconds(cluster: Cluster, group: Group, nbytes: float) -> float:
    """Ring reduce-scatter of a `nbytes` full buffer: the same traffic as an all-gather."""
    return _half_ring_seconds(cluster, group, nbytes, "reduce_scatter")


def _half_ring_seconds(cluster: Cluster, group: Group, nbytes: float, op: CollectiveOp) -> float:
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, _ = _link(cluster, group, op)
    n = group.size
    return (n - 1) / n * nbytes / bandwidth + ring_latency(cluster, group, op)
