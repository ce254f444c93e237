"""Megatron-LM arguments (names from NVIDIA/Megatron-LM `megatron/training/arguments.py`, checked by its own
parse_args and validate_args at tag core_v0.16.1, the megatron-core release fitplan installs)."""

from __future__ import annotations

from costmodels import Offload, Optimizer
from graphs import Checkpoint, FitplanError
from solver.plan.capability import MEGATRON_CP_COMM, block_recompute_layers
from solver.plan.launchers.common import about, launch_environment
from solver.plan.launchers.nodes import nodes_note, torchrun_argv
from solver.plan.launchers.shell import Env, command_line, comment, env, launch_script, option
from solver.plan.record import Decisions, Inputs, ModelShape, Plan, RopeScaling

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
    # pipeline, context and expert parallelism (_add_distributed_args, _add_moe_args; core_v0.16.1)
    "--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout", "--context-parallel-size",
    "--cp-comm-type", "--expert-model-parallel-size", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
    "--moe-token-dispatcher-type", "--moe-router-load-balancing-type", "--moe-aux-loss-coeff",
    "--moe-router-pre-softmax", "--qk-layernorm",
    # the precision-aware optimizer (_add_training_args; core_v0.16.1)
    "--use-precision-aware-optimizer", "--main-grads-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype",
    # the hybrid device optimizer's offload (_add_training_args; core_v0.16.1)
    "--optimizer-cpu-offload", "--optimizer-offload-fraction", "--overlap-cpu-optimizer-d2h-h2d",
    # RoPE scaling and dropout (_add_network_size_args, _add_regularization_args; core_v0.16.1)
    "--use-rope-scaling", "--rope-scaling-factor", "--rotary-seq-len-interpolation-factor", "--attention-dropout",
    "--hidden-dropout",
    # the run's own settings (_add_data_args, _add_learning_rate_args, _add_training_args, _add_checkpointing_args)
    "--data-path", "--train-iters", "--save", "--save-interval",
})
# What a run needs that fitplan does not decide: the launch script passes each from an environment variable and
# stops before starting when one is unset (pretrain_gpt.py would train on nothing, or save nowhere).
RUN_SETTINGS = (("--data-path", "DATA_PATH", "the data prefix Megatron-LM tools/preprocess_data.py wrote"),
                ("--lr", "LR", "the peak learning rate, e.g. 2e-05"),
                ("--train-iters", "TRAIN_ITERS", "the optimizer steps to run"),
                ("--save", "SAVE_DIR", "the folder Megatron saves checkpoints to"),
                # validate_args (core_v0.16.1) asserts a positive --save-interval whenever --save is given
                ("--save-interval", "SAVE_INTERVAL", "optimizer steps between checkpoints, e.g. 1000"))
# megatron-core 0.16.1 RotaryEmbedding._apply_scaling: Llama 3.x scaling with its factor from --rope-scaling-factor
# and the other three parameters fixed at these values (models/common/embeddings/rotary_pos_embedding.py).
MEGATRON_LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_positions": 8192}
# validate_args (core_v0.16.1) asserts this variable is 1 under tensor or context parallelism before Blackwell, as
# Megatron-LM's example scripts export it: one CUDA work queue keeps its communication kernels in issue order.
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS=1"


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
    args += position_arguments(shape)
    # Megatron's defaults are 0.1 each (arguments.py _add_regularization_args): the model's own, 0 where it has none
    args += ["--attention-dropout", repr(shape.attention_dropout), "--hidden-dropout", repr(shape.hidden_dropout)]
    if not shape.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not shape.linear_bias:
        args.append("--disable-bias-linear")
    if shape.qkv_bias:
        args.append("--add-qkv-bias")
    if shape.qk_norm:
        args.append("--qk-layernorm")  # per head, in --normalization's norm
    return args


