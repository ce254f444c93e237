"""Memory outside the tensors: the CUDA context, NCCL buffers, cuBLAS workspaces and the caching allocator's
rounding and fragmentation."""

from __future__ import annotations

import math

from .cluster import Cluster
from .config import Config
from .zero import shard_ranks

MIB = 2**20

# CUDA context and kernel images: the Hugging Face "Model training anatomy" guide measures 1343 MiB on a
# V100 before any tensor exists ("kernels alone take up 1.3GB"; benchmarks/data/calibration/memory_published.json
# row hf-ctx). Lazy module loading (CUDA >= 11.7) loads fewer kernels; fitplan keeps the measured figure.
CUDA_CONTEXT_BYTES = 1343 * MIB

# NCCL keeps NCCL_BUFFSIZE (4 MiB default) per channel and direction for each communicator; with the default
# cap of 32 channels that is 4 MiB * 2 * 32 = 256 MiB per communicator (NCCL environment-variable docs:
# NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS).
NCCL_BYTES_PER_COMMUNICATOR = 4 * MIB * 2 * 32

# cuBLAS / cuBLASLt workspaces PyTorch allocates per handle: 32 MiB on Hopper and newer, 4 MiB earlier
# (PyTorch `getChosenWorkspaceSize`, CUBLAS_WORKSPACE_CONFIG defaults).
CUBLAS_WORKSPACE_BYTES = 32 * MIB

# The caching allocator rounds blocks over 1 MiB up to 2 MiB multiples and leaves part of its segments unused.
# fitplan reserves 5% above the allocated peak for that (an assumption; the fidelity benchmark checks it
# against published reserved-memory measurements).
FRAGMENTATION = 0.05
LARGE_BLOCK = 2 * MIB


def runtime_overhead(cluster: Cluster, config: Config) -> int:
    """Bytes per GPU that the allocator does not see: context, NCCL (one communicator per parallel group)."""
    if cluster.gpu.vendor == "cpu":
        return 0
    # Context parallelism adds its own group, and the weights' data-parallel group spans dp x cp (`shard_ranks`).
    communicators = (config.tp > 1) + (config.cp > 1) + (shard_ranks(config) > 1)
    measured = cluster.profile.context_bytes if cluster.profile is not None else None
    context = CUDA_CONTEXT_BYTES if measured is None else math.ceil(measured)  # a profile measured this node's
    return context + communicators * NCCL_BYTES_PER_COMMUNICATOR + CUBLAS_WORKSPACE_BYTES


def reserved_bytes(allocated: int) -> int:
    """The allocator's reservation for an allocated peak: rounding to 2 MiB blocks plus fragmentation."""
    rounded = math.ceil(allocated / LARGE_BLOCK) * LARGE_BLOCK
    return rounded + math.ceil(FRAGMENTATION * allocated)


def allocated_budget(usable: int, overhead: int) -> int:
    """The largest allocated peak whose reservation plus `overhead` fits in `usable` bytes (0 if none)."""
    low, high = 0, max(0, usable)
    while low < high:  # reserved_bytes is nondecreasing, so bisect on it
        middle = (low + high + 1) // 2
        if reserved_bytes(middle) + overhead <= usable:
            low = middle
        else:
            high = middle - 1
    return low if reserved_bytes(low) + overhead <= usable else 0
