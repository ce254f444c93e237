"""costmodels: memory per GPU and time per step for a lowered model, a cluster, a workload and a config.

Pure functions; knows nothing of search. `estimate(graph, cluster, workload, config)` is the entry point.
The names load on first use (`graphs.exports`).
"""

from __future__ import annotations

from graphs.exports import lazy_exports

_WHERE = {
    "Cluster": "costmodels.cluster",
    "Config": "costmodels.config",
    "DEFAULT_HEADROOM": "costmodels.verdict",
    "Engine": "costmodels.config",
    "Estimate": "costmodels.breakdown",
    "GPU": "costmodels.hardware",
    "InvalidCluster": "costmodels.cluster",
    "InvalidConfig": "costmodels.estimator",
    "MemoryBreakdown": "costmodels.breakdown",
    "Offload": "costmodels.config",
    "Optimizer": "costmodels.config",
    "Precision": "costmodels.config",
    "TimeBreakdown": "costmodels.breakdown",
    "UnknownGPU": "costmodels.hardware",
    "Verdict": "costmodels.verdict",
    "Workload": "costmodels.config",
    "check": "costmodels.estimator",
    "describe_cluster": "costmodels.cluster",
    "estimate": "costmodels.estimator",
    "find_gpu": "costmodels.hardware",
    "fits": "costmodels.verdict",
    "load_cluster_file": "costmodels.cluster",
    "load_gpus": "costmodels.hardware",
    "lowering_for": "costmodels.lowering",
    "model_flops": "costmodels.estimator",
    "parse_cluster": "costmodels.cluster",
    "shared_lowering": "costmodels.lowering",
}
__all__ = [  # noqa: RUF022 (the names _WHERE maps, sorted)
    "Cluster",
    "Config",
    "DEFAULT_HEADROOM",
    "Engine",
    "Estimate",
    "GPU",
    "InvalidCluster",
    "InvalidConfig",
    "MemoryBreakdown",
    "Offload",
    "Optimizer",
    "Precision",
    "TimeBreakdown",
    "UnknownGPU",
    "Verdict",
    "Workload",
    "check",
    "describe_cluster",
    "estimate",
    "find_gpu",
    "fits",
    "load_cluster_file",
    "load_gpus",
    "lowering_for",
    "model_flops",
    "parse_cluster",
    "shared_lowering",
]
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
