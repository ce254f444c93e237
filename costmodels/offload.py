"""Offload: PCIe traffic for states kept on the host, NVMe traffic, and the CPU optimizer step."""

from __future__ import annotations

import functools
import json
from importlib import resources

from . import partial_offload, precision
from .cluster import Cluster
from .config import Config, Offload, Optimizer
from .engines import rules_of

# Measured host-to-device copies reach 88% of PCIe Gen5 x16 (55.4 of 63 GB/s on 8xH200, nvbandwidth;
# stas00/ml-engineering, shared notes §1.2). Applied to every host link.
PCIE_EFFICIENCY = 0.88
# The CPU Adam step streams param, grad, m, v in and param, m, v out: seven tensors per parameter, 28 bytes in fp32
# (ZeRO-Offload, Ren et al. 2021, §4.1: the CPU step is memory-bandwidth bound). DeepSpeed's CPUAdam always steps
# fp32 masters; torch's AdamW on FSDP2's host shards steps them in their own dtype (bf16 under pure bf16, with bf16
# moments: torch.optim.AdamW keeps exp_avg/exp_avg_sq in the parameter's dtype).
CPU_ADAM_TENSORS_PER_PARAM = 7


@functools.cache
def _host_memory() -> dict:
    text = resources.files("costmodels").joinpath("data/host_memory.json").read_text(encoding="utf-8")
    return json.loads(text)


def host_memory_bandwidth(gpu_id: str) -> float:
    """Sustained bytes/s of the host memory of the node a GPU's catalog record assumes: the CPU datasheet's peak
    (sockets x channels x MT/s x 8 bytes) at the STREAM Triad fraction measured on the same DRAM generation
    (data/host_memory.json, with its sources)."""
    data = _host_memory()
    node = data["nodes"].get(gpu_id, data["default"])
    peak = node["sockets"] * node["channels"] * node["mts"] * 1e6 * 8
    return peak * data["stream_fraction"][node["dram"]]


@functools.cache
def cpu_adam_slowdowns() -> dict[str, float]:
    """How much slower each torch AdamW implementation steps CPU tensors than DeepSpeed's SIMD CPUAdam, measured by
    benchmarks/cpu_adam.py (data/cpu_adam.json, with the machine and method). The ZeRO-Offload paper (Ren et
    al. 2021, §4.1) reports 5-7x against the torch CPU Adam of its day; torch's fused CPU kernel (2.4+) closes
    most of that gap."""
    text = resources.files("costmodels").joinpath("data/cpu_adam.json").read_text(encoding="utf-8")
    return {name: float(value) for name, value in json.loads(text)["slowdown_vs_deepspeed"].items()}


def torch_cpu_optimizer(optimizer: Optimizer) -> str:
    """The torch implementation FSDP2's CPUOffloadPolicy steps on the host: fused AdamW when planned, else the
    single-tensor loop torch picks for CPU parameters (`_default_to_fused_or_foreach` takes foreach only on CUDA)."""
    return "torch_fused" if optimizer is Optimizer.ADAMW_FUSED else "torch_single"


def offload_seconds(cluster: Cluster, config: Config, *, partition: int, params: int, grad_bytes: int) -> float:
    """Seconds per step of offload traffic, every copy exposed, and the host optimizer step.

    `partition` is the number of trainable elements this rank's optimizer owns and `params` the elements of
    its parameter shard (frozen ones included); `grad_bytes` the bytes of one 16-bit element (DeepSpeed moves
    gradients and parameters in the compute dtype, FSDP2 its shards in their own dtype). FSDP2's copies run beside
    its compute: `timing` prices them as its streams schedule them (`offload_schedule`) instead of `copy_seconds`.
    """
    return copy_seconds(cluster, config, partition=partition, params=params, grad_bytes=grad_bytes) + \
        host_step_seconds(cluster, config, partition=partition)


