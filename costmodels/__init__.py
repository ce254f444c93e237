"""costmodels: memory per GPU and time per step for a lowered model, a cluster, a workload and a config.

Pure functions; knows nothing of search. `estimate(graph, cluster, workload, config)` is the entry point.
"""

from .breakdown import Estimate, MemoryBreakdown, TimeBreakdown
from .cluster import Cluster, InvalidCluster, describe_cluster, load_cluster_file, parse_cluster
from .config import Config, Engine, Offload, Optimizer, Precision, Workload
from .estimate import InvalidConfig, check, estimate, model_flops
from .hardware import GPU, UnknownGPU, find_gpu, load_gpus
from .lowering import lowering_for, shared_lowering
from .verdict import DEFAULT_HEADROOM, Verdict, fits

__all__ = [
    "DEFAULT_HEADROOM", "GPU", "Cluster", "Config", "Engine", "Estimate", "InvalidCluster", "InvalidConfig",
    "MemoryBreakdown", "Offload", "Optimizer", "Precision", "TimeBreakdown", "UnknownGPU", "Verdict", "Workload",
    "check", "describe_cluster", "estimate", "find_gpu", "fits", "load_cluster_file", "load_gpus", "lowering_for",
    "model_flops", "parse_cluster", "shared_lowering",
]
