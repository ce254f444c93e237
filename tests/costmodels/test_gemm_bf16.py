"""The bf16 GEMM size law of costmodels/compute.py (MAMF x m / (m + GEMM_HALF_TOKENS) x k / (k + GEMM_HALF_WIDTH),
with cuBLAS alignment) against this project's H200 kernel measurements (benchmarks/data/gpu/h200_kernels.json
`gemm_bf16`: forward, input-gradient and weight-gradient GEMMs of real layer shapes). The end-to-end grid of
benchmarks/calibrate.py may prefer another width (docs/fidelity.md); the kernel data decides it."""

from __future__ import annotations

import json
import statistics

from benchmarks import calibrate
from costmodels import compute
from tests.costmodels.test_gemm_fp8 import DATA, rate


def median_error() -> float:
    """Median |error| of the law's rate (`compute.kernel_speed`, read afresh: it caches nothing) per GEMM."""
    rows = [r for r in json.loads(DATA.read_text())["gemm_bf16"] if "tflops" in r]
    assert len(rows) >= 200
    return statistics.median(abs(rate("bf16", r["m"], r["n"], r["k"]) / 1e12 / r["tflops"] - 1) for r in rows)


def test_the_size_law_follows_the_h200_gemms():
    assert median_error() < 0.15


def test_no_other_width_of_the_grid_follows_the_h200_gemms_better(monkeypatch):
    chosen = median_error()
    for width in calibrate.GRID["GEMM_HALF_WIDTH"]:
        monkeypatch.setattr(compute, "GEMM_HALF_WIDTH", width)
        assert median_error() >= chosen - 1e-12, width
