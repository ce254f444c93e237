"""benchmarks/calibrate.py sweeps the fitted constants of costmodels/compute.py in one process; the cost memos
(costmodels/identity_memo.py) key on their functions' arguments, not on those constants, so each grid point must
price its rows afresh. Reference: each point priced in a process of its own, where nothing was cached before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import calibrate, fidelity

ROOT = Path(__file__).resolve().parents[2]
# One row of each route: torchtitan's code, the HF code (llm-foundry's MPT on GPT-2's layers), Mist's pipeline.
ROW_IDS = ("torchtitan_llama2-13b_mbs2_none", "mosaic_a100_40gb_1b_s2048_g64_mb10_ga1_bf16",
           "mist_l4_gpt_1.3b_flashTrue")
POINTS = ({"MEMORY_EFFICIENCY": 0.6, "ATTENTION_SUSTAINED": 0.5},
          {"MEMORY_EFFICIENCY": 0.4, "ATTENTION_SUSTAINED": 1.0})
FRESH = """
import json, sys, tempfile
from pathlib import Path
from benchmarks import fidelity
from costmodels import compute
for name, value in json.loads(sys.argv[2]).items():
    setattr(compute, name, value)
rows, _ = fidelity.time_fidelity(Path(sys.argv[1]), Path(tempfile.mkdtemp()))
print(json.dumps({r["id"]: r["error"] for r in rows}))
"""


@pytest.mark.slow
def test_every_grid_point_prices_its_rows_afresh(tmp_path, monkeypatch):
    rows = [r for r in json.loads((fidelity.DATA / "throughput_published.json").read_text()) if r["id"] in ROW_IDS]
    assert len(rows) == len(ROW_IDS)
    (tmp_path / "throughput_published.json").write_text(json.dumps(rows))
    monkeypatch.setattr(calibrate, "GRID", {name: [point[name] for point in POINTS] for name in POINTS[0]})
    grid = [(values, priced) for values, priced in calibrate.grid_errors(tmp_path) if values in POINTS]
    assert len(grid) == len(POINTS)
    for values, priced in grid:
        fresh = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path), json.dumps(values)], cwd=ROOT,
                               capture_output=True, text=True, check=True)
        expected = json.loads(fresh.stdout.strip().splitlines()[-1])
        assert {r["id"]: r["error"] for r in priced} == pytest.approx(expected, rel=1e-9), values
    first, second = ({r["id"]: r["error"] for r in priced} for _, priced in grid)
    assert first != second  # the constants move the prices
