"""The caching allocator's reservation above the allocated peak, replayed on traced training steps.

Each case is a full HF training step traced on fake tensors (`graphs.allocation_trace`: pure bf16 weights and AdamW
states, two steps) and replayed through `costmodels.allocator`. It prints, per case, the requested (allocated)
peak, the least memory the allocator runs it in with classic and with expandable segments, and the reservation
formula of `costmodels/overhead.py`, whose allowances are the largest of the FIT cases rounded up (the HELD_OUT
cases are tests/costmodels/test_allocator.py's). Writes benchmarks/results/allocator.json.

Usage: python benchmarks/allocator.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from costmodels.allocator import replay, smallest_capacity  # noqa: E402
from costmodels.overhead import reserved_bytes  # noqa: E402
from graphs.allocation_trace import training_events  # noqa: E402

GIB = 2**30
# (model, micro-batch, sequence length, full recompute)
FIT = [("gpt2", 4, 512, False), ("gpt2", 16, 1024, False), ("meta-llama/Llama-3.2-1B", 1, 2048, False),
       ("meta-llama/Llama-3.2-1B", 4, 2048, False), ("meta-llama/Llama-3.2-1B", 2, 4096, True),
       ("Qwen/Qwen2.5-0.5B", 8, 1024, False), ("Qwen/Qwen2.5-0.5B", 2, 4096, True),
       ("Qwen/Qwen2.5-1.5B", 4, 2048, False), ("Qwen/Qwen2.5-1.5B", 1, 8192, True),
       ("meta-llama/Llama-3.2-3B", 2, 2048, False), ("meta-llama/Llama-3.2-3B", 8, 1024, True),
       ("meta-llama/Llama-3.1-8B", 1, 2048, True), ("meta-llama/Llama-3.1-8B", 2, 4096, True),
       ("Qwen/Qwen2.5-7B", 1, 4096, True)]
HELD_OUT = [("meta-llama/Llama-3.2-1B", 2, 1024, False), ("Qwen/Qwen2.5-0.5B", 4, 2048, True),
            ("gpt2", 8, 1024, False)]


def measure(model: str, micro_batch: int, seq_len: int, checkpoint: bool) -> dict[str, object]:
    events = training_events(model, micro_batch=micro_batch, seq_len=seq_len, checkpoint=checkpoint)
    requested = replay(events).requested
    classic, expandable = smallest_capacity(events), smallest_capacity(events, expandable=True)
    return {"model": model, "micro_batch": micro_batch, "seq_len": seq_len, "checkpoint": checkpoint,
            "allocated": requested, "classic_needs": classic, "expandable_needs": expandable,
            "classic_formula": reserved_bytes(requested, expandable=False),
            "expandable_formula": reserved_bytes(requested, expandable=True)}


def main() -> None:
    rows = []
    print(f"{'case':<44}{'allocated':>10}{'classic':>17}{'expandable':>17}  formula (classic / expandable)")
    for group, cases in (("fit", FIT), ("held-out", HELD_OUT)):
        for case in cases:
            began = time.perf_counter()
            row = {"set": group, **measure(*case)}
            rows.append(row)
            alloc = row["allocated"]
            name = f"{group}: {case[0].split('/')[-1]} b{case[1]} s{case[2]}{' ckpt' if case[3] else ''}"
            print(f"{name:<44}{alloc / GIB:>9.2f}G"
                  f"{row['classic_needs'] / GIB:>9.2f}G {row['classic_needs'] / alloc - 1:>+6.1%}"
                  f"{row['expandable_needs'] / GIB:>9.2f}G {row['expandable_needs'] / alloc - 1:>+6.2%}"
                  f"  {row['classic_formula'] / GIB:.2f}G / {row['expandable_formula'] / GIB:.2f}G"
                  f"  ({time.perf_counter() - began:.0f} s)", flush=True)
    for kind in ("classic", "expandable"):
        above = [r[f"{kind}_needs"] / r["allocated"] - 1 for r in rows if r["set"] == "fit"]
        held = all(r[f"{kind}_needs"] <= r[f"{kind}_formula"] for r in rows)
        print(f"{kind}: fit cases need {min(above):+.2%} to {max(above):+.2%} above the allocated peak; "
              f"the formula holds every case: {held}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "allocator.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
