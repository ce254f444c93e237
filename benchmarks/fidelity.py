"""Fidelity: the time model against published measured throughputs, and the memory model against published
peak-memory measurements (benchmarks/data/calibration/*.json) and the project's own H200 plan runs
(benchmarks/data/gpu/h200_plans.json). Prints median, p90 and max |error| per source, per runtime (HF code,
torchtitan, Megatron, Mist, DeepSpeed) and per method (full, LoRA, QLoRA, pipelines, fp8), in sample and leave one
source out, and the verdict fitplan gives each run that ran (none may be called "does not fit").

Pipeline rows (Mist's L4 runs, Megatron baselines) are priced with their layout and 1F1B, and Mist's per-stage
peak allocated memory is compared per rank. Rows fitplan cannot model are listed with the reason (encoder-only
models, optimizer settings it does not have). Usage: python benchmarks/fidelity.py [--data DIR] [--no-loso]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from costmodels import Config, Engine, Estimate, Optimizer, Precision, Workload, estimate, lowering_for, parse_cluster
from costmodels.breakdown import MemoryBreakdown
from costmodels.cluster import Cluster
from costmodels.config import Loss, Offload
from costmodels.pipeline_schedule import Schedule
from costmodels.verdict import fits
from graphs import Checkpoint, LayerGraph, LoraSpec, lower

DATA = Path(__file__).resolve().parent / "data" / "calibration"  # a copy of shared/data/calibration
GPU_RUNS = Path(__file__).resolve().parent / "data" / "gpu" / "h200_plans.json"  # the project's own H200 runs
# The runtimes and methods the report is cut by (issue 37), each listed even where no published row covers it.
RUNTIMES = ("HF code", "torchtitan", "Megatron", "Mist", "DeepSpeed")
METHODS = ("full", "LoRA", "QLoRA", "pipelines", "fp8")
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
        # llm-foundry's MPT block is GPT-2's (llm-foundry 0.22, llmfoundry/models/mpt and layers/): pre-LayerNorm,
        # one packed Wqkv, out_proj, a 4h MLP with exact GELU (`_FFN_ACT_FN_DEFAULT`), biases (`no_bias=False`),
        # tied head and learned position embeddings (`learned_pos_emb=True`, `alibi=False`: the rows' parameter
        # counts grow by seq_len x hidden with the sequence). Its flash path gathers q, k and v out of Wqkv's output
        # (`index_first_axis`) and the kernel keeps those copies: the 3 x hidden per token GPT-2's SDPA keeps
        # through its split views. transformers' MPT has no SDPA path, so GPT-2's layers with MPT's dimensions stand
        # in (GPT-NeoX did, with rotary copies of q and k that MPT never makes).
        values = {"model_type": "gpt2", "n_embd": m["hidden"], "n_head": m["heads"], "n_layer": m["layers"],
                  "n_inner": m.get("ffn") or 4 * m["hidden"], "n_positions": m["seq_len"], "vocab_size": m["vocab"],
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True,
                  "activation_function": "gelu"}
    elif m["name"].startswith("gpt2"):
        # Mist's gpt2 configs and its Megatron-LM baselines (--untie-embeddings-and-output-weights) untie the head;
        # both run GELU as one kernel (`gelu_activation` below), not GPT-2's default gelu_new written out in ops
        values = {"model_type": "gpt2", "n_embd": m["hidden"], "n_head": m["heads"], "n_layer": m["layers"],
                  "n_positions": m["seq_len"], "vocab_size": m["vocab"], "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                  "attn_pdrop": 0.0, "tie_word_embeddings": False, "activation_function": gelu_activation(row)}
    else:
        values = {"model_type": "llama", "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
                  "num_key_value_heads": m.get("kv_heads") or m["heads"], "num_hidden_layers": m["layers"],
                  "intermediate_size": m.get("ffn") or 4 * m["hidden"], "vocab_size": m["vocab"],
                  "max_position_embeddings": m["seq_len"]}
    path = folder / m["name"]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(values))
    return str(path)


def gelu_activation(row: dict[str, Any]) -> str:
    """transformers' name for the GELU the row's GPT-2 ran. Mist's gpt2 configs set `activation_function: gelu_fast`,
    which its runtime runs as `F.gelu(approximate="tanh")` (mist/modules/utils.py `get_activation`): transformers'
    `gelu_pytorch_tanh`. Mist's Megatron-LM baselines (--disable-bias-linear, so no bias-GELU fusion) run
    megatron's default `F.gelu`: transformers' `gelu`. Either saves only its input for backward, where GPT-2's
    default `gelu_new` (`NewGELUActivation`, written out in tensor ops) saves three more intermediates of the MLP's
    width."""
    return "gelu" if "Megatron-LM" in row.get("framework", "") else "gelu_pytorch_tanh"


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
                    precision=precision, optimizer=Optimizer.ADAMW_FUSED, loss=loss_of(row))
    return config, Workload(seq_len=row["model"]["seq_len"], global_batch=b["micro_batch"] * grad_accum * dp)


def loss_of(row: dict[str, Any]) -> Loss:
    """The cross-entropy the row's runtime ran. Mist's runtime (its gpt2/llama configs set fp16_lm_cross_entropy)
    and Mist's Megatron-LM baselines (core_r0.4.0, benchmark_gpt_bert_one_case.py passes --fp16-lm-cross-entropy)
    keep the logits 16-bit; llm-foundry's MPT runs its default `loss_fn: fused_crossentropy` (flash-attn's); the
    others their runtime's plain loss (Loss.HF: transformers', torchtitan's plain one, megatron-core's)."""
    framework = row.get("framework", "")
    if "Mist" in framework:
        return Loss.MEGATRON_FP16
    if row["model"]["name"].startswith("mpt"):
        return Loss.FLASH
    return Loss.HF


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
    if recompute == "selective op":  # torchtitan's op-level SAC (every second matmul recomputed)
        return (Checkpoint.OP_SELECTIVE,) * layers
    return (Checkpoint.NONE,) * layers


def pipeline_split(row: dict[str, Any], layers: int) -> tuple[int, ...]:
    """Decoder layers per stage: Mist's stated per-stage layers (`mist_stages`), else Megatron's default even
    split (layers / pp, what it runs without --decoder-first/last-pipeline-num-layers), else () for fitplan's
    balanced split (`costmodels.pipeline_stages.stage_layers`)."""
    if "mist_stages" in row:
        return tuple(stage["layers"] for stage in row["mist_stages"])
    pp = row["parallel"]["pp"]
    return (layers // pp,) * pp if layers % pp == 0 else ()


def lowered(row: dict[str, Any], config: Config, folder: Path) -> Any:
    """The row's model lowered by the route `solve` and `estimate` take (`solver.search.route.Lowerings`): under
    the torchtitan launcher for torchtitan's rows (its own model code, with the loss the row's `config.loss` names:
    plain cross-entropy, as its published runs predate ChunkedLossWrapper), megatron-core's layers for Megatron's
    engine where megatron-core lowers the model and the row ran flash attention, else the HF code in the engine's
    dtype (eager attention where the row ran without flash attention; op-level SAC traced where a row runs it)."""
    from graphs.sources import resolve
    from solver.search.route import Lowerings, Route

    titan = runtime_of(row.get("framework", "")) == "torchtitan"
    route = Route(resolved=resolve(model_source(row, folder)), attention=None if titan else attention_for(row),
                  titan=titan, op_selective=not titan and Checkpoint.OP_SELECTIVE in config.checkpoint)
    return Lowerings(route).graph(config)


def attention_for(row: dict[str, Any]) -> str | None:
    """The attention to lower with: eager (scores materialised) where the row ran without flash attention (Mist's
    flash_attn=False and Megatron's flash=False compute softmax(QK^T) explicitly); SDPA pinned for Mist's Megatron-LM
    core_r0.4.0 baselines with flash attention, whose legacy local layers (the default --transformer-impl then: a
    Python SwiGLU, RMSNorm and RoPE around flash-attn's kernel) are not the Transformer Engine layers of megatron-core
    0.16 that the route prices Megatron's engine on otherwise; else the route's default (Mist's runtime, with
    flash-attn's fused dropout-add-norm kernels (mist/modules/rms_norm.py), keeps it)."""
    framework = row.get("framework", "").replace(" ", "")
    if "flash_attn=False" in framework or "flash=False" in framework:
        return "eager"
    return "sdpa" if "Megatron-LM" in framework else None


def offload_caveat(row: dict[str, Any]) -> str | None:
    """Why the row's memory is not quite comparable: Mist's per-stage CPU offload, priced as Megatron's hybrid
    optimizer keeps a host share (`offloaded_ranks`), while Mist swaps that share in for its GPU step (buffers not
    priced)."""
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


def runtime_of(framework: str) -> str:
    """The runtime a row ran on: torchtitan, Megatron-LM, Mist's runtime, DeepSpeed, else a model under torch's
    FSDP or DDP priced on the Hugging Face modeling code ("HF code": llm-foundry's MPT runs under Composer's FSDP,
    priced on GPT-2's layers, and fitplan's own torchrun scripts)."""
    for key, runtime in (("torchtitan", "torchtitan"), ("Megatron", "Megatron"), ("Mist", "Mist"),
                         ("DeepSpeed", "DeepSpeed")):
        if key in framework:
            return runtime
    return "HF code"


def method_of(*, pp: int, precision: str | None, lora: dict | None) -> str:
    """The method a row exercises: pipelines (pp > 1), fp8, QLoRA, LoRA, else full-parameter training."""
    if pp > 1:
        return "pipelines"
    if precision == "fp8":
        return "fp8"
    if lora:
        return "QLoRA" if lora.get("quantization") else "LoRA"
    return "full"


def verdict_fields(memory: MemoryBreakdown, cluster: Cluster) -> dict[str, Any]:
    """What fitplan says of a run that ran: its device peak (the busiest pipeline rank's) against the whole card
    (`fits`: headroom 0, the honest test for a run that ran) and against the default 5% headroom."""
    whole = fits(memory, cluster, headroom=0.0)
    return {"device_peak": memory.device_peak, "capacity": whole.capacity, "fits": whole.fits,
            "fits_default_headroom": fits(memory, cluster).fits}


def time_fidelity(data: Path, folder: Path) -> tuple[list[dict], list[dict]]:
    """Per modelled row, measured and predicted tokens/s per GPU (pipeline rows also carry per-stage memory)."""
    rows, skipped = [], []
    for row in json.loads((data / "throughput_published.json").read_text()):
        try:
            priced = time_row(row, folder)
        except Exception as error:
            skipped.append({"id": row["id"], "reason": f"{type(error).__name__}: {str(error)[:120]}"})
            continue
        (skipped if "reason" in priced else rows).append(priced)
    return rows, skipped


def time_row(row: dict[str, Any], folder: Path) -> dict[str, Any]:
    """One published row priced: measured and predicted tokens/s per GPU, its labels and fitplan's verdict on its
    card; or {"id", "reason"} where fitplan cannot express its configuration."""
    setup = throughput_config(row, row["model"]["layers"])
    if isinstance(setup, str):
        return {"id": row["id"], "reason": setup}
    config, workload = setup
    graph = lowered(row, config, folder)
    cluster = parse_cluster(gpus_spec(row))
    est = estimate(graph, cluster, workload, config)
    measured = measured_tokens_per_gpu(row)
    predicted = est.tokens_per_second / row["hw"]["num_gpus"]
    ranks = offloaded_ranks(row, graph, cluster, workload, config)
    return {"id": row["id"], "source": row["src"], "measured": measured, "predicted": predicted,
            "error": predicted / measured - 1, "mfu": est.mfu, "params": graph.param_count,
            "pp": config.pp, "runtime": runtime_of(row.get("framework", "")),
            "method": method_of(pp=config.pp, precision=row.get("precision"), lora=None),
            **verdict_fields(est.memory if ranks is None else max(ranks, key=lambda m: m.device_peak), cluster),
            **_pipeline_fields(row, est, ranks)}


def offload_fractions(row: dict[str, Any]) -> list[float]:
    """Mist's share of each stage's optimizer states kept on the host (`offload_o`; none offloads the weights,
    gradients or activations in these rows)."""
    return [stage["offload_o"] for stage in row.get("mist_stages", ())]


def offloaded_ranks(row: dict[str, Any], graph: LayerGraph, cluster: Cluster, workload: Workload,
                    config: Config) -> list[MemoryBreakdown] | None:
    """Each pipeline rank's memory with its stage's optimizer-state share on the host, priced as Megatron's hybrid
    optimizer keeps it (`costmodels.partial_offload`: the GPU holds the rest of the fp32 main parameters and moments
    and the whole gradient buffer), or None for rows without offload. Mist steps the host share on the GPU, swapping
    it in (mist/re_swap_manager/optimizer.py): the step's time stays priced with every state on the GPU."""
    fractions = offload_fractions(row)
    if not any(fractions):
        return None
    priced = {fraction: estimate(graph, cluster, workload, dataclasses.replace(
        config, optimizer_offload=Offload.CPU, optimizer_offload_fraction=fraction) if fraction else config)
        for fraction in set(fractions)}  # one estimate per share (stages often share one)
    return [priced[fraction].pipeline.ranks[stage].memory for stage, fraction in enumerate(fractions)]


def _pipeline_fields(row: dict[str, Any], est: Estimate, ranks: list[MemoryBreakdown] | None) -> dict[str, Any]:
    """A pipeline row's step time, bubble, stage split, per-rank allocated peak (`ranks`' where its stages offload)
    and the measured one, if stated."""
    if est.pipeline is None:
        return {}
    memories = ranks or [rank.memory for rank in est.pipeline.ranks]
    fields = {"step_time": est.time.step_time, "bubble": est.time.bubble,
              "stage_layers": list(est.pipeline.stage_layers),
              "predicted_stage_alloc": [memory.allocated_peak for memory in memories],
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
                           "predicted": predicted, "error": predicted / measured - 1, "caveat": r["caveat"],
                           "runtime": r["runtime"], "method": r["method"]})
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


def gpu_runs(path: Path = GPU_RUNS) -> tuple[list[dict], list[dict], list[dict]]:
    """The project's own H200 runs (each plan's emitted train_fitplan.py, torchrun) priced again with today's code
    through `solver.api.estimate` on the plan's decisions: (allocated-peak rows, step-time rows, skipped). A run
    capped at its estimate (cap_bytes) is a fit test, not a measurement, and the classic-allocator runs ran 2
    steps: both give memory rows only. Nothing is fitted to these runs."""
    from solver.api import estimate as estimate_plan

    memory, time, skipped = [], [], []
    data = json.loads(path.read_text())
    for run in data["runs"]:
        name = f"h200:{run['case']}" + ("" if run["allocator"] == "expandable" else f":{run['allocator']}")
        if run["exit"] != 0 or not run.get("measured"):
            skipped.append({"id": name, "reason": f"did not finish on the GPU (exit {run['exit']})"})
            continue
        if run["cap_bytes"] is not None:
            continue  # the capped rerun of a case listed already: a fit test, not a measurement
        args, d = _solve_args(run["solve_args"]), run["decisions"]
        config = {key: d[key] for key in ("engine", "zero", "tp", "dp", "micro_batch", "grad_accum", "precision",
                                          "optimizer", "compile", "loss")}
        config.update(checkpoint=args["checkpoint"], expandable_segments=run["allocator"] == "expandable")
        lora = LoraSpec(**{k: v for k, v in d["lora"].items() if k in ("rank", "alpha", "dropout")}) \
            if d["lora"] else None
        est = estimate_plan(args["model"], args["gpus"], config, seq_len=int(args["seq_len"]),
                            global_batch=int(args["global_batch"]), lora=lora)
        labels = {"source": "H200_RUNS", "runtime": "HF code", "pp": 1,
                  "method": method_of(pp=1, precision=d["precision"], lora=d["lora"]),
                  "caveat": LORA_SCRIPT_CAVEAT if d["lora"] else None,
                  **verdict_fields(est.memory, parse_cluster(args["gpus"]))}
        measured = run["measured"]["peak_allocated_bytes"]
        memory.append({"id": name, "measured": measured, "predicted": est.memory.allocated_peak,
                       "error": est.memory.allocated_peak / measured - 1, **labels})
        if run["allocator"] == "expandable":
            step = statistics.median(run["measured"]["step_seconds"][1:])
            # tokens/s error: measured over predicted step time
            time.append({"id": name, "measured": step, "predicted": est.time.step_time,
                         "error": step / est.time.step_time - 1, **labels})
    return memory, time, skipped


# The LoRA runs ran the torchrun script of commit 7733b1f, which loaded the frozen base in fp32 under autocast (the
# run's param_bytes are twice the 16-bit base's); today's script builds it in 16 bits, as PEFT on a bf16 model does
# and as the estimate prices it, so these runs no longer measure what fitplan emits. Listed, not summarised.
LORA_SCRIPT_CAVEAT = "ran 7733b1f's script, whose frozen base was fp32 (today's is 16-bit, as priced)"


def _solve_args(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a recorded solve command, by flag name with dashes as underscores."""
    return {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(argv[::2], argv[1::2],
                                                                                      strict=True)}


def p90(errors: list[float]) -> float:
    """The 90th percentile (nearest rank) of the absolute errors."""
    ordered = sorted(errors)
    return ordered[max(0, -(-9 * len(ordered) // 10) - 1)]


def summarize(rows: list[dict], key: str = "source") -> dict[str, dict[str, float]]:
    """Median, 90th percentile and max absolute error per value of `key` (source, runtime, method), and over all
    rows."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(abs(r["error"]))
    if rows:
        groups["all"] = [abs(r["error"]) for r in rows]
    return {s: {"n": len(e), "median_abs_error": statistics.median(e), "p90_abs_error": p90(e),
                "max_abs_error": max(e), "signed_median_error": statistics.median(
                    [r["error"] for r in rows if s == "all" or r[key] == s])} for s, e in groups.items()}


def cut(rows: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """The summaries per runtime and per method (every one of RUNTIMES and METHODS, n = 0 where no row has it)."""
    result = {}
    for key, names in (("runtime", RUNTIMES), ("method", METHODS)):
        found = summarize(rows, key)
        result[key] = {name: found.get(name, {"n": 0}) for name in (*names, "all")}
    return result


def refused(rows: list[dict]) -> list[dict]:
    """Runs that ran which fitplan calls "does not fit" on their own card (headroom 0)."""
    return [r for r in rows if not r["fits"]]


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


def print_summary(rows: list[dict], key: str = "source") -> None:
    for source, s in summarize(rows, key).items():
        print(f"  {source:22} n={s['n']:3} median |error| {s['median_abs_error']:.1%} p90 {s['p90_abs_error']:.1%} "
              f"max {s['max_abs_error']:.1%} signed median {s['signed_median_error']:+.1%}")


def print_cut(title: str, rows: list[dict]) -> None:
    """`rows`' errors per runtime, then per method; a runtime or method no row covers is said to have none."""
    print(title)
    for key, table in cut(rows).items():
        for name, s in table.items():
            if not s["n"]:
                print(f"  {key} {name:12} no row measured")
                continue
            print(f"  {key} {name:12} n={s['n']:3} median |error| {s['median_abs_error']:.1%} "
                  f"p90 {s['p90_abs_error']:.1%} max {s['max_abs_error']:.1%} signed median "
                  f"{s['signed_median_error']:+.1%}")


def print_refused(rows: list[dict]) -> None:
    """The runs that ran but fitplan says do not fit their card (device peak above its whole memory)."""
    wrong = refused(rows)
    print(f"Runs that ran, called \"does not fit\" on their own card (headroom 0): {len(wrong)} of {len(rows)}")
    for r in wrong:
        print(f"  {r['id'][:46]:46} {r['runtime']:10} device peak {r['device_peak'] / 2**30:6.1f} GiB > "
              f"{r['capacity'] / 2**30:6.1f} GiB")
    tight = [r for r in rows if r["fits"] and not r["fits_default_headroom"]]
    print(f"  fit the card but not the default 5% headroom: {len(tight)}"
          + (" (" + ", ".join(r["id"] for r in tight) + ")" if tight else ""))


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
    print("  all stages (* host share priced as Megatron's hybrid optimizer keeps it; Mist swaps it in to step):")
    print_summary(stage_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", default="benchmarks/results/fidelity.json")
    parser.add_argument("--no-loso", action="store_true", help="skip the leave-one-source-out grid (slow)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        time_rows, time_skipped = time_fidelity(args.data, Path(tmp))
    memory_rows, memory_skipped = memory_fidelity(args.data)
    gpu_memory, gpu_time, gpu_skipped = gpu_runs()
    stage_rows = stage_memory_rows(time_rows)
    loso_rows = [] if args.no_loso else leave_one_source_out_rows()
    print_time(time_rows, loso_rows, time_skipped)
    print_published_memory(memory_rows, memory_skipped)
    print_stage_memory(stage_rows)
    print_gpu_runs(gpu_memory, gpu_time, gpu_skipped)
    priced_memory = [r for r in (*stage_rows, *gpu_memory, *memory_rows) if not r.get("caveat")]
    # Time: published rows, held out where the grid ran (nothing is fitted to the H200 runs: in sample is held out)
    held_out_time = [*(loso_rows or time_rows), *[r for r in gpu_time if not r["caveat"]]]
    print_cut("Time, leave one source out" + ("" if loso_rows else " (not run: in sample)"), held_out_time)
    print_cut("Memory (nothing is fitted to these rows: in sample is held out)", priced_memory)
    ran = [*time_rows, *gpu_memory]
    print_refused(ran)
    result = {"time": {"rows": time_rows, "summary": summarize(time_rows), "size_bias": size_bias(time_rows),
                       "pipeline_summary": summarize([r for r in time_rows if r["pp"] > 1]),
                       "skipped": time_skipped,
                       "leave_one_source_out": {"rows": loso_rows, "summary": summarize(loso_rows)},
                       "h200_runs": {"rows": gpu_time, "summary": summarize(gpu_time)},
                       "held_out_cut": cut(held_out_time)},
              "memory": {"rows": memory_rows, "summary": summarize(memory_rows), "skipped": memory_skipped,
                         "pipeline_stages": {"rows": stage_rows, "summary": summarize(stage_rows),
                                             "summary_without_offload": summarize(
                                                 [r for r in stage_rows if not r["caveat"]])},
                         "h200_runs": {"rows": gpu_memory, "summary": summarize(gpu_memory),
                                       "skipped": gpu_skipped},
                         "cut": cut(priced_memory)},
              "refused_runs": refused(ran)}
    Path(args.out).write_text(json.dumps(result, indent=1))


def print_published_memory(rows: list[dict], skipped: list[dict]) -> None:
    print("Memory model: predicted vs measured peak (published single-GPU rows)")
    for r in rows:
        print(f"  {r['id']:30} measured {r['measured'] / 2**30:7.2f} GiB predicted {r['predicted'] / 2**30:7.2f} GiB "
              f"error {r['error']:+6.1%}")
    print_summary(rows)
    reasons = "; ".join(sorted({s["reason"][:60] for s in skipped}))
    print(f"  not modelled: {len(skipped)} rows ({reasons})")


def print_gpu_runs(memory: list[dict], time: list[dict], skipped: list[dict]) -> None:
    """The H200 runs: allocated peak and step time, predicted against measured."""
    print("The project's H200 runs (torchrun scripts fitplan emitted): allocated peak and step time")
    for r in memory:
        print(f"  {r['id'][:46]:46} {r['method']:5} allocated: measured {r['measured'] / 2**30:6.2f} GiB predicted "
              f"{r['predicted'] / 2**30:6.2f} GiB error {r['error']:+6.1%}{' *' if r['caveat'] else ''}")
    for r in time:
        print(f"  {r['id'][:46]:46} {r['method']:5} step: measured {r['measured']:.3f} s predicted "
              f"{r['predicted']:.3f} s tokens/s error {r['error']:+6.1%}{' *' if r['caveat'] else ''}")
    print(f"  * {LORA_SCRIPT_CAVEAT}: not summarised")
    for r in skipped:
        print(f"  {r['id']}: {r['reason']}")


if __name__ == "__main__":
    main()
