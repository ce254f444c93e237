"""Real training steps of fitplan plans on one GPU: peaks (allocated, reserved under both allocators) and step times
beside the plans' estimates.

Two halves, on two machines:
- `python benchmarks/gpu/plans.py make DIR` (here, with fitplan installed): solves every case in CASES for one
  H200 with the torchrun launcher and writes DIR/<case>/ with plan.json, the emitted train_fitplan.py and the
  model's config.json.
- `python benchmarks/gpu/plans.py run DIR OUT` (on the GPU machine, torch + transformers + peft only): runs each
  case's own emitted script with torchrun on one GPU (random weights from the config, the planned batch shape),
  once with the plan's allocator setting (expandable segments; its step times are the measurement) and once with
  the classic allocator (for its reserved peak), gathering every run's rank report into the one file OUT.
  `--budget SECONDS` stops starting new runs once that much time has passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

GPUS = "1xH200"
# (name, solve arguments): full fine-tuning and LoRA of small and mid models, with and without recompute, the
# chunked loss, and one compiled plan; micro-batch and recompute pinned where the search would pick the same point
# for several cases. Steps are few: each case costs a model build plus ~5 steps.
CASES: dict[str, list[str]] = {
    "qwen0.5b-full-s2048-mb8": ["--model", "Qwen/Qwen2.5-0.5B", "--seq-len", "2048", "--global-batch", "8",
                                "--micro-batch", "8", "--compile", "off", "--checkpoint", "none"],
    "llama1b-full-s4096-mb4": ["--model", "meta-llama/Llama-3.2-1B", "--seq-len", "4096", "--global-batch", "4",
                               "--micro-batch", "4", "--compile", "off", "--checkpoint", "none"],
    "llama1b-full-s4096-mb8-ckpt": ["--model", "meta-llama/Llama-3.2-1B", "--seq-len", "4096", "--global-batch", "8",
                                    "--micro-batch", "8", "--compile", "off", "--checkpoint", "full"],
    "llama8b-lora16-s4096-mb4": ["--model", "meta-llama/Llama-3.1-8B", "--seq-len", "4096", "--global-batch", "4",
                                 "--micro-batch", "4", "--compile", "off", "--checkpoint", "none", "--lora-rank",
                                 "16"],
    "qwen1.5b-full-s2048-mb8": ["--model", "Qwen/Qwen2.5-1.5B", "--seq-len", "2048", "--global-batch", "8",
                                "--micro-batch", "8", "--compile", "off", "--checkpoint", "none"],
    "llama3b-full-s4096-mb2-selective": ["--model", "meta-llama/Llama-3.2-3B", "--seq-len", "4096", "--global-batch",
                                         "2", "--micro-batch", "2", "--compile", "off", "--checkpoint", "selective"],
    "gpt2-full-s1024-mb16": ["--model", "gpt2", "--seq-len", "1024", "--global-batch", "16",
                             "--micro-batch", "16", "--compile", "off", "--checkpoint", "none"],
    "llama1b-full-s4096-mb8-chunked": ["--model", "meta-llama/Llama-3.2-1B", "--seq-len", "4096", "--global-batch",
                                       "8", "--micro-batch", "8", "--compile", "off", "--checkpoint", "full",
                                       "--loss", "chunked"],
    "llama8b-lora16-s2048-mb8-ckpt": ["--model", "meta-llama/Llama-3.1-8B", "--seq-len", "2048", "--global-batch",
                                      "8", "--micro-batch", "8", "--compile", "off", "--checkpoint", "full",
                                      "--lora-rank", "16"],
    "llama3b-lora16-s4096-mb4": ["--model", "meta-llama/Llama-3.2-3B", "--seq-len", "4096", "--global-batch", "4",
                                 "--micro-batch", "4", "--compile", "off", "--checkpoint", "none", "--lora-rank",
                                 "16"],
    "qwen1.5b-lora16-s2048-mb8-ckpt": ["--model", "Qwen/Qwen2.5-1.5B", "--seq-len", "2048", "--global-batch", "8",
                                       "--micro-batch", "8", "--compile", "off", "--checkpoint", "full",
                                       "--lora-rank", "16"],
    "qwen0.5b-full-s2048-mb8-compiled": ["--model", "Qwen/Qwen2.5-0.5B", "--seq-len", "2048", "--global-batch", "8",
                                         "--micro-batch", "8", "--compile", "on", "--checkpoint", "none"],
}
COMMON = ["--gpus", GPUS, "--launcher", "torchrun", "--precision", "bf16-mixed", "--optimizers", "adamw-fused",
          "--time-limit", "60"]


def make(folder: Path) -> None:
    """Solve each case and emit its torchrun files (run where fitplan is installed)."""
    from graphs import resolve

    for name, args in CASES.items():
        case = folder / name
        if (case / "plan.json").is_file():
            continue
        command = [str(Path(sys.executable).with_name("fitplan")), "solve", *args, *COMMON, "--emit", "torchrun",
                   "--emit-dir", str(case), "-o", str(case / "plan.json"), "--force", "--json"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(f"{name}: solve failed (exit {done.returncode}): {done.stderr[-800:]}", file=sys.stderr)
            continue
        model = json.loads((case / "plan.json").read_text())["inputs"]["model"]
        (case / "model").mkdir(exist_ok=True)
        (case / "model" / "config.json").write_text(json.dumps(resolve(model).as_dict()))
        print(f"{name}: planned", file=sys.stderr)


def run(folder: Path, out: Path, *, budget: float, runs: list[tuple[str, str, str]] | None = None,
        steps: int = 5) -> None:
    """Run cases' scripts on this machine's GPU (run on the GPU machine): `runs` lists (case, allocator, cap),
    cap "" for none or "estimate" for the plan's own estimated reserved peak; by default every case with the
    expandable allocator, then every case with the classic one."""
    started = time.monotonic()
    results: list[dict] = []
    runs = runs or [(name, allocator, "") for allocator in ("expandable", "classic") for name in CASES]
    for name, allocator, cap in runs:
        case = folder / name
        if not (case / "plan.json").is_file():
            continue
        if time.monotonic() - started > budget:
            print(f"budget spent: {name} {allocator} {cap} not run", file=sys.stderr, flush=True)
            continue
        report = Path("/tmp/fitplan-reports") / f"{name}-{allocator}-{cap}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if allocator == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        cap_bytes = None
        if cap == "estimate":
            cap_bytes = json.loads((case / "plan.json").read_text())["estimate"]["memory"]["reserved_peak"]
            env["FITPLAN_CAP_BYTES"] = str(cap_bytes)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).with_name("cap")),
                                                              env.get("PYTHONPATH")]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                   str(case / "train_fitplan.py"), "--model", str(case / "model"), "--from-config", "--steps",
                   str(steps if allocator == "expandable" and not cap else 2), "--report", str(report)]
        begun = time.monotonic()
        limit = min(300.0, max(30.0, budget + 60 - (begun - started)))
        result: dict = {"case": name, "allocator": allocator, "cap_bytes": cap_bytes}
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=limit)
        except subprocess.TimeoutExpired:
            result.update(exit=None, timed_out_after=limit)
        else:
            result.update(exit=done.returncode, wall_seconds=time.monotonic() - begun)
            if done.returncode == 0:
                result["report"] = json.loads((report / "rank0.json").read_text())
            else:
                result["log_tail"] = (done.stdout + done.stderr)[-3000:]
        results.append(result)
        out.write_text(json.dumps(results, indent=1))
        print(f"{name} {allocator} {cap}: exit {result['exit']} in {time.monotonic() - begun:.0f} s",
              file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "make":
        make(Path(argv[1]))
    elif len(argv) >= 3 and argv[0] == "run":
        budget = float(argv[argv.index("--budget") + 1]) if "--budget" in argv else float("inf")
        runs = [tuple([*item.split(":"), "", ""][:3]) for item in argv[argv.index("--runs") + 1].split(",")] \
            if "--runs" in argv else None
        run(Path(argv[1]), Path(argv[2]), budget=budget, runs=runs)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
