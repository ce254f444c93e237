"""What `fitplan measure` prints: each measured rate beside the datasheet value it replaces."""

from __future__ import annotations

import statistics

from costmodels import find_gpu
from costmodels.compute import measured_matmul_ceiling
from costmodels.profile import Profile


def profile_lines(profile: Profile, path: str) -> list[str]:
    """One line per measurement family: the median rate, the largest spread, and the datasheet figure."""
    gpu = find_gpu(profile.gpu)
    versions = [f"torch {profile.torch}"] + [f"CUDA {profile.cuda}"] * bool(profile.cuda)
    versions += [f"driver {profile.driver}"] * bool(profile.driver) + ["quick"] * profile.quick
    lines = [f"Profile of {profile.devices} x {profile.device_name} ({gpu.id}; {', '.join(versions)}) -> {path}"]
    for dtype in sorted({p.dtype for p in profile.gemm}):
        points = [p for p in profile.gemm if p.dtype == dtype]
        best = max(p.flops_per_s for p in points)
        ceiling = measured_matmul_ceiling(gpu, profile, dtype) or 0.0
        peak = gpu.peak_flops(dtype)
        lines.append(f"  GEMM {dtype:<5} {len(points)} shapes: best {best / 1e12:.3f} TFLOP/s, implied ceiling "
                     f"{ceiling / 1e12:.3f} (datasheet peak {'-' if peak is None else f'{peak / 1e12:g}'}), "
                     f"spread <= {_spread(points):.0%}")
    for dtype in sorted({p.dtype for p in profile.attention}):
        points = [p for p in profile.attention if p.dtype == dtype]
        backends = ", ".join(sorted({p.backend for p in points}))
        lines.append(f"  attention {dtype:<5} ({backends}): {(profile.attention_rate(dtype) or 0) / 1e12:.3f} "
                     f"TFLOP/s as counted, spread <= {_spread(points):.0%}")
    for fit in profile.links:
        points = [p for p in profile.collectives if p.op == fit.op]
        lines.append(f"  {fit.op:<15} bus {fit.bus_bandwidth / 1e9:.2f} GB/s, latency {fit.latency * 1e6:.1f} us "
                     f"per step ({len(points)} sizes on {profile.devices} ranks, spread <= {_spread(points):.0%})")
    for name in sorted({r.name for r in profile.rates}):
        points = [r for r in profile.rates if r.name == name]
        unit = "params/s" if name.startswith("adam") else "GB/s"
        rate = statistics.median(r.rate for r in points) / (1e9 if unit == "GB/s" else 1e6)
        lines.append(f"  {name:<20} {rate:.2f} {'M params/s' if unit == 'params/s' else unit}, "
                     f"spread <= {_spread(points):.0%}")
    if profile.context_bytes is not None:
        lines.append(f"  CUDA context          {profile.context_bytes / 2**20:.0f} MiB")
    return lines


def _spread(points: list) -> float:
    return max((p.time.spread for p in points), default=0.0)
