"""The `Estimate` a configuration gets: memory per GPU and time per step, each with its breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per GPU at the allocated peak, by category; the categories sum to `allocated_peak`."""

    parameters: int
    """Parameter storage resident at the peak (own shards plus gathered copies counted under `temporary`)."""
    gradients: int
    """Gradient storage resident at the peak."""
    optimizer_states: int
    """Optimizer moments, fp32 master weights and step counters on the GPU."""
    activations: int
    """Tensors saved for backward that are alive at the peak (plus the input batch)."""
    temporary: int
    """Everything else alive at the peak: op workspaces, logits, gathered parameters, reduce buckets."""
    allocated_peak: int
    """What torch.cuda.max_memory_allocated() would report."""
    reserved_peak: int
    """The caching allocator's reservation at that peak (allocated plus rounding and fragmentation)."""
    overhead: int
    """CUDA context, NCCL buffers and the cuBLAS workspace, outside the allocator."""
    device_peak: int
    """What the GPU must hold: reserved plus overhead."""
    peak_at: str
    """Where in the step the peak happens, e.g. "backward layers.31" or "optimizer step"."""
    cpu_bytes_per_node: int = 0
    """Host RAM that offloaded states need on each node (pinned buffers included)."""
    nvme_bytes_per_node: int = 0
    """NVMe space that offloaded states need on each node."""

    def __post_init__(self) -> None:
        parts = self.parameters + self.gradients + self.optimizer_states + self.activations + self.temporary
        if parts != self.allocated_peak:
            raise ValueError(f"memory categories sum to {parts}, not allocated_peak={self.allocated_peak}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBreakdown:
    """Seconds per optimizer step, by category; the categories sum to `step_time`."""

    compute: float
    """Forward and backward kernels (roofline with size-dependent efficiency)."""
    recompute: float
    """Forward work repeated in backward by activation checkpointing."""
    communication: float
    """Collective time not hidden behind compute (TP, data-parallel reduction, ZeRO-3/FSDP gathers)."""
    offload: float
    """Host transfers, NVMe traffic and the CPU optimizer step not hidden behind compute."""
    optimizer: float
    """The optimizer step on the GPU."""
    step_time: float
    communication_total: float = 0.0
    """All collective time, hidden or not."""
    details: tuple[tuple[str, float], ...] = ()
    """Finer items (seconds), e.g. ("tp_allreduce", ...), for explanation only."""

    def __post_init__(self) -> None:
        parts = self.compute + self.recompute + self.communication + self.offload + self.optimizer
        if abs(parts - self.step_time) > 1e-9 * max(1.0, self.step_time):
            raise ValueError(f"time categories sum to {parts}, not step_time={self.step_time}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """A configuration's cost: memory per GPU and time per optimizer step."""

    memory: MemoryBreakdown
    time: TimeBreakdown
    tokens_per_second: float
    """Training tokens per second over the whole cluster."""
    mfu: float
    """Model FLOPs utilisation: 6 * N * tokens (+ attention) over the cluster's dense peak, per second."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Assumptions and caveats behind the numbers."""
