"""One rule for "it fits", shared by `fitplan estimate` and the solver.

A configuration fits when its device peak (allocator reservation plus context, NCCL and cuBLAS overhead) is at most
the GPU's memory less a headroom fraction, floored to whole bytes, and its offloaded states fit the host. The solver
states the same rule as a budget on the allocated peak (`memory_budget`): the allocator's reservation never
decreases as the allocated peak grows, so "allocated <= budget" and "device peak <= usable" accept the same
configurations. Under the classic allocator a fitting configuration is "at risk" when the worst fragmentation seen
in replayed steps would take it past the usable memory: a stated risk, not a refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from graphs.errors import FitplanError

from .breakdown import Estimate, MemoryBreakdown
from .cluster import Cluster
from .config import Config
from .overhead import allocated_budget, runtime_overhead

DEFAULT_HEADROOM = 0.05
"""Fraction of each GPU's memory kept free unless the user says otherwise (`solve` and `estimate`)."""
GIB = 2**30


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether one configuration fits, with the numbers the rule compares."""
    fits: bool
    """Device peak within the usable memory, and offloaded states within the host."""
    device_peak: int
    """Bytes per GPU the configuration needs at its peak (reserved + overhead)."""
    capacity: int
    """The GPU's memory, bytes (the driver's figure where the catalog has one)."""
    headroom: float
    """Fraction of `capacity` kept free."""
    usable: int
    """floor(capacity * (1 - headroom)): what the device peak may use."""
    host_needed: int = 0
    """Host RAM per node the offloaded states need."""
    host_available: int | None = None
    """Host RAM per node, or None when only device memory was checked."""
    nvme_missing: bool = False
    """States are offloaded to NVMe on a cluster without NVMe."""
    risk_peak: int = 0
    """The device peak with the worst fragmentation replayed steps showed (classic allocator), else `device_peak`."""

    @property
    def margin(self) -> int:
        """Usable bytes left at the peak; negative when the device peak does not fit."""
        return self.usable - self.device_peak

    @property
    def device_fits(self) -> bool:
        return self.device_peak <= self.usable

    @property
    def left(self) -> float:
        """Fraction of the GPU's memory free at the device peak (negative past the card): the plan's "fits with X%
        left"."""
        return (self.capacity - self.device_peak) / self.capacity if self.capacity else 0.0

    @property
    def inside_headroom(self) -> bool:
        """It does not fit the usable memory but does fit the card: the headroom, kept for the estimate's error,
        is what refuses it (a risk the user may take with a smaller --headroom, issue 35 item 3)."""
        return not self.device_fits and self.device_peak <= self.capacity

    @property
    def at_risk(self) -> bool:
        """It fits, but the classic allocator's worst replayed fragmentation would not."""
        return self.fits and self.risk_peak > self.usable

    @property
    def sentence(self) -> str:
        """The rule with its numbers, e.g. "fits: device peak 20.10 GiB <= 21.37 GiB usable (22.49 GiB less 5%
        headroom)"."""
        sign = "<=" if self.device_fits else ">"
        verdict = f"fits with {self.left:.1%} left" if self.fits else "does NOT fit"
        text = (f"{verdict}: device peak {self.device_peak / GIB:.2f} GiB {sign} "
                f"{self.usable / GIB:.2f} GiB usable ({self.capacity / GIB:.2f} GiB less {self.headroom * 100:g}% "
                "headroom)")
        if self.inside_headroom:
            text += (f"; it fits the card with {self.left:.1%} left, inside the {self.headroom * 100:g}% headroom "
                     f"kept for the estimate's error: at risk (--headroom {headroom_to_fit(self.left):g} accepts it)")
        if self.host_available is not None and self.host_needed > self.host_available:
            text += (f"; offloaded states need {self.host_needed / GIB:.1f} GiB host RAM per node, "
                     f"{self.host_available / GIB:.1f} GiB available")
        if self.nvme_missing:
            text += "; states offloaded to NVMe but the cluster has no NVMe"
        if self.at_risk:
            text += (f"; at risk: with the classic allocator's worst replayed fragmentation the device peak would be "
                     f"{self.risk_peak / GIB:.2f} GiB (expandable segments remove that risk)")
        return text


def headroom_to_fit(left: float) -> float:
    """The largest headroom, in whole tenths of a percent, under which a device peak leaving `left` of the card
    free fits (0 when it leaves less than a tenth)."""
    return max(0.0, math.floor(left * 1000) / 1000)


def check_headroom(headroom: float) -> float:
    """`headroom` if it is a fraction in [0, 1); FitplanError otherwise."""
    if isinstance(headroom, bool) or not isinstance(headroom, int | float) or not 0 <= headroom < 1:
        raise FitplanError(f"headroom={headroom!r} must be a fraction in [0, 1)", "e.g. --headroom 0.1 keeps 10% free.")
    return float(headroom)


def usable_bytes(capacity: int, headroom: float) -> int:
    """What a configuration's device peak may use: the capacity less the headroom, floored to whole bytes."""
    return math.floor(capacity * (1 - check_headroom(headroom)))


def host_fits(cpu_bytes: int, nvme_bytes: int, cluster: Cluster) -> bool:
    """Offloaded states fit the node: host RAM within the node's, and NVMe only where the cluster has it."""
    return cpu_bytes <= cluster.cpu_ram_per_node and (nvme_bytes == 0 or cluster.nvme_bandwidth > 0)


def memory_budget(cluster: Cluster, config: Config, headroom: float) -> int:
    """The solver's form of the rule: the largest allocated peak whose device peak is within the usable memory."""
    return allocated_budget(usable_bytes(cluster.gpu.memory_bytes, headroom), runtime_overhead(cluster, config),
                            config.expandable_segments)


def fits(memory: Estimate | MemoryBreakdown, cluster: Cluster | int, headroom: float = DEFAULT_HEADROOM) -> Verdict:
    """The verdict on an estimate for a cluster (device and host), or for a bare device capacity in bytes."""
    breakdown = memory.memory if isinstance(memory, Estimate) else memory
    capacity = cluster if isinstance(cluster, int) else cluster.gpu.memory_bytes
    usable = usable_bytes(capacity, headroom)
    device_ok = breakdown.device_peak <= usable
    risk = breakdown.device_peak + breakdown.fragmentation_risk
    if isinstance(cluster, int):
        return Verdict(fits=device_ok, device_peak=breakdown.device_peak, capacity=capacity, headroom=headroom,
                       usable=usable, risk_peak=risk)
    cpu, nvme = breakdown.cpu_bytes_per_node, breakdown.nvme_bytes_per_node
    return Verdict(fits=device_ok and host_fits(cpu, nvme, cluster), device_peak=breakdown.device_peak,
                   capacity=capacity, headroom=headroom, usable=usable, host_needed=cpu,
                   host_available=cluster.cpu_ram_per_node, nvme_missing=nvme > 0 and cluster.nvme_bandwidth <= 0,
                   risk_peak=risk)
