"""Megatron-LM arguments (names from NVIDIA/Megatron-LM `megatron/training/arguments.py`)."""

from __future__ import annotations

from graphs import Checkpoint, FitplanError

from ..plan import Plan
from .common import about
from .nodes import nodes_note, torchrun_argv
from .shell import command_line, comment, launch_script, option

# Every flag fitplan may emit, as Megatron-LM defines it (HEAD d98e8a6, 2026-08; shared notes §2.7). The tests
# fail on any emitted flag outside this list.
KNOWN_FLAGS = frozenset({
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
    "--micro-batch-size", "--global-batch-size", "--bf16", "--fp16", "--fp8-format", "--fp8-recipe",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--optimizer",
    "--lr", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--clip-grad",
    # model shape (arguments.py _add_network_size_args, _add_tokenizer_args, _add_training_args)
    "--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--group-query-attention",
    "--num-query-groups", "--kv-channels", "--seq-length", "--max-position-embeddings", "--tokenizer-type",
    "--tokenizer-model", "--normalization", "--norm-epsilon", "--swiglu", "--position-embedding-type",
    "--rotary-base", "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
})


def shape_arguments(plan: Plan) -> list[str]:
    """The model's architecture and sequence length: Megatron builds the model from these flags, not from the
    Hugging Face config (flag pattern as in Megatron-LM's Llama examples and checkpoint converters)."""
    shape, inputs = plan.inputs.shape, plan.inputs
    if shape is None:
        raise FitplanError("The plan has no model shape (it was made before plan schema 1.2), which Megatron's "
                           "model flags need.", "Re-plan with this fitplan (`solve ... -o plan.json`).")
    args = ["--num-layers", str(inputs.num_layers), "--hidden-size", str(inputs.hidden_size),
            "--ffn-hidden-size", str(shape.ffn_hidden), "--num-attention-heads", str(shape.heads)]
    if shape.kv_heads != shape.heads:
        args += ["--group-query-attention", "--num-query-groups", str(shape.kv_heads)]
    if shape.head_dim * shape.heads != inputs.hidden_size:
        args += ["--kv-channels", str(shape.head_dim)]
    args += ["--seq-length", str(inputs.seq_len), "--max-position-embeddings", str(shape.max_positions),
             "--tokenizer-type", "HuggingFaceTokenizer", *option("--tokenizer-model", inputs.model),
             "--normalization", shape.normalization]
    if shape.norm_epsilon is not None:
        args += ["--norm-epsilon", repr(shape.norm_epsilon)]
    if shape.gated_silu:
        args.append("--swiglu")
    args += ["--position-embedding-type", "rope" if shape.rope else "learned_absolute"]
    if shape.rope and shape.rope_theta is not None:
        args += ["--rotary-base", str(int(shape.rope_theta))]  # an int in Megatron's parser
    if not shape.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not shape.linear_bias:
        args.append("--disable-bias-linear")
    if shape.qkv_bias:
        args.append("--add-qkv-bias")
    return args


def arguments(plan: Plan) -> list[str]:
    d = plan.decisions
    args = ["--tensor-model-parallel-size", str(d.tp), "--pipeline-model-parallel-size", "1",
            *shape_arguments(plan),
            "--micro-batch-size", str(d.micro_batch), "--global-batch-size", str(d.micro_batch * d.grad_accum * d.dp)]
    if d.sequence_parallel:
        args.append("--sequence-parallel")
    precision = d.precision.value
    if precision in ("bf16-mixed", "bf16"):
        args.append("--bf16")
    elif precision == "fp16-mixed":
        args.append("--fp16")
    elif precision == "fp8":
        args += ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    full = sum(m is Checkpoint.FULL for m in d.checkpoint)
    if full:
        # "block" recomputes the first --recompute-num-layers layers of the stage, keeping the rest: fitplan's
        # canonical order.
        args += ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(full)]
    elif Checkpoint.SELECTIVE in d.checkpoint:
        args += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    if d.zero == 1:
        args += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    args += ["--optimizer", "adam" if d.optimizer.value.startswith("adamw") else "sgd"]
    return args


def emit(plan: Plan) -> dict[str, str]:
    flags = arguments(plan)
    argv = [*torchrun_argv(plan), "pretrain_gpt.py", *flags]
    return {"megatron_args.txt": command_line(flags) + "\n",
            "megatron_launch.sh": launch_script(argv, about=about(plan), forward=True, notes=nodes_note(plan)),
            "megatron_note.txt": comment(about(plan)) + "# Megatron needs its own checkpoint format of the model.\n"}
