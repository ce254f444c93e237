"""A machine profile: kernel, link and host rates measured on the user's node by `fitplan measure`.

The cost models read it in place of datasheet constants (compute.py, collectives.py, offload.py, overhead.py)
wherever it has a measurement; everything it lacks keeps the cited constant. Loading validates with pydantic.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import ConfigDict, NonNegativeFloat, PositiveFloat, PositiveInt, TypeAdapter, ValidationError

from graphs.errors import FitplanError
from graphs.files import UnreadableFile, parse_json, read_text

PROFILE_VERSION = 1
_CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True)
_HINT = "Write one with `fitplan measure -o profile.json` on the machine it describes."
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter"]
# Ring step counts per op, as collectives.py charges them: time = steps(n) * latency + share(n) * bytes / bandwidth.
COLLECTIVE_SHARE = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}


class InvalidProfile(FitplanError):
    """A profile file that cannot be read or does not describe the cluster's GPU."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """Seconds of one measured operation over its timed repeats (after warm-up)."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    median: NonNegativeFloat
    """Median seconds."""
    spread: NonNegativeFloat
    """(max - min) / median over the repeats: 0.05 means the repeats differ by 5%."""
    repeats: PositiveInt
    """Timed repeats."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GemmPoint:
    """One (m x k) @ (k x n) matmul in `dtype`."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    dtype: Literal["fp32", "tf32", "fp16", "bf16", "fp8"]
    """Operand dtype."""
    m: PositiveInt
    """Rows: tokens per micro-batch."""
    n: PositiveInt
    """Output width."""
    k: PositiveInt
    """Reduction width."""
    time: Timing
    """Seconds per matmul."""

    @property
    def flops_per_s(self) -> float:
        return 2 * self.m * self.n * self.k / max(self.time.median, 1e-12)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionPoint:
    """Causal scaled_dot_product_attention forward + backward with one backend."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    dtype: Literal["fp32", "fp16", "bf16"]
    """Operand dtype."""
    backend: str
    """SDPA backend: flash, efficient, cudnn or math."""
    batch: PositiveInt
    heads: PositiveInt
    seq_len: PositiveInt
    head_dim: PositiveInt
    flops: PositiveFloat
    """FLOPs torch's FlopCounterMode charges for forward + backward (full s^2, as the lowering counts them)."""
    time: Timing
    """Seconds per forward + backward."""

    @property
    def flops_per_s(self) -> float:
        return self.flops / max(self.time.median, 1e-12)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectivePoint:
    """One collective over `ranks` local devices; `nbytes` is the full buffer (as collectives.py takes it)."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    op: CollectiveOp
    ranks: PositiveInt
    nbytes: PositiveInt
    time: Timing
    """Seconds per call (slowest rank's median)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    """Alpha-beta fit of one collective: seconds = steps * latency + share * (n-1)/n * bytes / bus_bandwidth."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    op: CollectiveOp
    bus_bandwidth: PositiveFloat
    """Bytes/s per rank (nccl-tests' "bus bandwidth")."""
    latency: NonNegativeFloat
    """Seconds per ring step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RatePoint:
    """A throughput measured directly: bytes/s (copies, memory-bound kernels) or parameters/s (optimizers)."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    name: str
    """What was measured, e.g. "h2d_pinned", "h2d_pageable", "device_copy", "adamw_torch", "adam_deepspeed"."""
    size: PositiveInt
    """Bytes copied, or parameters stepped, per call."""
    rate: PositiveFloat
    """Bytes/s or parameters/s at the median."""
    time: Timing


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """What `fitplan measure` found on one node: versions, and every measurement with its spread."""
    __pydantic_config__: ClassVar[ConfigDict] = _CONFIG
    version: Literal[1] = PROFILE_VERSION
    """Profile format version."""
    gpu: str
    """Catalog GPU id the measurements describe (e.g. "h100-sxm-80gb"; "cpu" for a CPU run)."""
    device_name: str
    """The name the driver (or the CPU) reports."""
    devices: PositiveInt
    """Local devices the collectives spanned."""
    driver: str | None = None
    """NVIDIA driver version, if any."""
    torch: str
    """torch version."""
    cuda: str | None = None
    """CUDA runtime torch was built with, if any."""
    created: str
    """UTC time of the measurement (ISO 8601)."""
    quick: bool = False
    """True when measured with --quick (fewer sizes and repeats)."""
    gemm: tuple[GemmPoint, ...] = ()
    attention: tuple[AttentionPoint, ...] = ()
    collectives: tuple[CollectivePoint, ...] = ()
    links: tuple[LinkFit, ...] = ()
    """Alpha-beta fits of `collectives`, one per op."""
    rates: tuple[RatePoint, ...] = ()
    context_bytes: NonNegativeFloat | None = None
    """CUDA context and kernel images: device memory in use before any tensor, bytes (None off CUDA)."""

    def rate(self, name: str) -> float | None:
        """Median of the measured rates called `name` (bytes/s or parameters/s), or None if not measured."""
        values = [p.rate for p in self.rates if p.name == name]
        return statistics.median(values) if values else None

    def link(self, op: CollectiveOp) -> LinkFit | None:
        return next((fit for fit in self.links if fit.op == op), None)

    def attention_rate(self, dtype: str) -> float | None:
        """Median FLOP/s of the fastest backend's attention points in `dtype` (torch picks the fastest)."""
        points = [p for p in self.attention if p.dtype == dtype]
        if not points:
            return None
        by_backend: dict[str, list[float]] = {}
        for point in points:
            by_backend.setdefault(point.backend, []).append(point.flops_per_s)
        return max(statistics.median(rates) for rates in by_backend.values())


def load_profile(path: str | Path) -> Profile:
    """The profile in a JSON file; every error names the file."""
    path = Path(path)
    try:  # a regular file of at most 16 MiB: /dev/zero or a FIFO is refused unread
        data = parse_json(read_text(path, what="profile"), where=f"Profile {path}")
    except UnreadableFile as err:
        raise InvalidProfile(err.message, _HINT) from err
    return profile_from(data, origin=str(path))


def profile_from(data: object, *, origin: str) -> Profile:
    """A validated profile from parsed JSON."""
    if isinstance(data, dict) and data.get("version") not in (None, PROFILE_VERSION):
        raise InvalidProfile(f"Profile {origin} has version {data.get('version')!r}; this fitplan reads "
                             f"version {PROFILE_VERSION}.", _HINT)
    try:
        return TypeAdapter(Profile).validate_python(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:5])
        raise InvalidProfile(f"Profile {origin} is invalid: {problems}.", _HINT) from err


