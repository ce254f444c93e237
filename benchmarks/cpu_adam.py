"""Host optimizer throughput: DeepSpeed's CPUAdam against torch's AdamW on CPU tensors (fused, foreach and the
single-tensor loop that torch picks by default for CPU parameters), on this machine.

Writes costmodels/data/cpu_adam.json: each implementation's parameters per second and its speed relative to
DeepSpeed's CPUAdam. The cost model keeps DeepSpeed's step as a memory-bandwidth model of the host and prices
torch's implementations by these ratios (kernel-level data measured here, not fitted to any end-to-end table).

Usage: python benchmarks/cpu_adam.py [--elements N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "costmodels" / "data" / "cpu_adam.json"


def rates(makers: dict[str, object], elements: int, repeats: int) -> dict[str, tuple[float, float]]:
    """Per implementation, (median parameters/s, relative spread) of `repeats` timed steps after one warm-up
    step; the implementations take turns, so that load from other processes falls on all of them alike."""
    optimizers = {}
    for name, make in makers.items():
        param = torch.nn.Parameter(torch.randn(elements))
        param.grad = torch.randn(elements)
        optimizers[name] = make([param])
        optimizers[name].step()
    samples: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(repeats):
        for name, optimizer in optimizers.items():
            started = time.perf_counter()
            optimizer.step()
            samples[name].append(elements / (time.perf_counter() - started))
    result = {}
    for name, values in samples.items():
        median = statistics.median(values)
        result[name] = (median, (max(values) - min(values)) / median)
    return result


def implementations() -> dict[str, object]:
    found = {
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch_single": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        found["deepspeed_cpu_adam"] = lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, adamw_mode=True)
    except ImportError:
        pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=20_000_000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    results = rates(implementations(), args.elements, args.repeats)
    if "deepspeed_cpu_adam" not in results:
        raise SystemExit("DeepSpeed's CPUAdam is not importable: pip install deepspeed (it builds the op on first use)")
    reference = results["deepspeed_cpu_adam"][0]
    print(f"{'implementation':<20} {'M params/s':>10} {'spread':>7} {'vs DeepSpeed':>12}")
    for name, (value, spread) in results.items():
        print(f"{name:<20} {value / 1e6:>10.1f} {spread:>6.0%} {reference / value:>11.2f}x")
    record = {
        "_source": "benchmarks/cpu_adam.py on the machine below: one fp32 tensor of `elements` parameters per "
                   "implementation, one warm-up step, then `repeats` rounds in which each implementation takes one "
                   "timed step in turn; the median per implementation; torch threads as set by default.",
        "measured": str(date.today()), "machine": {"cpu": platform.processor() or platform.machine(),
                                                   "cores": os.cpu_count(), "torch": torch.__version__,
                                                   "threads": torch.get_num_threads()},
        "elements": args.elements, "repeats": args.repeats,
        "params_per_second": {name: value for name, (value, _) in results.items()},
        "spread": {name: spread for name, (_, spread) in results.items()},
        "slowdown_vs_deepspeed": {name: reference / value for name, (value, _) in results.items()},
    }
    OUT.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
