"""How long the command line takes, as a user sees it: fresh processes, wall-clock seconds (issue 33's targets in
brackets). Run from the repository root: `python benchmarks/cli_latency.py [--repeats N]`; prints a table and writes
benchmarks/results/cli_latency.json.

- `fitplan --help` [<= 0.5 s];
- the README's solve with its lowerings in the user's cache ("warm") [<= 3 s], and on an empty user cache ("cold":
  the lowerings fitplan ships, else lowered afresh) [<= 15 s];
- Llama-3.1-405B on 1024xH100, warm [<= 8 s];
- `choose` for Llama-3.1-8B over three GPU types, warm [<= 20 s].
Each figure is the median of the repeats (cold: each repeat on a new empty cache). Machine load changes the
figures: the table records the load average before and after.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_SOLVE = ["solve", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "8xA100", "--json"]
CASES = {
    "fitplan --help": (["--help"], 0.5, "warm"),
    "README solve, warm": (README_SOLVE, 3.0, "warm"),
    "README solve, cold (empty cache)": (README_SOLVE, 15.0, "cold"),
    "405B on 1024xH100, warm": (["solve", "--model", "meta-llama/Llama-3.1-405B", "--gpus", "1024xH100", "--json"],
                                8.0, "warm"),
    "choose 8B x H100,A100-80GB,L40S, warm": (["choose", "--model", "meta-llama/Llama-3.1-8B", "--tokens", "1e9",
                                              "--gpu-types", "H100,A100-80GB,L40S", "--json"], 20.0, "warm"),
}


def timed(args: list[str], cache: Path) -> float:
    """Wall seconds of `python -m solver ARGS` in a fresh process."""
    env = {**os.environ, "FITPLAN_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "solver", *args], env=env, capture_output=True, text=True,
                          check=False, cwd=ROOT)
    if done.returncode not in (0, 3):
        raise RuntimeError(f"{args}: exit {done.returncode}: {done.stderr[-500:]}")
    return time.perf_counter() - started


def main(argv: list[str]) -> int:
    repeats = int(argv[argv.index("--repeats") + 1]) if "--repeats" in argv else 3
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fitplan-latency-") as folder:
        warm = Path(folder, "warm")
        for args, _, kind in CASES.values():  # fill the warm cache once
            if kind == "warm":
                timed(args, warm)
        for name, (args, target, kind) in CASES.items():
            seconds = [timed(args, warm if kind == "warm" else Path(folder, f"cold-{i}")) for i in range(repeats)]
            median = statistics.median(seconds)
            rows.append({"case": name, "median_s": round(median, 2), "min_s": round(min(seconds), 2),
                         "target_s": target, "meets": median <= target})
            print(f"{name:<42} {median:7.2f} s (min {min(seconds):.2f}, target {target:g}) "
                  f"{'ok' if median <= target else 'OVER'}")
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"load average before {load['before']}, after {load['after']} ({os.cpu_count()} CPUs)")
    out = ROOT / "benchmarks" / "results" / "cli_latency.json"
    out.write_text(json.dumps({"repeats": repeats, "cpus": os.cpu_count(), "load_average": load, "rows": rows},
                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
