"""Time per optimizer step: compute and recompute per node, TP and data-parallel collectives (overlapped where
the engine overlaps them), offload, and the optimizer step."""

from __future__ import annotations

from graphs import Checkpoint, LayerGraph, Role

from . import precision
from .breakdown import TimeBreakdown
from .cluster import Cluster
from .collectives import all_gather_seconds, all_reduce_seconds, dp_group, reduce_scatter_seconds
from .compute import KernelSpeed, kernel_speed, work_seconds
from .config import Config, Engine, Offload, Workload
from .offload import offload_seconds
from .tensor_parallel import tp_comm_seconds
from .zero import dp_traffic, local_elements, sharding

# The optimizer step streams each local parameter's states: fp32 param, grad, 2 moments read and param and
# moments written (28 bytes), plus the 16-bit copy and master weights under mixed precision (an upper bound;
# ZeRO paper's accounting of Adam state traffic).
OPTIMIZER_BYTES_PER_PARAM = 32


def compute_seconds(graph: LayerGraph, config: Config, speed: KernelSpeed, *, b: int, s: int,
                    memory_speedup: float = 1.0) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one micro-batch on one rank."""
    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    fwd = bwd = rec = 0.0
    for layer in graph.nodes():
        cost = layer.cost(next(modes) if layer.role is Role.DECODER else Checkpoint.NONE)
        kwargs = {"b": b, "s": s, "tp": config.tp, "sequence_parallel": config.sequence_parallel,
                  "memory_speedup": memory_speedup}
        fwd += work_seconds(cost.forward, speed, **kwargs)
        bwd += work_seconds(cost.backward, speed, **kwargs)
        rec += work_seconds(cost.recompute, speed, **kwargs)
    return fwd, bwd, rec


def speed_for(graph: LayerGraph, cluster: Cluster, config: Config, *, b: int, s: int,
              alignment: float = 1.0) -> KernelSpeed:
    return kernel_speed(cluster.gpu, matmul_dtype=precision.matmul_dtype(config.precision),
                        attention_dtype=precision.attention_dtype(config.precision), tokens=b * s,
                        width=max(1, graph.dims.hidden // config.tp), alignment=alignment)


def time_breakdown(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, *,
                   alignment: float = 1.0, memory_speedup: float = 1.0) -> TimeBreakdown:
    """Seconds per optimizer step for `config` (gradient accumulation included)."""
    b, s, ga = config.micro_batch, workload.seq_len, config.grad_accum
    speed = speed_for(graph, cluster, config, b=b, s=s, alignment=alignment)
    fwd, bwd, rec = compute_seconds(graph, config, speed, b=b, s=s, memory_speedup=memory_speedup)
    tp = tp_comm_seconds(graph, cluster, config, b=b, s=s)
    dp_mb, dp_step, dp_total = _dp_seconds(graph, cluster, config, forward=fwd, backward=bwd + rec)
    partition = local_elements([p for p in graph.params() if p.trainable], tp=config.tp, dp=config.dp,
                               engine=config.engine, sharded=sharding(config).optimizer > 1)
    offload = offload_seconds(cluster, config, partition=partition,
                              grad_bytes=precision.compute_itemsize(config.precision))
    optimizer = 0.0 if config.optimizer_offload is not Offload.NONE else \
        partition * OPTIMIZER_BYTES_PER_PARAM / speed.memory_bandwidth
    communication = ga * (tp + dp_mb) + dp_step
    compute, recompute = ga * (fwd + bwd), ga * rec
    return TimeBreakdown(compute=compute, recompute=recompute, communication=communication, offload=offload,
                         optimizer=optimizer, step_time=compute + recompute + communication + offload + optimizer,
                         communication_total=ga * tp + dp_total,
                         details=(("forward", ga * fwd), ("backward", ga * bwd), ("tp_collectives", ga * tp),
                                  ("dp_collectives_total", dp_total)))


def _dp_seconds(graph: LayerGraph, cluster: Cluster, config: Config, *, forward: float,
                backward: float) -> tuple[float, float, float]:
    """(exposed per micro-batch, exposed per step, total) data-parallel collective seconds.

    ZeRO-3/FSDP2 gathers and reduce-scatters overlap the compute of the same pass (prefetching); the DDP /
    ZeRO-0/1 all-reduce overlaps the last micro-batch's backward (bucketed); ZeRO-1/2's parameter all-gather
    after the step is exposed.
    """
    tensors = graph.params()
    elements = local_elements(tensors, tp=config.tp, dp=1, engine=config.engine, sharded=False)
    trainable = local_elements([t for t in tensors if t.trainable], tp=config.tp, dp=1, engine=config.engine,
                               sharded=False)
    traffic = dp_traffic(config, param_bytes=elements * precision.compute_itemsize(config.precision),
                         grad_bytes=trainable * _reduce_itemsize(config))
    group = dp_group(cluster, config.tp, config.dp)
    gather_f = all_gather_seconds(cluster, group, traffic.forward_gather)
    gather_b = all_gather_seconds(cluster, group, traffic.backward_gather)
    reduce_b = reduce_scatter_seconds(cluster, group, traffic.backward_reduce)
    allreduce = all_reduce_seconds(cluster, group, traffic.step_allreduce)
    gather_step = all_gather_seconds(cluster, group, traffic.step_gather)
    per_mb = max(0.0, gather_f - forward) + max(0.0, gather_b + reduce_b - backward)
    per_step = max(0.0, allreduce - backward) + gather_step
    total = config.grad_accum * (gather_f + gather_b + reduce_b) + allreduce + gather_step
    return per_mb, per_step, total


def _reduce_itemsize(config: Config) -> int:
    """Gradients are reduced in fp32 by FSDP2 under mixed precision, otherwise in the dtype they have."""
    if config.engine is Engine.FSDP2 and precision.is_mixed(config.precision):
        return 4
    return precision.grad_itemsize(config.precision, config.engine)
