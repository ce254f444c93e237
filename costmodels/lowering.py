"""Which lowering of the model a configuration is priced on: the dtype and autocast its runtime trains in, and
whether Liger's patch replaces the layers' kernels. Read by the cost modules and by the pricing route."""

from __future__ import annotations

from . import precision
from .choices import Loss
from .config import Config
from .engines import rules_of


def lowering_for(config: Config, *, lora: bool = False) -> tuple[str, str | None]:
    """The (dtype, autocast) the layer graph must be lowered with for `config`.

    Plain PyTorch mixed precision keeps fp32 weights and autocasts (LoRA keeps the frozen base in 16 bits);
    DeepSpeed and FSDP2 run the module in 16 bits and keep fp32 masters / shards themselves.
    """
    compute = precision.compute_dtype(config.precision)
    if precision.is_mixed(config.precision) and rules_of(config.engine).runs_autocast:
        return (compute if lora else "float32"), compute
    return compute, None


# fp16 and bf16 tensors have the same sizes (2 bytes), so one 16-bit lowering serves both.
_SHARED: dict[str | None, str] = {"float16": "bfloat16"}


def shared_lowering(config: Config, *, lora: bool = False) -> tuple[str, str | None]:
    """`lowering_for(config)` with fp16 mapped to bf16: the lowering to build (or reuse) for `config`."""
    dtype, autocast = lowering_for(config, lora=lora)
    return _SHARED.get(dtype, dtype), _SHARED.get(autocast, autocast)


def liger_lowering(config: Config) -> bool:
    """Whether `config` runs Liger's whole patch, so its layers are lowered with Liger's kernels (`graphs/liger.py`):
    the fused linear loss is emitted as transformers' `use_liger_kernel`, which also swaps in Liger's RMSNorm,
    SwiGLU and RoPE (solver/plan/launchers/hf.py `LIGER_KERNEL_CONFIG`)."""
    return config.loss is Loss.FUSED_LINEAR