def position_arguments(shape: ModelShape) -> list[str]:
    """Rotary positions with the model's base and its config.json's scaling, or a learned position table."""
    if not shape.rope:
        return ["--position-embedding-type", "learned_absolute"]
    args = ["--position-embedding-type", "rope"]
    if shape.rope_theta is not None:
        args += ["--rotary-base", str(int(shape.rope_theta))]  # an int in Megatron's parser
    scaling = shape.rope_scaling
    if scaling is None:
        return args
    problem = rope_scaling_problem(scaling)
    if problem:
        raise FitplanError(f"Megatron cannot build this model: {problem}.", "Choose another launcher.")
    if scaling.kind == "llama3":
        return [*args, "--use-rope-scaling", "--rope-scaling-factor", repr(scaling.factor)]
    return [*args, "--rotary-seq-len-interpolation-factor", str(int(scaling.factor))]  # linear: positions / factor


def rope_scaling_problem(scaling: RopeScaling) -> str | None:
    """What Megatron's RoPE cannot express of the model's scaling (None: it runs it): Llama 3.x scaling with
    megatron-core's fixed frequency bounds, and linear interpolation by a whole factor (an int in its parser)."""
    if scaling.kind == "llama3":
        given = {key: getattr(scaling, key) for key in MEGATRON_LLAMA3_SCALING}
        if all(value is None or value == MEGATRON_LLAMA3_SCALING[key] for key, value in given.items()):
            return None
        return (f"llama3 RoPE scaling with {given} (megatron-core 0.16 fixes {MEGATRON_LLAMA3_SCALING}; only the "
                "factor is an argument)")
    if scaling.kind == "linear" and float(scaling.factor).is_integer():
        return None
    return f"RoPE scaling {scaling.kind} with factor {scaling.factor} (fitplan emits llama3 and whole linear factors)"


def model_problems(inputs: Inputs) -> list[str]:
    """What Megatron cannot build of the plan's model from its flags (empty: it can)."""
    scaling = inputs.shape.rope_scaling if inputs.shape is not None and inputs.shape.rope else None
    problem = None if scaling is None else rope_scaling_problem(scaling)
    return [problem] if problem else []


def run_arguments() -> list[str | Env]:
    """The run's settings fitplan does not decide, each from its environment variable (`RUN_SETTINGS`)."""
    return [word for flag, name, _ in RUN_SETTINGS for word in (flag, env(name))]


def pipeline_arguments(d: Decisions, layers: int) -> list[str]:
    """The pipeline's degree and split: an even split needs no flag (Megatron's default), v equal stages per rank
    take --num-layers-per-virtual-pipeline-stage, one stage per rank with equal middle stages the first/last
    flags, and any other split the explicit layout (E embedding, t decoder layer, L loss; stage s on rank s mod pp,
    as PipelineParallelLayerLayout orders them)."""
    args = ["--pipeline-model-parallel-size", str(d.pp)]
    if d.pp == 1:
        return args
    split = d.pp_split
    if not split:
        raise FitplanError("The plan records no pipeline split, which Megatron's pipeline flags need.",
                           "Re-plan with this fitplan (its plans record the split), or pin one with --pp-split.")
    if sum(split) != layers:
        raise FitplanError(f"The plan's pipeline split {list(split)} covers {sum(split)} layers, not the model's "
                           f"{layers}.", "Re-plan with this fitplan.")
    if len(set(split)) == 1:
        return args + (["--num-layers-per-virtual-pipeline-stage", str(split[0])] if d.pp_virtual > 1 else [])
    if d.pp_virtual == 1 and len(set(split[1:-1])) <= 1:
        return [*args, "--decoder-first-pipeline-num-layers", str(split[0]),
                "--decoder-last-pipeline-num-layers", str(split[-1])]
    return [*args, "--pipeline-model-parallel-layout", "E" + "|".join("t" * n for n in split) + "L"]


def expert_arguments(plan: Plan) -> list[str]:
    """A mixture-of-experts model's router and experts, and the expert-parallel degree (the all-to-all token
    dispatcher, whose dispatch and combine fitplan prices; the load-balancing aux loss at the model's own weight,
    which `graphs.megatron_moe` traces)."""
    d, shape = plan.decisions, plan.inputs.shape
    experts = 0 if shape is None else shape.experts
    if not experts:
        if d.ep > 1:
            raise FitplanError(f"ep={d.ep} for a model without experts.", "Re-plan with ep=1.")
        return []
    if experts % d.ep:
        raise FitplanError(f"ep={d.ep} does not divide the model's {experts} experts.", "Re-plan.")
    return ["--num-experts", str(experts), "--moe-router-topk", str(shape.top_k), "--moe-ffn-hidden-size",
            str(shape.expert_ffn_hidden or shape.ffn_hidden), "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", repr(shape.aux_loss_coeff),
            *(["--moe-router-pre-softmax"] if shape.router_pre_softmax else []),
            "--expert-model-parallel-size", str(d.ep)]


