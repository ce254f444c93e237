"""Fit the compute-efficiency constants of costmodels/compute.py globally on the published throughputs.

A grid search over (GEMM_HALF_TOKENS, GEMM_HALF_WIDTH, MEMORY_EFFICIENCY, ATTENTION_EFFICIENCY) that minimises
the median |error| of predicted tokens/s over every modelled row of throughput_published.json. It prints the
best values; they are copied into compute.py by hand (with this script cited), never tuned per row.
Usage: python benchmarks/calibrate.py
"""

from __future__ import annotations

import itertools
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import costmodels.compute as compute
from benchmarks import fidelity

# GEMM_HALF_TOKENS stays at or below 512 rows (GEMM benchmarks reach most of peak by then).
GRID = {"GEMM_HALF_TOKENS": [128, 256, 512], "GEMM_HALF_WIDTH": [128, 256, 512, 1024],
        "MEMORY_EFFICIENCY": [0.4, 0.6, 0.8], "ATTENTION_EFFICIENCY": [0.3, 0.4, 0.5, 0.6]}


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    best = None
    for values in itertools.product(*GRID.values()):
        for name, value in zip(GRID, values, strict=True):
            setattr(compute, name, value)
        rows, _ = fidelity.time_fidelity(fidelity.DATA, folder)
        errors = [abs(r["error"]) for r in rows]
        score = (statistics.median(errors), max(errors))
        if best is None or score < best[0]:
            best = (score, dict(zip(GRID, values, strict=True)))
            print(f"median |error| {score[0]:.1%} max {score[1]:.1%}: {best[1]}", flush=True)
    print("best:", best)


if __name__ == "__main__":
    main()
