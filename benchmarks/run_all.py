"""Run every benchmark in turn (each prints its table and writes benchmarks/results/<name>.json).

Usage: python benchmarks/run_all.py [--quick]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ["lowering.py", "solve_time.py", "plan_quality.py", "fidelity.py", "allocator.py"]


def main() -> None:
    extra = ["--quick"] if "--quick" in sys.argv else []
    start = time.perf_counter()
    (HERE / "results").mkdir(exist_ok=True)
    for script in SCRIPTS:
        began = time.perf_counter()
        print(f"=== {script}", flush=True)
        args = [sys.executable, str(HERE / script)] + (extra if script == "solve_time.py" else [])
        subprocess.run(args, check=True, cwd=HERE.parent)
        print(f"=== {script}: {time.perf_counter() - began:.0f} s", flush=True)
    print(f"all benchmarks: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