def profile_json(profile: Profile) -> str:
    """The profile as the JSON `load_profile` reads."""
    return json.dumps(TypeAdapter(Profile).dump_python(profile, mode="json"), indent=1) + "\n"


def fit_link(op: CollectiveOp, points: list[CollectivePoint]) -> LinkFit | None:
    """Least-squares alpha-beta fit of `points` of one op (None with fewer than two sizes)."""
    rows = [((p.ranks - 1) * COLLECTIVE_SHARE[op], COLLECTIVE_SHARE[op] * (p.ranks - 1) / p.ranks * p.nbytes,
             p.time.median) for p in points if p.op == op and p.ranks > 1]
    if len({x for _, x, _ in rows}) < 2:
        return None
    # seconds = steps * latency + volume * inverse_bandwidth: two unknowns, normal equations.
    sxx = sum(s * s for s, _, _ in rows), sum(s * v for s, v, _ in rows), sum(v * v for _, v, _ in rows)
    sy = sum(s * t for s, _, t in rows), sum(v * t for _, v, t in rows)
    det = sxx[0] * sxx[2] - sxx[1] ** 2
    latency = (sy[0] * sxx[2] - sy[1] * sxx[1]) / det
    inverse = (sxx[0] * sy[1] - sxx[1] * sy[0]) / det
    if latency < 0 or inverse <= 0:  # noisy small sizes: keep the slope through the origin of the largest
        largest = max(rows, key=lambda r: r[1])
        latency, inverse = 0.0, largest[2] / largest[1]
    return LinkFit(op=op, bus_bandwidth=1 / inverse, latency=latency)
