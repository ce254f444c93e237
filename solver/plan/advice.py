"""The Hugging Face efficient-training guide, method by method: what the plan decided and why.

Each line names a guide method (batch size, gradient accumulation, checkpointing, mixed precision, optimizer,
data preloading, DeepSpeed ZeRO/offload, torch.compile, PEFT, tensor-core shapes, fp8) and the plan's choice,
with numbers from the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from costmodels import Cluster, Config, Estimate, Optimizer, Precision, Workload, estimate, fits
from costmodels.activations import evaluate
from costmodels.alignment import padded, preferred_multiple
from costmodels.compilation import COMPILE_MIN_SAVING, compile_credited, uncredited_reason
from costmodels.context_parallel import local_seq_len
from costmodels.engines import rules_of
from costmodels.precision import matmul_dtype_on
from costmodels.verdict import DEFAULT_HEADROOM
from graphs import Checkpoint, LayerGraph
from solver.plan.capability import engine_setting

GIB = 2**30
MIB = 2**20
# A fast tokenizer (HF tokenizers, Rust) turns text into ~1M tokens/s per core; reading pre-tokenized shards
# is faster. Users override it with --input-tokens-per-s (an assumption, stated in the plan).
DEFAULT_INPUT_TOKENS_PER_S_PER_WORKER = 1_000_000
MAX_WORKERS = 8


@dataclass(frozen=True, slots=True)
class GuideDecisions:
    compile: bool
    workers: int
    lines: tuple[str, ...]


def dataloader_workers(cluster: Cluster) -> int:
    """Worker processes per GPU: the node's cores shared by its GPUs, one left for the training process."""
    return max(1, min(MAX_WORKERS, cluster.cpu_cores_per_node // cluster.gpus_per_node - 1))


def advise(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, chosen: Estimate, *,
           compile_pin: bool | None, input_tokens_per_s: float | None, allowed_optimizers: tuple[Optimizer, ...],
           lora: bool, savers_allowed: bool = False, headroom: float = DEFAULT_HEADROOM) -> GuideDecisions:
    lines = [_batch(graph, cluster, workload, config, chosen, headroom),
             _checkpointing(config) + _selective_saving(graph, workload, config),
             _precision(cluster, config), _optimizer(graph, cluster, workload, config, chosen, allowed_optimizers),
             _zero(config, chosen)]
    use_compile, compile_line = _compile(graph, cluster, workload, config, chosen, compile_pin)
    lines.append(compile_line)
    workers = dataloader_workers(cluster)
    lines.append(_data(cluster, chosen, workers, input_tokens_per_s))
    lines.append("PEFT/LoRA: adapters only (base frozen)" if lora else
                 "PEFT/LoRA: not needed, full fine-tuning fits (--lora-rank or --allow-lora to use it)")
    lines.append(_savers(config, savers_allowed))
    lines.extend(_shapes(graph, cluster, workload, config))
    lines.append(_fp8(cluster, config))
    return GuideDecisions(use_compile, workers, tuple(line for line in lines if line))


# What each memory saver runs on: liger-kernel installed, or the generated torchrun script (which writes
# torchtune's savers anew in plain PyTorch, `launchers/torchrun_savers.py`).
SAVER_PACKAGES = {"loss chunked": "the generated torchrun script", "loss fused-linear": "liger-kernel",
                  "activation offload": "the generated torchrun script",
                  "optimizer in backward": "the generated torchrun script; no gradient clipping or accumulation"}


def memory_savers(config: Config) -> list[str]:
    """The memory savers `config` runs, by the names of `SAVER_PACKAGES` (the plan table shows the same list)."""
    return [name for name, on in ((f"loss {config.loss}", config.loss.value != "hf"),
                                  ("activation offload", config.activation_offload),
                                  ("optimizer in backward", config.optimizer_in_backward)) if on]


def _savers(config: Config, allowed: bool) -> str:
    """The memory savers the plan runs and what each runs on, or how to let the search choose them."""
    used = memory_savers(config)
    if not used and allowed:
        return "memory savers: none chosen (allowed; none makes this plan faster)"
    if not used:
        return "memory savers: none (--allow-savers lets the search choose optimizer-in-backward, chunked/fused " \
               "losses and activation offload)"
    return "memory savers: " + ", ".join(f"{name} ({SAVER_PACKAGES[name]})" for name in used)


def _try(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> Estimate | None:
    try:
        return estimate(graph, cluster, workload, config)
    except (ValueError, ArithmeticError):
        return None


def _batch(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, chosen: Estimate,
           headroom: float) -> str:
    """Gradient accumulation vs micro-batch: what the neighbouring micro-batches would cost (fitting by the
    plan's own rule, `costmodels.fits`)."""
    text = [f"batch size: micro-batch {config.micro_batch} x accumulation {config.grad_accum} x dp {config.dp} "
            f"= {workload.global_batch} sequences"]
    for mb in (config.micro_batch * 2, config.micro_batch // 2):
        per_rank = config.micro_batch * config.grad_accum
        if mb < 1 or per_rank % mb:
            continue
        try:
            varied = replace(config, micro_batch=mb, grad_accum=per_rank // mb)
        except ValueError:  # Config refuses that split (e.g. accumulation under optimizer-in-backward)
            continue
        other = _try(graph, cluster, workload, varied)
        if other is None:
            continue
        if not fits(other, cluster, headroom).fits:
            text.append(f"micro-batch {mb} needs {other.memory.device_peak / GIB:.1f} GiB (does not fit)")
        else:
            change = other.time.step_time / chosen.time.step_time - 1
            text.append(f"micro-batch {mb} would be {change:+.1%} step time")
    return "; ".join(text)


def _checkpointing(config: Config) -> str:
    modes = config.checkpoint
    full, selective = sum(m is Checkpoint.FULL for m in modes), sum(m is Checkpoint.SELECTIVE for m in modes)
    op_selective = sum(m is Checkpoint.OP_SELECTIVE for m in modes)
    if not full and not selective and not op_selective:
        return "gradient checkpointing: off (activations fit; recompute would only cost time)"
    op = f", {op_selective} op-level selective (matmul and attention outputs kept)" if op_selective else ""
    return (f"gradient checkpointing: {full} layers full, {selective} selective{op} of {len(modes)} (the first "
            "layers, whose activations live longest; just enough to fit)")


def _selective_saving(graph: LayerGraph, workload: Workload, config: Config) -> str:
    """What Megatron's selective recompute (`--recompute-granularity selective`: the attention core only) would free
    of one layer's saved bytes at the plan's shape, for a plan on megatron-core's layers that does not use it: with
    flash attention no scores are kept, so it frees little, which is why plans rarely choose it. (Other lowerings
    may compile the layers a plan keeps, so their modes are not compared here.)"""
    if graph.runtime != "megatron" or Checkpoint.SELECTIVE in config.checkpoint:
        return ""
    layer = graph.decoder_layers()[0]
    shape = {"b": config.micro_batch, "s": local_seq_len(workload.seq_len, config.cp), "tp": config.tp,
             "sequence_parallel": config.sequence_parallel}
    kept = evaluate(layer.cost(Checkpoint.NONE).saved, **shape)
    freed = kept - evaluate(layer.cost(Checkpoint.SELECTIVE).saved, **shape)
    return (f"; selective recompute (the attention core only) would free {freed / MIB:,.0f} MiB of a layer's "
            f"{kept / MIB:,.0f} MiB here ({graph.attention} attention)")


def _precision(cluster: Cluster, config: Config) -> str:
    p = config.precision
    line = f"mixed precision: {p}"
    if p in (Precision.FP32, Precision.TF32):
        tf32 = cluster.gpu.peak_flops("tf32")
        line += "; tf32 matmuls" + (f" at {tf32 / 1e12:.0f} TFLOP/s" if tf32 and p is Precision.TF32 else
                                    " unavailable on this GPU (no-op)" if not tf32 else " available (--precision tf32)")
    return line


def _optimizer(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, chosen: Estimate,
               allowed: tuple[Optimizer, ...]) -> str:
    if config.optimizer in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED):
        others = [o for o in allowed if o not in (Optimizer.ADAMW, Optimizer.ADAMW_FUSED)]
        kinds = "Adafactor / 8-bit AdamW / bf16-state AdamW (Megatron's precision-aware optimizer)"
        return f"optimizer: AdamW ({kinds} " + ("allowed but not needed)" if others else
                                                "only if allowed: they change training)")
    adamw = _try(graph, cluster, workload, replace(config, optimizer=Optimizer.ADAMW))
    saving = "" if adamw is None else \
        f", saving {(adamw.memory.optimizer_states - chosen.memory.optimizer_states) / GIB:.1f} GiB per GPU " \
        "against AdamW's states"
    return (f"optimizer: {config.optimizer} chosen to fit{saving}; note it changes training dynamics "
            "(learning-rate schedule and convergence may need retuning)")


def _zero(config: Config, chosen: Estimate) -> str:
    share = f" ({config.optimizer_offload_fraction:.0%} of them)" if config.optimizer_offload_fraction != 1 else ""
    where = f"optimizer states {config.optimizer_offload}{share}, parameters {config.param_offload}"
    return (f"DeepSpeed ZeRO / FSDP: {engine_setting(config.engine, config.zero)}, offload: {where}; device peak "
            f"{chosen.memory.device_peak / GIB:.1f} GiB{_pipeline_stages(config)}")


def _pipeline_stages(config: Config) -> str:
    """Under a pipeline, the stages the engine runs at (FSDP2: 2 only), which the search was held to."""
    stages = rules_of(config.engine).pipeline_stages
    if config.pp == 1 or len(stages) == len(rules_of(config.engine).stages):
        return ""
    return (f"; with pipeline parallelism {config.engine} runs at zero={', '.join(map(str, stages))} only (a pipeline "
            "keeps each micro-batch's parameters from its forward to its backward)")


def _compile(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config, chosen: Estimate,
             pin: bool | None) -> tuple[bool, str]:
    """Whether to compile and why; `pin` is the user's on (True) / off (False), None under auto."""
    if pin is False:
        return False, "torch.compile: off (pinned)"
    if not compile_credited(replace(config, compile=True)):
        reason = f"{uncredited_reason(replace(config, compile=True))}, so no speed-up is credited"
        return (True, f"torch.compile: on (pinned); {reason}") if pin else \
            (False, f"torch.compile: off ({reason})")
    if cluster.gpu.vendor == "cpu" and pin is None:
        return False, "torch.compile: off (CPU test cluster)"
    # Under "auto" the search already decided, per configuration, with the rule below (tables.build_table).
    other = _try(graph, cluster, workload, replace(config, compile=not config.compile))
    compiled, eager = (chosen, other) if config.compile else (other, chosen)
    saving = 1 - compiled.time.step_time / eager.time.step_time if compiled and eager else 0.0
    if not config.compile:
        return False, f"torch.compile: off (would save only {saving:.1%}; auto needs {COMPILE_MIN_SAVING:.0%})"
    return True, f"torch.compile: on, fusing memory-bound kernels saves {saving:.1%} of the step"


def _data(cluster: Cluster, chosen: Estimate, workers: int, rate: float | None) -> str:
    per_worker = rate or DEFAULT_INPUT_TOKENS_PER_S_PER_WORKER
    needed = chosen.tokens_per_second / cluster.world_size
    supply = workers * per_worker
    line = (f"data preloading: {workers} dataloader workers per GPU, pinned memory; the GPU needs "
            f"{needed:,.0f} tokens/s, the workers supply ~{supply:,.0f}")
    if supply < needed:
        line += " - WARNING: the input pipeline would not keep up; pre-tokenize or add workers"
    return line


def _shapes(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> list[str]:
    dtype = matmul_dtype_on(config.precision, cluster.gpu)
    multiple = preferred_multiple(cluster.gpu, dtype)
    if multiple == 1:
        return []
    lines = []
    tokens = config.micro_batch * workload.seq_len
    lines.append(f"tensor-core shapes: micro-batch x sequence = {tokens} tokens "
                 + ("aligned" if tokens % multiple == 0 else f"not a multiple of {multiple}"))
    vocab = graph.dims.vocab
    if vocab % multiple:
        lines.append(f"tensor-core shapes: vocabulary {vocab} is not a multiple of {multiple}; padding it to "
                     f"{padded(vocab, multiple)} (model.resize_token_embeddings(..., pad_to_multiple_of="
                     f"{multiple})) speeds up the LM head")
    return lines


def _fp8(cluster: Cluster, config: Config) -> str:
    if config.precision is Precision.FP8:
        return "fp8: linear layers in fp8 (Transformer Engine / torchao float8), with fp8 weight copies"
    if cluster.gpu.peak_flops("fp8"):
        return "fp8: available on this GPU but not used unless allowed (--precision bf16-mixed,fp8)"
    return ""
