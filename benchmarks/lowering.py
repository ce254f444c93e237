"""Lowering time and peak RSS for catalog models of 1B to 405B, cold (empty cache) and cached.

Each measurement runs in a fresh process so that import time and memory are counted honestly.
Usage: python benchmarks/lowering.py [--out benchmarks/results/lowering.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MODELS = ["meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B",
          "meta-llama/Llama-3.1-405B"]

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import graphs
t1 = time.perf_counter()
graph = graphs.lower(sys.argv[1])
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "lower_s": t2 - t1, "params": graph.param_count,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(model: str, cache_dir: str) -> dict:
    env = {**os.environ, "FITPLAN_CACHE_DIR": cache_dir, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/lowering.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for model in MODELS:
            for state in ("cold", "cached"):
                rows.append({"model": model, "state": state, **measure(model, cache)})
    header = f"{'model':28} {'state':6} {'params':>16} {'import s':>9} {'lower s':>8} {'process s':>10}"
    print(header + f" {'peak RSS MiB':>13}")
    for r in rows:
        print(f"{r['model']:28} {r['state']:6} {r['params']:>16,} {r['import_s']:>9.2f} {r['lower_s']:>8.2f} "
              f"{r['process_s']:>10.2f} {r['peak_rss_mib']:>13.0f}")
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
