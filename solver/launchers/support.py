"""Which launchers can express a plan's decisions (DESIGN.md: every plan records who can run it)."""

from __future__ import annotations

from costmodels import Engine, Offload, Precision
from graphs import Checkpoint

from ..plan import Decisions


def unsupported(launcher: str, d: Decisions) -> list[str]:
    """Decisions `launcher` cannot express (empty when it can run the plan as emitted)."""
    problems = []
    selective = Checkpoint.SELECTIVE in d.checkpoint
    nvme = Offload.NVME in (d.optimizer_offload, d.param_offload)
    # DeepSpeed 0.19 keeps bf16 master weights only under ZeRO 1-3 (runtime/config.py rejects
    # bf16_master_weights_and_grads at stage 0); at stage 0 its bf16 optimizers keep an fp32 copy.
    pure_bf16_zero0 = d.engine is Engine.DEEPSPEED and d.zero == 0 and d.precision is Precision.BF16
    if launcher == "deepspeed":
        if d.engine is not Engine.DEEPSPEED:
            problems.append(f"engine {d.engine} (the deepspeed launcher runs DeepSpeed ZeRO)")
        if d.tp > 1:
            problems.append("tensor parallelism (fitplan emits DeepSpeed plans without AutoTP)")
        if selective:
            problems.append("selective recompute (HF models checkpoint whole layers)")
        if pure_bf16_zero0:
            problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
    elif launcher in ("hf", "accelerate"):
        if launcher == "hf" and d.tp > 1:
            problems.append("tensor parallelism in TrainingArguments (use the accelerate config)")
        if selective:
            problems.append("selective recompute (transformers checkpoints whole layers)")
        if nvme and d.engine is not Engine.DEEPSPEED:
            problems.append("NVMe offload outside DeepSpeed")
        if d.tp > 1 and d.engine is Engine.DEEPSPEED:
            problems.append("tensor parallelism with DeepSpeed")
        if pure_bf16_zero0:
            problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
        if d.precision is Precision.BF16 and d.engine is not Engine.DEEPSPEED:
            problems.append("pure bf16 training (TrainingArguments/accelerate bf16 means mixed precision)")
        if d.sequence_parallel:
            problems.append("sequence parallelism")
    elif launcher == "torchrun":
        if d.engine is Engine.DEEPSPEED:
            problems.append("DeepSpeed ZeRO (torchrun runs plain PyTorch / FSDP2)")
        if d.engine is Engine.DDP and d.tp > 1 and d.dp > 1:
            problems.append("tensor parallelism with DDP data parallelism (use FSDP2)")
        if nvme:
            problems.append("NVMe offload")
    elif launcher == "megatron":
        if d.engine is not Engine.DEEPSPEED or d.zero > 1:
            problems.append("sharding beyond Megatron's distributed optimizer (ZeRO-1)")
        if d.optimizer_offload is not Offload.NONE or d.param_offload is not Offload.NONE:
            problems.append("offload")
        if d.lora is not None:
            problems.append("LoRA")
        if d.precision is Precision.BF16:
            problems.append("pure bf16 (Megatron's --bf16 keeps fp32 main parameters)")
        if Checkpoint.SELECTIVE in d.checkpoint and set(d.checkpoint) != {Checkpoint.SELECTIVE}:
            problems.append("selective recompute on only some layers (Megatron applies it to all)")
        if Checkpoint.FULL in d.checkpoint and Checkpoint.SELECTIVE in d.checkpoint:
            problems.append("full and selective recompute mixed")
    return problems


def runnable_by(d: Decisions) -> tuple[str, ...]:
    from ..space import LAUNCHERS

    return tuple(name for name in LAUNCHERS if not unsupported(name, d))
