"""Fidelity: the time model against published measured throughputs, and the memory model against published
peak-memory measurements (benchmarks/data/calibration/*.json). Prints median and max |error| per source.

Pipeline rows (Mist's L4 runs, Megatron baselines) are priced with their layout and 1F1B, and Mist's per-stage
peak allocated memory is compared per rank. Rows fitplan cannot model are listed with the reason (encoder-only
models, optimizer settings it does not have). Usage: python benchmarks/fidelity.py [--data DIR] [--no-loso]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from costmodels import Config, Engine, Estimate, Optimizer, Precision, Workload, estimate, lowering_for, parse_cluster
from costmodels.pipeline_schedule import Schedule
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
    """The row's configuration and workload, or why fitplan cannot express it."""
    p, b = row["parallel"], row["batch"]
    engine = _engine(row)
    if isinstance(engine, str):
        return engine
    precision = Precision.FP16_MIXED if row.get("precision") == "fp16" else Precision.BF16_MIXED
    dp, tp, pp = p.get("dp", 1), p.get("tp", 1), p.get("pp", 1)
    grad_accum = max(1, b["global_batch"] // (b["micro_batch"] * dp))
    split = pipeline_split(row, layers) if pp > 1 else ()
    modes = _checkpoint_modes(row, layers, split)
    # Mist's runtime and Megatron without virtual stages both run 1F1B (Megatron's
    # forward_backward_pipelining_without_interleaving, which Mist's runtime reuses).
    config = Config(tp=tp, dp=dp, pp=pp, pp_schedule=Schedule.ONE_F_ONE_B, pp_split=split, engine=engine[0],
                    zero=engine[1], micro_batch=b["micro_batch"], grad_accum=grad_accum, checkpoint=modes,
                    precision=precision, optimizer=Optimizer.ADAMW_FUSED)
    return config, Workload(seq_len=row["model"]["seq_len"], global_batch=b["micro_batch"] * grad_accum * dp)


def _engine(row: dict[str, Any]) -> tuple[Engine, int] | str:
    """The engine and ZeRO stage that price the row's framework, or why none does."""
    zero, framework = row["parallel"].get("zero"), row.get("framework", "")
    if "Megatron" in framework:  # its DDP, or its distributed optimizer (optimizer states sharded)
        return Engine.MEGATRON, 1 if "distributed" in str(zero) else 0
    if zero == "opt-sharded":  # Mist's zero_o=1: optimizer states sharded over the stage's data-parallel group,
        # priced as Megatron's distributed optimizer (Mist's runtime reuses Megatron's pipeline schedule; the rows
        # do not state its gradient dtype)
        return Engine.MEGATRON, 1
    if zero == 3 or "FSDP" in framework:
        return Engine.FSDP2, 3
    return f"engine {framework!r} / zero {zero!r} not mapped"


def _checkpoint_modes(row: dict[str, Any], layers: int, split: tuple[int, ...]) -> tuple[Checkpoint, ...]:
    """Per decoder layer, the row's activation checkpointing."""
    recompute = str(row.get("recompute", "none"))
    if "mist_stages" in row:  # Mist: the first ckpt_layers layers of each stage are fully recomputed
        starts = [sum(split[:i]) for i in range(len(split))]
        full = {start + k for start, stage in zip(starts, row["mist_stages"], strict=True)
                for k in range(stage["ckpt_layers"])}
        return tuple(Checkpoint.FULL if i in full else Checkpoint.NONE for i in range(layers))
    if recompute.startswith("full"):
        # Megatron's "full, uniform, 1 layer" (--recompute-method uniform --recompute-num-layers 1) checkpoints
        # every group of one layer: every layer is fully recomputed, as FULL on each layer prices it.
        return (Checkpoint.FULL,) * layers
    if recompute == "selective layer":  # torchtitan: full AC on every 2nd layer
        return tuple(Checkpoint.FULL if i % 2 == 0 else Checkpoint.NONE for i in range(layers))
    if recompute == "selective op":
        return (Checkpoint.SELECTIVE,) * layers
    return (Checkpoint.NONE,) * layers


def pipeline_split(row: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Decoder layers per stage: Mist's stated per-stage layers (`mist_stages`), else Megatron's default even
    split (layers / pp, what it runs without --decoder-first/last-pipeline-num-layers), else () for fitplan's
    balanced split (`costmodels.pipeline_stages.stage_layers`)."""
    if "mist_stages" in row:
        return tuple(stage["layers"] for stage in row["mist_stages"])
    pp = row["parallel"]["pp"]
    return (layers // pp,) * pp if layers % pp == 0 else ()


def attention_for(row: dict[str, Any]) -> str | None:
    """The attention to lower with: eager (scores materialised) where the row ran without flash attention (Mist's
    flash_attn=False and Megatron's flash=False compute softmax(QK^T) explicitly), else the default SDPA."""
    framework = row.get("framework", "").replace(" ", "")
    return "eager" if "flash_attn=False" in framework or "flash=False" in framework else None


def offload_caveat(row: dict[str, Any]) -> str | None:
    """Why the row's memory is not comparable: Mist's partial per-stage CPU offload, which fitplan does not price
    (it keeps every stage's optimizer states on the GPU)."""
    ratios = [r for stage in row.get("mist_stages", ()) for r in (stage["offload_w"], stage["offload_g"],
                                                                     stage["offload_o"], stage["offload_act"])]
    return f"Mist offloads part of the states to the CPU ({row['offload']})" if any(ratios) else None


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
    """Per modelled row, measured and predicted tokens/s per GPU (pipeline rows also carry per-stage memory)."""
    rows, skipped = [], []
    for row in json.loads((data / "throughput_published.json").read_text()):
        try:
            setup = throughput_config(row, row["model"]["layers"])
            if isinstance(setup, str):
                skipped.append({"id": row["id"], "reason": setup})
                continue
            config, workload = setup
            dtype, autocast = lowering_for(config)
            graph = lower(model_source(row, folder), dtype=dtype, autocast=autocast, attention=attention_for(row))
            est = estimate(graph, parse_cluster(gpus_spec(row)), workload, config)
        except Exception as error:
            skipped.append({"id": row["id"], "reason": f"{type(error).__name__}: {str(error)[:120]}"})
            continue
        measured = measured_tokens_per_gpu(row)
        predicted = est.tokens_per_second / row["hw"]["num_gpus"]
        rows.append({"id": row["id"], "source": row["src"], "measured": measured, "predicted": predicted,
                     "error": predicted / measured - 1, "mfu": est.mfu, "params": graph.param_count,
                     "pp": config.pp, **_pipeline_fields(row, est)})
    return rows, skipped


def _pipeline_fields(row: dict[str, Any], est: Estimate) -> dict[str, Any]:
    """A pipeline row's step time, bubble, stage split, per-rank allocated peak and the measured one, if stated."""
    if est.pipeline is None:
        return {}
    fields = {"step_time": est.time.step_time, "bubble": est.time.bubble,
              "stage_layers": list(est.pipeline.stage_layers),
              "predicted_stage_alloc": [rank.memory.allocated_peak for rank in est.pipeline.ranks],
              "caveat": offload_caveat(row)}
    if "peak_alloc_mb_per_stage" in row["measured"]:
        fields["measured_stage_alloc"] = measured_stage_alloc(row["measured"]["peak_alloc_mb_per_stage"])
    return fields


# Mist prints torch.cuda.max_memory_allocated() / MB with MB = 1024**2 (Dazz993/Mist, mist/utils/common.py), the
# largest over the stage's ranks (benchmark/mist/exec/benchmark_one_case.py): its "MB" are MiB.
MIST_MB = 2**20


def measured_stage_alloc(text: str) -> list[int]:
    """Bytes of Mist's per-stage peak allocated memory, from its "[18506 MB, 13406 MB]"."""
    return [int(part.strip().removesuffix("MB")) * MIST_MB for part in text.strip("[]").split(",")]


def stage_memory_rows(time_rows: list[dict]) -> list[dict]:
    """One row per pipeline stage with a measured peak: predicted allocated peak of its rank against Mist's."""
    result = []
    for r in (r for r in time_rows if "measured_stage_alloc" in r):
        for stage, (measured, predicted) in enumerate(zip(r["measured_stage_alloc"], r["predicted_stage_alloc"],
                                                          strict=True)):
            result.append({"id": f"{r['id']}[{stage}]", "source": r["source"], "measured": measured,
                           "predicted": predicted, "error": predicted / measured - 1, "caveat": r["caveat"]})
    return result


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
    # the published runs used PyTorch's default (classic) caching allocator
    config = Config(engine=Engine.DDP, micro_batch=int(row["micro_batch_per_gpu"]), precision=Precision.BF16_MIXED,
                    optimizer=Optimizer.ADAMW, expandable_segments=False)
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


def print_time(time_rows: list[dict], loso_rows: list[dict], skipped: list[dict]) -> None:
    """The time table (pipeline rows marked with their pp, a * where the row's offload is not priced), then the
    in-sample and held-out summaries, over all rows and over the pipeline rows."""
    print("Time model: predicted vs measured tokens/s per GPU")
    for r in time_rows:
        mark = (f"pp={r['pp']}" if r["pp"] > 1 else "") + ("*" if r.get("caveat") else "")
        print(f"  {r['id'][:46]:46} {r['source'][:8]:8} {mark:6} measured {r['measured']:9.0f} "
              f"predicted {r['predicted']:9.0f} error {r['error']:+6.1%}")
    print("  * Mist offloads part of the optimizer states to the CPU: priced as if on the GPU")
    print("In sample (the constants in costmodels/compute.py, fitted by calibrate.py):")
    print_summary(time_rows)
    print("Signed median error by model size (negative: predicted slower than measured):")
    for bucket, entry in size_bias(time_rows).items():
        print(f"  {bucket:8} n={entry['n']:3} {entry['signed_median_error']:+.1%}")
    if loso_rows:
        print("Leave one source out (each source scored with constants fitted on the others only):")
        print_summary(loso_rows)
    print("Pipeline rows (pp > 1), in sample:")
    print_summary([r for r in time_rows if r["pp"] > 1])
    if loso_rows:
        print("Pipeline rows (pp > 1), leave one source out:")
        print_summary([r for r in loso_rows if r["pp"] > 1])
    print(f"  not modelled: {len(skipped)} rows (" + "; ".join(sorted({s['reason'] for s in skipped})) + ")")


def print_stage_memory(stage_rows: list[dict]) -> None:
    """Per pipeline stage: predicted allocated peak of its rank against Mist's measured one (MiB), with the
    summary over the stages whose configuration fitplan prices in full, then over all."""
    print("Pipeline memory: predicted allocated peak per rank vs Mist's peak_alloc_mb_per_stage (MiB = 2^20 B)")
    for r in stage_rows:
        print(f"  {r['id'][:40]:40} measured {r['measured'] / 2**20:7.0f} MiB predicted "
              f"{r['predicted'] / 2**20:7.0f} MiB error {r['error']:+6.1%}{' *' if r['caveat'] else ''}")
    print("  without CPU offload:")
    print_summary([r for r in stage_rows if not r["caveat"]])
    print("  all stages (* offloaded states priced on the GPU):")
    print_summary(stage_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", default="benchmarks/results/fidelity.json")
    parser.add_argument("--no-loso", action="store_true", help="skip the leave-one-source-out grid (~3 min)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        time_rows, time_skipped = time_fidelity(args.data, Path(tmp))
    memory_rows, memory_skipped = memory_fidelity(args.data)
    stage_rows = stage_memory_rows(time_rows)
    loso_rows = [] if args.no_loso else leave_one_source_out_rows()
    print_time(time_rows, loso_rows, time_skipped)
    print("Memory model: predicted vs measured peak")
    for r in memory_rows:
        print(f"  {r['id']:30} measured {r['measured'] / 2**30:7.2f} GiB predicted {r['predicted'] / 2**30:7.2f} GiB "
              f"error {r['error']:+6.1%}")
    print_summary(memory_rows)
    reasons = "; ".join(sorted({s["reason"][:60] for s in memory_skipped}))
    print(f"  not modelled: {len(memory_skipped)} rows ({reasons})")
    print_stage_memory(stage_rows)
    pipeline = [r for r in time_rows if r["pp"] > 1]
    result = {"time": {"rows": time_rows, "summary": summarize(time_rows), "size_bias": size_bias(time_rows),
                       "pipeline_summary": summarize(pipeline), "skipped": time_skipped,
                       "leave_one_source_out": {"rows": loso_rows, "summary": summarize(loso_rows)}},
              "memory": {"rows": memory_rows, "summary": summarize(memory_rows), "skipped": memory_skipped,
                         "pipeline_stages": {"rows": stage_rows, "summary": summarize(stage_rows),
                                             "summary_without_offload": summarize(
                                                 [r for r in stage_rows if not r["caveat"]])}}}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
