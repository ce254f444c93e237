"""Explaining infeasibility: the least memory any configuration needs, what binds, and concrete ways out."""

from __future__ import annotations

from typing import Any

from costmodels import Offload, load_gpus
from graphs import FitplanError

from .plan import Inputs
from .search import SearchResult
from .space import Pins, Space, leanest_modes

GIB = 2**30


class Infeasible(FitplanError):
    """No configuration fits; `diagnosis` holds the numbers behind the message."""

    def __init__(self, message: str, hint: str = "", diagnosis: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint)
        self.diagnosis = diagnosis or {}


def diagnose(found: SearchResult | None, inputs: Inputs, pins: Pins, space: Space) -> tuple[str, str, dict[str, Any]]:
    """(message, hint, diagnosis) for a request with no feasible configuration."""
    cluster = inputs.cluster
    if found is None or not found.tables:
        message = (f"No configuration is possible for {inputs.model} on {cluster.spec}: the pins and divisibility "
                   f"rules leave nothing (global batch {inputs.global_batch} over the data-parallel ranks, TP "
                   "degrees that divide the heads and fit a node).")
        hint = "Relax the pins, or pick a global batch divisible by the number of GPUs / TP degree."
        return message, hint, {"binding": "pins", "pins": inputs.pins}
    lean = leanest_modes(space.modes, len(found.tables[0].layer_ticks))
    peaks = [t.peak_of(lean) for t in found.tables]
    need, least = min(zip(found.tables, peaks, strict=True), key=lambda pair: (pair[1] - pair[0].budget, pair[0].rank))
    budget = need.budget
    device_fits = [t for t, peak in zip(found.tables, peaks, strict=True) if peak <= t.budget]
    binding = "host RAM for offloaded states" if device_fits and not any(t.host_ok for t in device_fits) \
        else "GPU memory"
    ways = _ways_out(inputs, pins, least, budget)
    message = (f"Nothing fits {inputs.model} on {cluster.spec} ({cluster.gpu_name}): the leanest configuration "
               f"({need.outer.engine}, zero={need.outer.zero}, tp={need.outer.tp}, micro-batch "
               f"{need.outer.micro_batch}, every layer checkpointed) needs {least / GIB:.1f} GiB allocated per GPU; "
               f"{budget / GIB:.1f} GiB is available after overhead and {inputs.headroom:.0%} headroom. "
               f"Binding resource: {binding}.")
    hint = "Ways out: " + "; ".join(ways)
    return message, hint, {"binding": binding, "least_allocated_bytes": least, "budget_bytes": budget,
                           "ways_out": ways}


def _ways_out(inputs: Inputs, pins: Pins, least: int, budget: int) -> list[str]:
    ways = []
    bigger = sorted((g.memory_bytes, g.name) for g in load_gpus().values()
                    if g.vendor != "cpu" and g.memory_bytes > inputs.cluster.gpu_memory_bytes)
    enough = [name for memory, name in bigger if memory * (budget / max(1, inputs.cluster.gpu_memory_bytes)) >= least]
    if enough:
        ways.append(f"larger GPUs: {', '.join(enough[:3])} would hold {least / GIB:.1f} GiB")
    ratio = least / max(1, budget)
    gpus = inputs.cluster.nodes * inputs.cluster.gpus_per_node
    ways.append(f"more GPUs: model states shard with ZeRO-3/FSDP; try about {max(2 * gpus, int(gpus * ratio) + 1)} "
                "GPUs of this kind")
    if pins.offload in (None, Offload.NONE) or pins.param_offload in (None, Offload.NONE):
        ways.append("offload: allow --offload cpu (and parameter offload with ZeRO-3) if it was pinned off")
    ways.append("LoRA: --lora-rank 16 (or --allow-lora) trains adapters only and drops most gradient and "
                "optimizer memory")
    ways.append(f"shorter sequences: --seq-len {max(128, inputs.seq_len // 2)} halves activation memory")
    if pins.micro_batch and pins.micro_batch > 1:
        ways.append(f"a smaller micro-batch: --micro-batch {pins.micro_batch // 2}")
    return ways
