"""What each launcher can run as emitted: the one place launcher capabilities are written.

`space.py` asks it per outer configuration (so the search only considers what some allowed launcher runs) and
`plan.py`/`launchers` per plan, both `Config`s; it imports neither, so there is no import cycle.
"""

from __future__ import annotations

from collections.abc import Sequence

from costmodels import Config, Engine, Offload, Precision
from graphs import Checkpoint

# Launchers and what each can express (DESIGN.md: a plan records which launchers can run it).
LAUNCHERS = ("deepspeed", "hf", "accelerate", "torchrun", "megatron")


def unsupported(launcher: str, d: Config, *, checkpoint: Sequence[Checkpoint] = (), lora: bool = False) -> list[str]:
    """What `launcher` cannot express of these knobs, per-layer `checkpoint` modes and LoRA (empty: it runs them)."""
    rules = {"deepspeed": _deepspeed, "hf": _hf_or_accelerate, "accelerate": _hf_or_accelerate,
             "torchrun": _torchrun, "megatron": _megatron}
    return rules[launcher](launcher, d, tuple(checkpoint), lora)


def runnable_by(d: Config, *, checkpoint: Sequence[Checkpoint] = (), lora: bool = False,
                launchers: Sequence[str] = LAUNCHERS) -> tuple[str, ...]:
    """The `launchers` that run these knobs as emitted."""
    return tuple(name for name in launchers if not unsupported(name, d, checkpoint=checkpoint, lora=lora))


def selective_runners(launchers: Sequence[str], *, all_layers: bool) -> tuple[str, ...]:
    """Which of `launchers` can run selective recompute: torchrun per layer; Megatron only on every layer."""
    return tuple(name for name in launchers if name == "torchrun" or (name == "megatron" and all_layers))


# DeepSpeed 0.19's config (docs/_pages/config-json.md) has fp16 and bf16 blocks and no fp8 one; fp8 under DeepSpeed
# needs Transformer Engine modules in the model, which Megatron's launcher provides (--fp8-format hybrid).
_FP8_DEEPSPEED = "fp8 with DeepSpeed (ds_config.json has no fp8 field; the Megatron launcher runs it)"


def _pure_bf16_zero0(d: Config) -> bool:
    # DeepSpeed 0.19 keeps bf16 master weights only under ZeRO 1-3 (runtime/config.py rejects
    # bf16_master_weights_and_grads at stage 0); at stage 0 its bf16 optimizers keep an fp32 copy.
    return d.engine is Engine.DEEPSPEED and d.zero == 0 and d.precision is Precision.BF16


def _deepspeed(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = []
    if d.engine is not Engine.DEEPSPEED:
        problems.append(f"engine {d.engine} (the deepspeed launcher runs DeepSpeed ZeRO)")
    if d.tp > 1:
        problems.append("tensor parallelism (fitplan emits DeepSpeed plans without AutoTP)")
    if Checkpoint.SELECTIVE in checkpoint:
        problems.append("selective recompute (HF models checkpoint whole layers)")
    if _pure_bf16_zero0(d):
        problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
    if d.precision is Precision.FP8:
        problems.append(_FP8_DEEPSPEED)
    return problems


# fitplan prices LoRA under TP as PEFT's LoraParallelLinear splits it (graphs.structure.lora_style), which wraps
# Megatron's parallel layers; the HF TP plan and the generated script shard plain Linear modules, not PEFT's wrappers.
_LORA_TP = "LoRA with tensor parallelism (PEFT's parallel LoRA layers need Megatron's; HF TP plans shard plain Linears)"


def _hf_or_accelerate(launcher: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = []
    if launcher == "hf" and d.tp > 1:
        problems.append("tensor parallelism in TrainingArguments (use the accelerate config)")
    if Checkpoint.SELECTIVE in checkpoint:
        problems.append("selective recompute (transformers checkpoints whole layers)")
    if Offload.NVME in (d.optimizer_offload, d.param_offload) and d.engine is not Engine.DEEPSPEED:
        problems.append("NVMe offload outside DeepSpeed")
    if d.tp > 1 and d.engine is Engine.DEEPSPEED:
        problems.append("tensor parallelism with DeepSpeed")
    if _pure_bf16_zero0(d):
        problems.append("pure bf16 without ZeRO (DeepSpeed keeps fp32 master weights at stage 0)")
    if d.precision is Precision.BF16 and d.engine is not Engine.DEEPSPEED:
        problems.append("pure bf16 training (TrainingArguments/accelerate bf16 means mixed precision)")
    if d.sequence_parallel:
        problems.append("sequence parallelism")
    if lora and d.tp > 1:
        problems.append(_LORA_TP)
    if d.precision is Precision.FP8:
        if launcher == "hf":
            problems.append("fp8 (TrainingArguments has no fp8 switch; the accelerate or torchrun files run it)")
        elif d.engine is Engine.DEEPSPEED:
            problems.append(_FP8_DEEPSPEED)
        elif d.tp > 1:
            problems.append("fp8 with tensor parallelism (accelerate's torchao recipe converts unsharded Linear "
                            "layers)")
    return problems


def _torchrun(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = []
    if d.engine is Engine.DEEPSPEED:
        problems.append("DeepSpeed ZeRO (torchrun runs plain PyTorch / FSDP2)")
    if d.engine is Engine.DDP and d.tp > 1 and d.dp > 1:
        problems.append("tensor parallelism with DDP data parallelism (use FSDP2)")
    if Offload.NVME in (d.optimizer_offload, d.param_offload):
        problems.append("NVMe offload")
    if d.precision is Precision.FP8 and d.tp > 1:
        problems.append("fp8 with tensor parallelism (the script's TP plan uses plain Colwise/RowwiseParallel, not "
                        "torchao's Float8 styles)")
    if lora and d.tp > 1:
        problems.append(_LORA_TP)
    return problems


def _megatron(_: str, d: Config, checkpoint: tuple[Checkpoint, ...], lora: bool) -> list[str]:
    problems = []
    if d.engine is not Engine.DEEPSPEED or d.zero > 1:
        problems.append("sharding beyond Megatron's distributed optimizer (ZeRO-1)")
    if d.optimizer_offload is not Offload.NONE or d.param_offload is not Offload.NONE:
        problems.append("offload")
    if lora:
        problems.append("LoRA")
    if d.precision is Precision.BF16:
        problems.append("pure bf16 (Megatron's --bf16 keeps fp32 main parameters)")
    if Checkpoint.SELECTIVE in checkpoint and set(checkpoint) != {Checkpoint.SELECTIVE}:
        problems.append("selective recompute on only some layers (Megatron applies it to all)")
    if Checkpoint.FULL in checkpoint and Checkpoint.SELECTIVE in checkpoint:
        problems.append("full and selective recompute mixed")
    return problems
