"""The bf16 GEMM size law of costmodels/compute.py (MAMF x m / (m + GEMM_HALF_TOKENS) x k / (k + GEMM_HALF_WIDTH),
with cuBLAS alignment) against this project's H200 kernel measurements (benchmarks/data/gpu/h200_kernels.json
`gemm_bf16`: forward, input-gradient and weight-gradient GEMMs of real layer shapes). The end-to-end grid of
benchmarks/calibrate.py may prefer another width (docs/fidelity.md); the kernel data decides it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from benchmarks import calibrate
from costmodels import compute, identity_memo
from costmodels.alignment import alignment_factor
from costmodels.hardware import find_gpu

DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "gpu" / "h200_kernels.json"


@pytest.fixture(autouse=True)
def _fresh_memos():
    """Kernel rates cached at another width (here or by an earlier test) must not answer for this one."""
    identity_memo.clear_all()
    yield
    identity_memo.clear_all()


def median_error() -> float:
    gpu = find_gpu("H200")
    rows = [r for r in json.loads(DATA.read_text())["gemm_bf16"] if "tflops" in r]
    assert len(rows) >= 200
    errors = [compute.kernel_speed(gpu, matmul_dtype="bf16", attention_dtype="bf16", tokens=r["m"], width=r["k"],
                                   seq_len=2048, head_dim=128,
                                   alignment=alignment_factor(gpu, "bf16", (r["m"], r["n"], r["k"]))).matmul_flops
              / 1e12 / r["tflops"] - 1 for r in rows]
    return statistics.median(abs(e) for e in errors)


def test_the_size_law_follows_the_h200_gemms():
    assert median_error() < 0.15


def test_no_other_width_of_the_grid_follows_the_h200_gemms_better(monkeypatch):
    chosen = median_error()
    for width in calibrate.GRID["GEMM_HALF_WIDTH"]:
        monkeypatch.setattr(compute, "GEMM_HALF_WIDTH", width)
        identity_memo.clear_all()
        assert median_error() >= chosen - 1e-12, width
