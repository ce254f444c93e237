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
    """What the caching allocator must hold from the device to reach that peak (`overhead.reserved_bytes`: its
    pages or blocks and what they leave unused). A run with room to spare may cache more (max_memory_reserved())."""
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
    fragmentation_risk: int = 0
    """Bytes above `reserved_peak` the classic allocator's fragmentation may take (up to the worst replayed step's,
    `overhead.fragmentation_risk_bytes`); 0 with expandable segments."""

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
    bubble: float = 0.0
    """Pipeline parallelism: seconds the busiest rank waits for its neighbours (the schedule's fill and drain
    with uneven stages, and the point-to-point sends on its critical path)."""

    def __post_init__(self) -> None:
        parts = self.compute + self.recompute + self.communication + self.offload + self.optimizer + self.bubble
        if abs(parts - self.step_time) > 1e-9 * max(1.0, self.step_time):
            raise ValueError(f"time categories sum to {parts}, not step_time={self.step_time}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineRank:
    """One pipeline rank's share of the step."""

    rank: int
    stages: tuple[int, ...]
    """Global stage ids it runs."""
    layers: int
    """Decoder layers it holds."""
    in_flight: int
    """Micro-batch stage sets (one micro-batch through one of its stages) alive at once at most, the running one
    included: micro-batches with one stage per rank."""
    memory: MemoryBreakdown
    busy: float
    """Seconds of compute per step: its stages' forward and backward for every micro-batch."""
    outside: float
    """Seconds per step outside the schedule: data-parallel synchronisation, offload and the optimizer step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineReport:
    """How a pipeline-parallel configuration splits and schedules the model, and what each rank holds."""

    schedule: str
    pp: int
    virtual: int
    micro_batches: int
    stage_layers: tuple[int, ...]
    """Decoder layers of each global stage."""
    stage_forward: tuple[float, ...]
    """Seconds of one micro-batch's forward in each stage."""
    stage_backward: tuple[float, ...]
    """Seconds of one micro-batch's backward in each stage (recompute included)."""
    p2p: tuple[float, ...]
    """Seconds of one activation send across each stage boundary."""
    schedule_seconds: float
    """The simulated schedule, first forward to last backward."""
    bubble_fraction: float
    """Idle share of all ranks' time over the schedule."""
    ranks: tuple[PipelineRank, ...]


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
    pipeline: PipelineReport | None = None
    """Per-stage memory and times, and the bubble, of a pipeline-parallel configuration (`memory` is then the
    rank with the largest device peak)."""