def copy_seconds(cluster: Cluster, config: Config, *, partition: int, params: int, grad_bytes: int) -> float:
    """Seconds per step of the PCIe and NVMe traffic of offloaded states, one copy after another."""
    ranks = min(cluster.gpus_per_node, config.world_size)
    pcie = host_link(cluster)
    seconds = 0.0
    if steps_a_share(config):
        # Megatron's hybrid optimizer: the host share's fp32 gradients down, its updated 16-bit parameters up.
        moved = host_stepped(config, partition) * (partial_offload.GRADIENT_DOWN_BYTES + grad_bytes)
        return moved / pcie
    if config.optimizer_offload is not Offload.NONE:
        # DeepSpeed: gradients down, updated parameters up, once per step. FSDP2's CPUOffloadPolicy keeps the
        # parameters on the host (they go up in the fetch below, before each use) and reduce-scatters, then copies
        # down, the gradients of every micro-batch (`foreach_reduce`), of the whole step under a pipeline.
        crossings = (config.grad_accum if config.pp == 1 else 1) if params_live_on_host(config) else 2
        moved = crossings * partition * moved_itemsize(config, grad_bytes)
        seconds += moved / pcie
        if config.optimizer_offload is Offload.NVME:
            seconds += 2 * 12 * partition * ranks / max(cluster.nvme_bandwidth, 1.0)
    if config.param_offload is not Offload.NONE:
        # Each micro-batch fetches the rank's parameter shard for forward and again for backward.
        fetched = 2 * params * moved_itemsize(config, grad_bytes) * config.grad_accum
        seconds += fetched / pcie
        if config.param_offload is Offload.NVME:
            seconds += fetched * ranks / max(cluster.nvme_bandwidth, 1.0)
    return seconds


def host_step_seconds(cluster: Cluster, config: Config, *, partition: int) -> float:
    """Seconds per step of the host optimizer over `partition` elements per rank (0 without optimizer offload):
    it runs after backward's last gradient lands, beside nothing."""
    if config.optimizer_offload is Offload.NONE:
        return 0.0
    ranks = min(cluster.gpus_per_node, config.world_size)
    return _cpu_step_seconds(cluster, config, host_stepped(config, partition) * ranks)


def host_stepped(config: Config, elements: int) -> int:
    """Elements of a rank's optimizer `elements` stepped on the host (`partial_offload`: Megatron's fraction of them,
    else all or none)."""
    share = partial_offload.host_share(config.optimizer_offload, config.engine, config.optimizer_offload_fraction)
    return partial_offload.host_elements(share, elements)


def steps_a_share(config: Config) -> bool:
    """Whether the host steps a share beside the GPU's (Megatron's hybrid device optimizer)."""
    return partial_offload.steps_a_share(config.optimizer_offload, config.engine)


def host_link(cluster: Cluster) -> float:
    """Host-to-device bytes/s: the profile's pinned copies, else the datasheet link at PCIE_EFFICIENCY."""
    measured = cluster.profile.rate("h2d_pinned") if cluster.profile is not None else None
    return measured or cluster.gpu.host_bandwidth * PCIE_EFFICIENCY


def _cpu_step_seconds(cluster: Cluster, config: Config, params: int) -> float:
    """Seconds of the host optimizer step over `params` parameters (all ranks of a node share the host).

    FSDP2 runs torch's AdamW on the host and DeepSpeed its CPUAdam; a profile's rate for the one that runs
    replaces the bandwidth model.
    """
    rules = rules_of(config.engine)
    if cluster.profile is not None:
        measured = cluster.profile.rate(rules.host_optimizer)
        if measured:
            return params / measured
    # DeepSpeed runs its own CPUAdam whatever was asked for, Megatron's hybrid optimizer torch's fused AdamW on fp32
    # states (`partial_offload`); FSDP2's host step runs the asked optimizer.
    own, hybrid = rules.offload_runs_own_optimizer, rules.hybrid_offload
    itemsize = 4 if own or hybrid else precision.state_itemsize(config.precision)
    step = params * CPU_ADAM_TENSORS_PER_PARAM * itemsize / host_memory_bandwidth(cluster.gpu.id)
    implementation = "torch_fused" if hybrid else torch_cpu_optimizer(config.optimizer)
    return step * (1.0 if own else cpu_adam_slowdowns()[implementation])


def params_live_on_host(config: Config) -> bool:
    """FSDP2's CPUOffloadPolicy: the sharded parameters (and the optimizer stepping them) stay on the host."""
    return rules_of(config.engine).offload_moves_all_states and config.param_offload is not Offload.NONE


def moved_itemsize(config: Config, grad_bytes: int) -> int:
    """Bytes per element crossing PCIe: FSDP2's CPUOffloadPolicy moves its sharded parameters and gradients in
    their own dtype (fp32 under mixed precision, bf16 under pure bf16), DeepSpeed the 16-bit gradients and
    parameters (`grad_bytes`)."""
    if rules_of(config.engine).offload_moves_all_states:
        return precision.weight_itemsize(config.precision, config.engine, trainable=True)
    return grad_bytes
