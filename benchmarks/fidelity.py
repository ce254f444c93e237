"""Fidelity: the time model against published measured throughputs, and the memory model against published
peak-memory measurements (benchmarks/data/calibration/*.json). Prints median and max |error| per source.

Rows fitplan cannot model are listed with the reason (pipeline parallelism, encoder-only models, optimizer
settings it does not have). Usage: python benchmarks/fidelity.py [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, lowering_for, parse_cluster
from graphs import Checkpoint, LoraSpec, lower

DATA = Path(__file__).resolve().parent / "data" / "calibration"  # a copy of shared/data/calibration
CATALOG = {"llama3-8b": "meta-llama/Meta-Llama-3-8B", "llama3-70b": "meta-llama/Meta-Llama-3-70B",
           "llama2-13b": "meta-llama/Llama-2-13b-hf", "llama2-70b": "meta-llama/Llama-2-70b-hf",
           "Llama 3.1 8B": "meta-llama/Llama-3.1-8B", "Llama 3.1 70B": "meta-llama/Llama-3.1-70B",
           "Llama-2-7B": "meta-llama/Llama-2-7b-hf"}
GPUS = {"A100-SXM4-80GB": "A100-80GB", "A100-SXM4-40GB": "A100-40GB", "H100-SXM5-80GB": "H100",
        "A100": "A100-80GB", "RTX 4090": "RTX4090", "RTX A6000": "A6000"}


def model_source(row: dict[str, Any], folder: Path) -> str:
    """A catalog id, or a local config.json built from the row's published dimensions."""
    m = row["model"]
    if m["name"] in CATALOG:
        return CATALOG[m["name"]]
    if m["name"].startswith("mpt"):
        # MPT's block (LayerNorm, 4h GELU MLP, ALiBi) run with flash attention as MosaicML did; transformers'
        # MPT has no SDPA path, so the same dimensions on a GPT-NeoX block (sequential residual) stand in.
        values = {"model_type": "gpt_neox", "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
                  "num_hidden_layers": m["layers"], "intermediate_size": m.get("ffn") or 4 * m["hidden"],
                  "vocab_size": m["vocab"], "max_position_embeddings": m["seq_len"], "use_parallel_residual": False,
                  "rotary_pct": 0.25, "tie_word_embeddings": True}
    elif m["name"].startswith("gpt2"):
        values = {"model_type": "gpt2", "n_embd": m["hidden"], "n_head": m["heads"], "n_layer": m["layers"],
                  "n_positions": m["seq_len"], "vocab_size": m["vocab"], "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                  "attn_pdrop": 0.0}
    else:
        values = {"model_type": "llama", "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
                  "num_key_value_heads": m.get("kv_heads") or m["heads"], "num_hidden_layers": m["layers"],
                  "intermediate_size": m.get("ffn") or 4 * m["hidden"], "vocab_size": m["vocab"],
                  "max_position_embeddings": m["seq_len"]}
    path = folder / m["name"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(values))
    return str(path)


def throughput_config(row: dict[str, Any], layers: int) -> tuple[Config, Workload] | str:
    p, b = row["parallel"], row["batch"]
    if p.get("pp", 1) != 1:
        return "pipeline parallelism is not modelled"
    zero = p.get("zero")
    framework = row.get("framework", "")
    if "Megatron" in framework:
        engine, stage = Engine.DEEPSPEED, 1 if "distributed" in str(zero) else 0  # Megatron's optimizer = ZeRO-1
    elif zero == 3 or "FSDP" in framework:
        engine, stage = Engine.FSDP2, 3
    else:
        return f"engine {framework!r} / zero {zero!r} not mapped"
    recompute = str(row.get("recompute", "none"))
    if recompute.startswith("full"):
        modes = (Checkpoint.FULL,) * layers
    elif recompute == "selective layer":  # torchtitan: full AC on every 2nd layer
        modes = tuple(Checkpoint.FULL if i % 2 == 0 else Checkpoint.NONE for i in range(layers))
    elif recompute == "selective op":
        modes = (Checkpoint.SELECTIVE,) * layers
    else:
        modes = (Checkpoint.NONE,) * layers
    precision = Precision.FP16_MIXED if row.get("precision") == "fp16" else Precision.BF16_MIXED
    dp, tp = p.get("dp", 1), p.get("tp", 1)
    grad_accum = max(1, b["global_batch"] // (b["micro_batch"] * dp))
    config = Config(tp=tp, dp=dp, engine=engine, zero=stage, micro_batch=b["micro_batch"], grad_accum=grad_accum,
                    checkpoint=modes, precision=precision, optimizer=Optimizer.ADAMW_FUSED)
    return config, Workload(seq_len=row["model"]["seq_len"], global_batch=b["micro_batch"] * grad_accum * dp)


def gpus_spec(row: dict[str, Any]) -> str:
    hw = row["hw"]
    name = GPUS.get(hw["gpu"], hw["gpu"].split(" ")[0].split("(")[0])
    per_node = hw.get("gpus_per_node", min(8, hw["num_gpus"]))
    nodes = max(1, hw["num_gpus"] // per_node)
    return f"{nodes}x{per_node}x{name}" if nodes > 1 else f"{hw['num_gpus']}x{name}"


def measured_tokens_per_gpu(row: dict[str, Any]) -> float | None:
    m = row["measured"]
    if "tokens_per_s_per_gpu" in m:
        return float(m["tokens_per_s_per_gpu"])
    if "iter_time_s" in m:
        b = row["batch"]
        return b["global_batch"] * row["model"]["seq_len"] / m["iter_time_s"] / row["hw"]["num_gpus"]
    return None


def time_fidelity(data: Path, folder: Path) -> tuple[list[dict], list[dict]]:
    rows, skipped = [], []
    for row in json.loads((data / "throughput_published.json").read_text()):
        measured = measured_tokens_per_gpu(row)
        try:
            source = model_source(row, folder)
            layers = row["model"]["layers"]
            setup = throughput_config(row, layers)
            if isinstance(setup, str):
                skipped.append({"id": row["id"], "reason": setup})
                continue
            config, workload = setup
            dtype, autocast = lowering_for(config)
            graph = lower(source, dtype=dtype, autocast=autocast)
            est = estimate(graph, parse_cluster(gpus_spec(row)), workload, config)
        except Exception as error:
            skipped.append({"id": row["id"], "reason": f"{type(error).__name__}: {str(error)[:120]}"})
            continue
        predicted = est.tokens_per_second / row["hw"]["num_gpus"]
        rows.append({"id": row["id"], "source": row["src"], "measured": measured, "predicted": predicted,
                     "error": predicted / measured - 1, "mfu": est.mfu, "params": graph.param_count})
    return rows, skipped


def memory_fidelity(data: Path) -> tuple[list[dict], list[dict]]:
    """Rows whose full configuration is stated; the rest are listed with the reason."""
    rows, skipped = [], []
    for row in json.loads((data / "memory_published.json").read_text()):
        if "bert" in row["model"].lower():
            skipped.append({"id": row["id"], "reason": "encoder-only model (fitplan lowers causal LMs)"})
            continue
        if row.get("uncertain"):
            skipped.append({"id": row["id"], "reason": "configuration not stated: " + ", ".join(row["uncertain"])})
            continue
        try:
            rows.append(_memory_row(row))
        except Exception as error:
            skipped.append({"id": row["id"], "reason": f"{type(error).__name__}: {str(error)[:120]}"})
    return rows, skipped


def _memory_row(row: dict[str, Any]) -> dict[str, Any]:
    model = CATALOG[row["model"]]
    lora = LoraSpec(rank=int(row["lora_rank"])) if row.get("lora_rank") else None
    config = Config(engine=Engine.DDP, micro_batch=int(row["micro_batch_per_gpu"]), precision=Precision.BF16_MIXED,
                    optimizer=Optimizer.ADAMW)
    dtype, autocast = lowering_for(config, lora=lora is not None)
    graph = lower(model, dtype=dtype, autocast=autocast, lora=lora)
    est = estimate(graph, parse_cluster(f"1x{GPUS.get(row['gpu'], row['gpu'])}"),
                   Workload(seq_len=int(row["seq_len"]), global_batch=config.micro_batch), config)
    measured = row["measured_mib_normalized"] * 2**20
    predicted = est.memory.reserved_peak if "reserved" in row["metric"] else est.memory.device_peak
    return {"id": row["id"], "source": row["source"], "measured": measured, "predicted": predicted,
            "error": predicted / measured - 1}


def p90(errors: list[float]) -> float:
    """The 90th percentile (nearest rank) of the absolute errors."""
    ordered = sorted(errors)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def summarize(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Median, 90th percentile and max absolute error per source, and over all rows."""
    by_source: dict[str, list[float]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(abs(r["error"]))
    if rows:
        by_source["all"] = [abs(r["error"]) for r in rows]
    return {s: {"n": len(e), "median_abs_error": statistics.median(e), "p90_abs_error": p90(e),
                "max_abs_error": max(e)} for s, e in by_source.items()}


# Model sizes (parameters) whose signed errors are summarised together: a size-dependent bias (small models
# systematically fast or slow, as fixed costs and small kernels would cause) shows as a signed median away from 0.
SIZE_BUCKETS = ((0, 1e9, "< 1B"), (1e9, 1e10, "1B-10B"), (1e10, float("inf"), ">= 10B"))


def size_bias(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Signed median error (predicted over measured tokens/s, minus 1) per model-size bucket."""
    result = {}
    for low, high, name in SIZE_BUCKETS:
        errors = [r["error"] for r in rows if low <= r["params"] < high]
        if errors:
            result[name] = {"n": len(errors), "signed_median_error": statistics.median(errors)}
    return result


def print_summary(rows: list[dict]) -> None:
    for source, s in summarize(rows).items():
        print(f"  {source:22} n={s['n']:3} median |error| {s['median_abs_error']:.1%} p90 {s['p90_abs_error']:.1%} "
              f"max {s['max_abs_error']:.1%}")


def leave_one_source_out_rows() -> list[dict]:
    """Every row scored with constants fitted on the other sources (benchmarks/calibrate.py's grid)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import calibrate

    held_out = calibrate.leave_one_source_out(calibrate.grid_errors())
    return [row for entry in held_out.values() for row in entry["rows"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", default="benchmarks/results/fidelity.json")
    parser.add_argument("--no-loso", action="store_true", help="skip the leave-one-source-out grid (~3 min)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        time_rows, time_skipped = time_fidelity(args.data, Path(tmp))
    memory_rows, memory_skipped = memory_fidelity(args.data)
    print("Time model: predicted vs measured tokens/s per GPU")
    for r in time_rows:
        print(f"  {r['id'][:46]:46} {r['source']:8} measured {r['measured']:9.0f} predicted {r['predicted']:9.0f} "
              f"error {r['error']:+6.1%}")
    print("In sample (the constants in costmodels/compute.py, fitted on all of these rows):")
    print_summary(time_rows)
    print("Signed median error by model size (negative: predicted slower than measured):")
    for bucket, entry in size_bias(time_rows).items():
        print(f"  {bucket:8} n={entry['n']:3} {entry['signed_median_error']:+.1%}")
    loso_rows = [] if args.no_loso else leave_one_source_out_rows()
    if loso_rows:
        print("Leave one source out (each source scored with constants fitted on the others only):")
        print_summary(loso_rows)
    print(f"  not modelled: {len(time_skipped)} rows (" + "; ".join(sorted({s['reason'] for s in time_skipped}))
          + ")")
    print("Memory model: predicted vs measured peak")
    for r in memory_rows:
        print(f"  {r['id']:30} measured {r['measured'] / 2**30:7.2f} GiB predicted {r['predicted'] / 2**30:7.2f} GiB "
              f"error {r['error']:+6.1%}")
    print_summary(memory_rows)
    reasons = "; ".join(sorted({s["reason"][:60] for s in memory_skipped}))
    print(f"  not modelled: {len(memory_skipped)} rows ({reasons})")
    result = {"time": {"rows": time_rows, "summary": summarize(time_rows), "size_bias": size_bias(time_rows),
                       "skipped": time_skipped,
                       "leave_one_source_out": {"rows": loso_rows, "summary": summarize(loso_rows)}},
              "memory": {"rows": memory_rows, "summary": summarize(memory_rows), "skipped": memory_skipped}}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
