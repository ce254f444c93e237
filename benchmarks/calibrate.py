"""Fit the compute-efficiency constants of costmodels/compute.py globally on the published throughputs, and
say how well they hold on a source they were not fitted to.

A grid search over (GEMM_HALF_TOKENS, GEMM_HALF_WIDTH, MEMORY_EFFICIENCY, ATTENTION_SUSTAINED) that minimises
the median |error| of predicted tokens/s over every modelled row of throughput_published.json. The best values
are copied into compute.py by hand (with this script cited), never tuned per row. Leave-one-source-out: for
each source, the constants are fitted on the other sources and its rows are scored with them; that is the
honest error on data the model was not fitted to (benchmarks/fidelity.py prints it beside the in-sample one).

Usage: python benchmarks/calibrate.py   (writes benchmarks/results/calibration.json)
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import costmodels.compute as compute
from benchmarks import fidelity
from costmodels import identity_memo

# GEMM_HALF_TOKENS stays at or below 512 rows (GEMM benchmarks reach most of peak by then).
# ATTENTION_SUSTAINED scales the kernel papers' attention curves (costmodels/data/attention_kernels.json), at most 1.
GRID = {"GEMM_HALF_TOKENS": [128, 256, 512], "GEMM_HALF_WIDTH": [128, 256, 512, 1024],
        "MEMORY_EFFICIENCY": [0.4, 0.6, 0.8], "ATTENTION_SUSTAINED": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0]}
OUT = Path(__file__).resolve().parent / "results" / "calibration.json"

Grid = list[tuple[dict[str, float], list[dict]]]


def grid_errors(data: Path = fidelity.DATA) -> Grid:
    """Every grid point with the fidelity rows it gives (the constants restored afterwards)."""
    saved = {name: getattr(compute, name) for name in GRID}
    folder = Path(tempfile.mkdtemp())
    points = []
    try:
        for values in itertools.product(*GRID.values()):
            chosen = dict(zip(GRID, values, strict=True))
            for name, value in chosen.items():
                setattr(compute, name, value)
            identity_memo.clear_all()  # the node times and kernel rates cached at the previous point's constants
            rows, _ = fidelity.time_fidelity(data, folder)
            points.append((chosen, rows))
    finally:
        for name, value in saved.items():
            setattr(compute, name, value)
        identity_memo.clear_all()
    return points


def score(rows: list[dict]) -> tuple[float, float]:
    errors = [abs(r["error"]) for r in rows]
    return (statistics.median(errors), max(errors)) if errors else (0.0, 0.0)


def fit(grid: Grid, keep: Callable[[dict], bool]) -> tuple[dict[str, float], list[dict]]:
    """The grid point with the least (median, max) |error| over the rows `keep` selects, and all its rows."""
    return min(grid, key=lambda point: score([r for r in point[1] if keep(r)]))


def leave_one_source_out(grid: Grid) -> dict[str, dict]:
    """Per source: the constants fitted without it, and its rows' errors under them."""
    sources = sorted({r["source"] for r in grid[0][1]})
    result = {}
    for source in sources:
        values, rows = fit(grid, lambda r, s=source: r["source"] != s)
        held_out = [r for r in rows if r["source"] == source]
        result[source] = {"fitted_without": values, "rows": held_out}
    return result


def main() -> None:
    grid = grid_errors()
    best, rows = fit(grid, lambda r: True)
    median, worst = score(rows)
    print(f"in-sample best: median |error| {median:.1%} max {worst:.1%}: {best}")
    loso = leave_one_source_out(grid)
    for source, entry in loso.items():
        m, w = score(entry["rows"])
        print(f"left out {source:22} median |error| {m:.1%} max {w:.1%} "
              f"(fitted on the rest: {entry['fitted_without']})")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"grid": GRID, "best": best, "leave_one_source_out": loso}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
