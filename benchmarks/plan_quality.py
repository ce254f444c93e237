"""Plan quality: fitplan's plan against common rules of thumb, all priced by the same cost model.

Baselines (each uses the same workload and the same fit test: device peak within the usable memory):
  (a) the Hugging Face guide: gradient checkpointing on, the largest micro-batch that fits with plain data
      parallelism, DeepSpeed ZeRO-3 when nothing fits;
  (b) DeepSpeed autotuning's policy: ZeRO stages 0 -> 3, the largest micro-batch per stage, no offload, the
      fastest of those that fit;
  (c) the safe default: ZeRO-3 with full checkpointing and CPU offload of optimizer and parameters, micro-batch 1.
Prints baseline step time / fitplan step time per scenario and the geometric mean.
Usage: python benchmarks/plan_quality.py
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace

from costmodels import Config, Engine, Offload, Optimizer, Precision, Workload, estimate, parse_cluster, shared_lowering
from costmodels.verdict import fits
from graphs import Checkpoint, LoraSpec, resolve
from graphs.lowering import lower_resolved
from solver import Infeasible, solve

SEQ_LEN, GLOBAL_BATCH, HEADROOM = 2048, 64, 0.05


@dataclass(frozen=True)
class Scenario:
    model: str
    gpus: str
    lora: bool = False


SCENARIOS = [
    Scenario("meta-llama/Llama-2-7b-hf", "1xA100"), Scenario("meta-llama/Llama-2-7b-hf", "8xA100"),
    Scenario("meta-llama/Llama-2-7b-hf", "1xA10G", lora=True), Scenario("meta-llama/Llama-3.1-8B", "1xA100"),
    Scenario("meta-llama/Llama-3.1-8B", "8xA100"), Scenario("meta-llama/Llama-3.1-8B", "8xH100"),
    Scenario("meta-llama/Llama-3.1-8B", "4xL4"), Scenario("meta-llama/Llama-3.1-8B", "1xA10G", lora=True),
    Scenario("mistralai/Mistral-7B-v0.1", "8xA100"), Scenario("mistralai/Mistral-7B-v0.1", "4xL4", lora=True),
    Scenario("Qwen/Qwen2.5-7B", "8xH100"), Scenario("Qwen/Qwen2.5-7B", "1xA100", lora=True),
    Scenario("Qwen/Qwen2.5-14B", "8xA100"), Scenario("Qwen/Qwen2.5-14B", "1xA100", lora=True),
    Scenario("meta-llama/Llama-2-13b-hf", "8xH100"), Scenario("meta-llama/Llama-2-13b-hf", "2x8xH100"),
    Scenario("Qwen/Qwen2.5-32B", "8xH100"), Scenario("Qwen/Qwen2.5-32B", "2x8xH100"),
    Scenario("meta-llama/Llama-3.1-70B", "2x8xH100"), Scenario("meta-llama/Llama-3.1-70B", "8xA100", lora=True),
    Scenario("meta-llama/Llama-3.1-70B", "8xH100"), Scenario("mistralai/Mixtral-8x7B-v0.1", "2x8xH100"),
]


def _seconds(model: str, gpus: str, config: Config, lora: LoraSpec | None) -> float | None:
    """Step time if `config` fits, else None."""
    cluster = parse_cluster(gpus)
    dtype, autocast = shared_lowering(config, lora=lora is not None)
    graph = lower_resolved(resolve(model), dtype=dtype, autocast=autocast, lora=lora)
    modes = config.checkpoint or ()
    if modes and len(modes) != len(graph.decoder_layers()):
        config = replace(config, checkpoint=(modes[0],) * len(graph.decoder_layers()))
    try:
        est = estimate(graph, cluster, Workload(seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH), config)
    except Exception:
        return None
    return est.time.step_time if fits(est, cluster, HEADROOM).fits else None  # the rule solve applies


def _batches(dp: int) -> list[int]:
    per_rank = GLOBAL_BATCH // dp
    return sorted((mb for mb in range(1, per_rank + 1) if per_rank % mb == 0), reverse=True)


def _base(s: Scenario, engine: Engine, zero: int, mb: int, checkpoint: Checkpoint, **extra: object) -> Config:
    dp = parse_cluster(s.gpus).world_size
    return Config(dp=dp, engine=engine, zero=zero, micro_batch=mb, grad_accum=GLOBAL_BATCH // dp // mb,
                  checkpoint=(checkpoint,), precision=Precision.BF16_MIXED, optimizer=Optimizer.ADAMW, **extra)


def hf_guide(s: Scenario, lora: LoraSpec | None) -> float | None:
    dp = parse_cluster(s.gpus).world_size
    for engine, zero in ((Engine.DDP, 0), (Engine.DEEPSPEED, 3)):
        for mb in _batches(dp):
            seconds = _seconds(s.model, s.gpus, _base(s, engine, zero, mb, Checkpoint.FULL), lora)
            if seconds is not None:
                return seconds
    return None


def deepspeed_autotuning(s: Scenario, lora: LoraSpec | None) -> float | None:
    dp = parse_cluster(s.gpus).world_size
    best = None
    for zero in range(4):
        for mb in _batches(dp):
            seconds = _seconds(s.model, s.gpus, _base(s, Engine.DEEPSPEED, zero, mb, Checkpoint.NONE), lora)
            if seconds is not None:
                best = seconds if best is None else min(best, seconds)
                break
    return best


def safe_default(s: Scenario, lora: LoraSpec | None) -> float | None:
    config = _base(s, Engine.DEEPSPEED, 3, 1, Checkpoint.FULL, optimizer_offload=Offload.CPU,
                   param_offload=Offload.CPU)
    return _seconds(s.model, s.gpus, config, lora)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/plan_quality.json")
    args = parser.parse_args()
    rows = []
    for s in SCENARIOS:
        lora = LoraSpec(rank=16) if s.lora else None
        try:
            plan = solve(s.model, s.gpus, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, headroom=HEADROOM, lora=lora)
            ours = plan.estimate.time.step_time
            summary = plan.decisions.summary()
        except Infeasible:
            ours, summary = None, "infeasible"
        baselines = {"hf_guide": hf_guide(s, lora), "ds_autotune": deepspeed_autotuning(s, lora),
                     "safe_default": safe_default(s, lora)}
        ratios = {k: (v / ours if v and ours else None) for k, v in baselines.items()}
        rows.append({"model": s.model, "gpus": s.gpus, "lora": s.lora, "fitplan_s": ours, "plan": summary,
                     "baselines_s": baselines, "speedup": ratios})
        cells = "  ".join(f"{k} {r:5.2f}x" if r else f"{k}  n/a " for k, r in ratios.items())
        print(f"{s.model[:28]:28} {s.gpus:9} {'LoRA' if s.lora else 'full':4} fitplan "
              f"{ours if ours else float('nan'):8.2f} s  {cells}", flush=True)
    print("Geometric mean speed-up of fitplan's plan over each rule (scenarios where both fit):")
    summary = {}
    for key in ("hf_guide", "ds_autotune", "safe_default"):
        values = [r["speedup"][key] for r in rows if r["speedup"][key]]
        fails = sum(1 for r in rows if r["fitplan_s"] and not r["baselines_s"][key])
        mean = math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")
        summary[key] = {"geomean_speedup": mean, "scenarios": len(values), "rule_finds_nothing": fails}
        print(f"  {key:14} {mean:5.2f}x over {len(values)} scenarios; the rule finds no fitting config in {fails}")
    with open(args.out, "w") as handle:
        json.dump({"rows": rows, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