def recompute_arguments(d: Decisions) -> list[str]:
    """Full recompute of the first k layers of every pipeline stage (`--recompute-method block`), or selective
    recompute of the attention core on every layer."""
    full = sum(m is Checkpoint.FULL for m in d.checkpoint)
    if full:
        # "block" recomputes the first --recompute-num-layers layers of each stage, keeping the rest
        k = full if d.pp == 1 else block_recompute_layers(d.checkpoint, d.pp_split)
        if k is None:
            raise FitplanError("Megatron recomputes the first k layers of every pipeline stage; the plan "
                               "recomputes others.", "Re-plan with --launcher megatron.")
        return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(k)]
    if Checkpoint.SELECTIVE in d.checkpoint:
        return ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    return []


def arguments(plan: Plan) -> list[str]:
    d = plan.decisions
    # Megatron's data-parallel size is world / (tp x pp x cp), fitplan's dp: the global batch is m micro-batches of
    # every data-parallel rank, and each pipeline runs m = grad_accum micro-batches per step.
    args = ["--tensor-model-parallel-size", str(d.tp), *pipeline_arguments(d, plan.inputs.num_layers),
            *shape_arguments(plan),
            "--micro-batch-size", str(d.micro_batch), "--global-batch-size", str(d.micro_batch * d.grad_accum * d.dp)]
    if d.cp > 1:
        args += ["--context-parallel-size", str(d.cp), "--cp-comm-type", MEGATRON_CP_COMM[d.cp_mode]]
    args += expert_arguments(plan)
    if d.sequence_parallel:
        args.append("--sequence-parallel")
    precision = d.precision.value
    if precision in ("bf16-mixed", "bf16"):
        args.append("--bf16")
    elif precision == "fp16-mixed":
        args.append("--fp16")
    elif precision == "fp8":
        args += ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    args += recompute_arguments(d)
    if d.zero == 1:
        args += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    elif d.dp * d.cp > 1:
        args.append("--overlap-grad-reduce")  # the bucketed all-reduce in the last backward that the plan prices
    args += ["--optimizer", "adam" if d.optimizer.value.startswith("adamw") else "sgd"]
    if d.optimizer is Optimizer.ADAMW_BF16:  # Transformer Engine's FusedAdam; master remainders need TE >= 2.1
        args += ["--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
                 "--exp-avg-sq-dtype", "bf16"]
    if d.optimizer_offload is Offload.CPU:  # the hybrid device optimizer (costmodels/partial_offload.py), which
        # validate_args runs only with the precision-aware optimizer's code path; its copies beside the CPU step
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", f"{d.optimizer_offload_fraction:g}",
                 "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d"]
    return args


def emit(plan: Plan) -> dict[str, str]:
    flags = arguments(plan)
    d = plan.decisions
    connections = ["env", MAX_CONNECTIONS] if d.tp > 1 or d.cp > 1 else []
    argv = [*connections, *torchrun_argv(plan), "pretrain_gpt.py", *flags, *run_arguments()]
    required = {name: what for _, name, what in RUN_SETTINGS}
    return {"megatron_args.txt": command_line(flags) + "\n",
            "megatron_launch.sh": launch_script(argv, about=about(plan), environment=launch_environment(plan),
                                                forward=True, notes=nodes_note(plan), required=required),
            "megatron_note.txt": comment(about(plan)) + comment(
                "Megatron needs its own checkpoint format of the model: pass --load <converted checkpoint> "
                "--finetune to megatron_launch.sh to start from its weights. megatron_args.txt holds the plan's "
                "flags; the launch script adds "
                + ", ".join(f"{flag} from ${name} ({what})" for flag, name, what in RUN_SETTINGS)
                + ", and stops if one is unset.")}
