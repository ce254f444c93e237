"""`estimate(graph, cluster, workload, config)`: the one place the knob models are composed."""

from __future__ import annotations

from graphs import Checkpoint, FitplanError, LayerGraph, Role

from . import activation_offload, context_parallel, expert_parallel, loss, precision
from .attention_kernels import kernel_note
from .breakdown import Estimate
from .choices import RUNTIME_ONLY_LOSSES
from .cluster import Cluster
from .compilation import compile_credited
from .compute import CAUSAL_FRACTION, EAGER_HOST_SECONDS_PER_KERNEL, KERNEL_LAUNCH_SECONDS
from .config import Config, Loss, Optimizer, Precision, Workload
from .engines import rules_of
from .expert_parallel import expert_notes, expert_refusal
from .lowering import _SHARED, liger_lowering, lowering_for, shared_lowering
from .memory import memory_breakdown
from .overhead import allocator_note
from .pipeline_stages import pipeline_estimate
from .timing import time_breakdown


class InvalidConfig(FitplanError):
    """A configuration that cannot run on this model or cluster."""


def check(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> None:
    """Raise `InvalidConfig` (with a way out) when `config` cannot run as given."""
    wanted = lowering_for(config, lora=graph.lora is not None)
    lowered = (_SHARED.get(graph.dtype, graph.dtype), _SHARED.get(graph.autocast, graph.autocast))
    if lowered != shared_lowering(config, lora=graph.lora is not None):
        raise ValueError(f"graph lowered as {graph.dtype}/autocast={graph.autocast}, but {config.engine} with "
                         f"{config.precision} needs {wanted[0]}/autocast={wanted[1]}")
    hint = "Choose a configuration the hardware and model allow (see `fitplan explain`)."
    if config.world_size != cluster.world_size:
        raise InvalidConfig(f"{_degrees(config)} = {config.world_size} ranks, but the cluster has "
                            f"{cluster.world_size} GPUs", hint)
    if (problem := context_parallel.sequence_problem(workload.seq_len, config.cp)) is not None:
        raise InvalidConfig(problem, "Pick a cp that divides the sequence length into 2 x cp chunks.")
    if config.tp not in graph.tp_degrees or config.tp > cluster.gpus_per_node:
        why = "" if graph.tp_splits_activations else (" (its tensor-parallel split cannot be measured: the model "
                                                       "has no plain colwise/rowwise TP plan to probe)")
        raise InvalidConfig(f"tp={config.tp} is not possible: {graph.model} allows {list(graph.tp_degrees)}{why} and "
                            f"a node has {cluster.gpus_per_node} GPUs", hint)
    layers = graph.decoder_layers()
    for layer, mode in zip(layers, config.layer_modes(len(layers)), strict=True):
        if mode not in layer.checkpoint_modes:
            raise InvalidConfig(f"{layer.name} cannot use checkpoint mode {mode}: {_missing_mode(graph, mode)}", hint)
    dtypes = {precision.matmul_dtype_on(config.precision, cluster.gpu),
              precision.attention_dtype_on(config.precision, cluster.gpu)}
    for dtype in dtypes:
        if cluster.gpu.peak_flops(dtype) is None:
            raise InvalidConfig(f"{cluster.gpu.name} has no {dtype} support for precision {config.precision}",
                                "Pick a precision the GPU supports (e.g. fp16-mixed on V100/T4, no fp8 before Hopper).")
    reasons = model_refusals(graph, config, modes_decided=bool(config.checkpoint))  # () : the search's outer
    if reasons:
        raise InvalidConfig("; ".join(reasons), hint)
    if graph.runtime == "hf" and graph.liger != (liger := liger_lowering(config)):
        raise ValueError(f"graph lowered with liger={graph.liger}, but loss={config.loss} needs lower(..., "
                         f"liger={liger}) (transformers' use_liger_kernel patches the layers)")
    if config.pp > 1:
        _check_pipeline(graph, config, hint)
    if (refused := expert_refusal(graph, config)) is not None:
        raise InvalidConfig(*refused)
    per_step = config.micro_batch * config.grad_accum * config.dp
    if per_step != workload.global_batch:
        raise InvalidConfig(f"micro_batch {config.micro_batch} x grad_accum {config.grad_accum} x dp {config.dp} = "
                            f"{per_step}, not the global batch {workload.global_batch}", hint)


def _check_pipeline(graph: LayerGraph, config: Config, hint: str) -> None:
    """A pipeline needs a decoder layer per stage, and a given split must cover the model's layers."""
    layers, stages = graph.dims.layers, config.pp * config.pp_virtual  # a pipeline rank's slice: the model's
    if stages > layers:
        raise InvalidConfig(f"pp={config.pp} x pp_virtual={config.pp_virtual} = {stages} pipeline stages, but "
                            f"{graph.model} has {layers} decoder layers", hint)
    if config.pp_split and sum(config.pp_split) != layers:
        raise InvalidConfig(f"pp_split {list(config.pp_split)} covers {sum(config.pp_split)} decoder layers, not "
                            f"the model's {layers}", "Give every layer to one stage, or leave the split to fitplan.")


def _degrees(config: Config) -> str:
    """The parallel degrees whose product is the world size, those above 1 besides tp and dp."""
    degrees = [("tp", config.tp), ("cp", config.cp), ("pp", config.pp), ("dp", config.dp)]
    return " x ".join(f"{name}={n}" for name, n in degrees if n > 1 or name in ("tp", "dp"))


def model_refusals(graph: LayerGraph, config: Config, *, modes_decided: bool = True) -> list[str]:
    """Why `config` cannot run on this model: the loss, context and expert parallelism, activation offload (once
    the checkpoint modes are decided) and a bitsandbytes-quantized base (the knob-only refusals are `Config`'s
    own)."""
    reasons = loss.refusals(config.loss, graph, config) + context_parallel.refusals(graph, config)
    reasons += expert_parallel.refusals(graph, config)  # the search leaves out what check() would refuse
    if config.activation_offload and modes_decided:
        reasons += activation_offload.refusals(graph, config)
    quantization = graph.lora.quantization if graph.lora is not None else None
    if quantization is not None and (not rules_of(config.engine).quantized_base or config.tp > 1):
        # fitplan keeps the packed base whole on every rank (states._param_bytes): sharding it (FSDP-QLoRA's
        # bnb_4bit_quant_storage) and tensor-parallel bitsandbytes layers are not modelled.
        reasons.append(f"a {quantization}-quantized base runs on DDP with tp=1 only ({config.engine}, "
                       f"tp={config.tp}): sharding packed bitsandbytes weights is not modelled")
    return reasons


def estimate(graph: LayerGraph, cluster: Cluster, workload: Workload, config: Config) -> Estimate:
    """Memory per GPU and time per optimizer step of running `graph` on `cluster` with `config`."""
    check(graph, cluster, workload, config)
    reasons = [] if config.checkpoint else model_refusals(graph, config)  # no modes given: none checkpointed
    if reasons:
        raise InvalidConfig("; ".join(reasons), "Choose a configuration the model allows.")
    pipeline = None
    if config.pp > 1:
        memory, time, pipeline = pipeline_estimate(graph, cluster, workload, config)
    else:
        memory = memory_breakdown(graph, cluster, workload, config)
        time = time_breakdown(graph, cluster, workload, config)
    tokens = workload.tokens_per_step / time.step_time
    return Estimate(memory=memory, time=time, tokens_per_second=tokens,
                    mfu=model_flops(graph, workload) / time.step_time / _cluster_peak(cluster, config),
                    notes=_notes(graph, config) + _time_notes(cluster, config), pipeline=pipeline)


def _missing_mode(graph: LayerGraph, mode: Checkpoint) -> str:
    """Why the lowering has no costs for `mode`."""
    if mode is Checkpoint.SELECTIVE:
        return (f"{graph.architecture} does not route attention through transformers' attention interface, which "
                "selective recompute wraps")
    if mode is Checkpoint.OP_SELECTIVE:
        return ("the graph was lowered without op-level SAC (lower(..., op_selective=True)), or torch's SAC refuses "
                "this model")
    return f"the {graph.runtime} lowering has no {mode} mode"


def model_flops(graph: LayerGraph, workload: Workload) -> float:
    """Training FLOPs of one step without recompute (causal attention counted once, as MFU conventions do)."""
    per_sequence = 0.0
    for layer in graph.nodes():
        for work in (layer.cost().forward, layer.cost().backward):
            flops = work.flops(1, workload.seq_len)
            attention = work.attention_flops(1, workload.seq_len)
            per_sequence += flops - attention * (1 - CAUSAL_FRACTION)
    return per_sequence * workload.global_batch


def _cluster_peak(cluster: Cluster, config: Config) -> float:
    dtype = "bf16" if config.precision is Precision.FP8 else precision.matmul_dtype(config.precision)
    return (cluster.gpu.peak_flops(dtype) or 1.0) * cluster.world_size


def _time_notes(cluster: Cluster, config: Config) -> tuple[str, ...]:
    """The kernel-level sources the step time assumes (attention kernel, launch cost)."""
    if cluster.gpu.vendor == "cpu":
        return ()
    return (kernel_note(cluster.gpu, transformer_engine=rules_of(config.engine).transformer_engine),
            _host_note(config))


def _host_note(config: Config) -> str:
    """The host cost per kernel the step assumes: eager layers' measured one, or a compiled wrapper's launches."""
    if compile_credited(config):
        cost = (f"{KERNEL_LAUNCH_SECONDS * 1e6:.1f} us of host time per kernel (the compiled wrapper's launches; "
                "NVIDIA 'Getting Started with CUDA Graphs' 2019)")
    else:
        cost = (f"{EAGER_HOST_SECONDS_PER_KERNEL * 1e6:.1f} us of host time per kernel (eager PyTorch: a small HF "
                "Llama's forward and backward measured on an H200 host, benchmarks/data/gpu/h200_kernels.json)")
    return (f"kernel launches: {cost}, one per ATen op the lowering counts; a phase waits for the host when its "
            "kernels are shorter (time.details kernel_launch_exposed)")


def _notes(graph: LayerGraph, config: Config) -> tuple[str, ...]:
    if graph.runtime == "megatron":
        notes = [f"activations measured on megatron-core's GPT layers with the kernels a default Megatron-LM run "
                 f"uses ({graph.attention}: Transformer Engine's flash attention, fused SwiGLU and RoPE; "
                 "graphs/te_kernels.py)"]
    else:
        notes = [f"activations measured with {graph.attention} attention (flash/memory-efficient kernels on GPUs); "
                 "sliding windows are not credited"]
    if any(m is not Checkpoint.NONE for m in config.layer_modes(len(graph.decoder_layers()))):
        notes.append("checkpointed layers are recomputed with megatron's tensor_parallel.checkpoint (reentrant)"
                     if graph.runtime == "megatron" else
                     "checkpointed layers are recomputed with torch.utils.checkpoint (non-reentrant)")
    if any(layer.role is Role.DECODER and layer.moe for layer in graph.nodes()):
        notes.append("MoE FLOPs assume balanced routing (each token to top_k experts)" + (
            "; so does the momentary peak inside one expert (megatron-core's experts split the tokens between "
            "them: graphs/megatron_moe.py)" if graph.runtime == "megatron" else ""))
    notes.append(allocator_note(config.expandable_segments))
    return (tuple(notes) + context_parallel.notes(config) + expert_notes(config)
            + _saver_notes(config, titan=graph.runtime == "torchtitan"))


def _saver_notes(config: Config, *, titan: bool) -> tuple[str, ...]:
    """What the memory-saving knobs assume, in words (`titan`: priced on torchtitan's code, its own loss)."""
    notes = []
    if config.optimizer in (Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT):
        notes.append("paged optimizer: its states of tensors >= 1e5 elements are counted in host RAM, one tensor's "
                     "on the device while it steps, and every page moves in and out once per step over the host "
                     "link (bitsandbytes prefetches per tensor)")
    if config.optimizer_in_backward:
        notes.append("optimizer in backward: each parameter steps and frees its gradient in its "
                     "post-accumulate-grad hook (torchtune); no accumulation and no gradient clipping")
    if titan:
        notes.append("loss: torchtitan's " + ("ChunkedLossWrapper, traced on its own code (the head and "
                     "cross-entropy per sequence chunk, each chunk's backward inside the loss call)"
                     if config.loss is Loss.CHUNKED else "plain CrossEntropyLoss over full fp32 logits, traced on "
                     "its own code"))
    elif config.loss in RUNTIME_ONLY_LOSSES:
        notes.append(f"{config.loss} loss: the head and cross-entropy allocate as "
                     + ("Megatron-LM's legacy --fp16-lm-cross-entropy (and Mist's runtime)"
                        if config.loss is Loss.MEGATRON_FP16 else "flash-attn's fused cross-entropy (llm-foundry)")
                     + " does; its time is the lowered cross-entropy's; no launcher here emits it")
    elif config.loss is not Loss.HF:
        notes.append(f"{config.loss} loss: the head and cross-entropy allocate as "
                     f"{'torchtune' if config.loss is Loss.CHUNKED else 'liger-kernel'}'s code does; its time is "
                     + ("the lowered ops on each chunk" if config.loss is Loss.CHUNKED else
                        "the head's matmuls plus Liger's three passes over the logits; the layers run Liger's "
                        "RMSNorm, SwiGLU and RoPE kernels (use_liger_kernel's patch), traced with their saved "
                        "tensors, one launch per kernel"))
    if config.activation_offload:
        notes.append("activation offload: saved tensors go to pinned host memory after each layer's forward and "
                     "come back one layer ahead in backward; copies not hidden by compute are added")
    return tuple(notes)
