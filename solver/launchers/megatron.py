"""Megatron-LM arguments (names from NVIDIA/Megatron-LM `megatron/training/arguments.py`)."""

from __future__ import annotations

from graphs import Checkpoint

from ..plan import Plan
from .common import about
from .shell import command_line, comment, launch_script

# Every flag fitplan may emit, as Megatron-LM defines it (HEAD d98e8a6, 2026-08; shared notes §2.7). The tests
# fail on any emitted flag outside this list.
KNOWN_FLAGS = frozenset({
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
    "--micro-batch-size", "--global-batch-size", "--bf16", "--fp16", "--fp8-format", "--fp8-recipe",
    "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-modules",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--optimizer",
    "--lr", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--clip-grad",
})


def arguments(plan: Plan) -> list[str]:
    d = plan.decisions
    args = ["--tensor-model-parallel-size", str(d.tp), "--pipeline-model-parallel-size", "1",
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
    cluster, flags = plan.inputs.cluster, arguments(plan)
    argv = ["torchrun", "--nproc_per_node", str(cluster.gpus_per_node), "--nnodes", str(cluster.nodes),
            "pretrain_gpt.py", *flags]
    return {"megatron_args.txt": command_line(flags) + "\n",
            "megatron_launch.sh": launch_script(argv, about=about(plan)),
            "megatron_note.txt": comment(about(plan)) + "# Megatron needs its own checkpoint format of the model.\n"}
