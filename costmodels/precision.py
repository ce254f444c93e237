"""Precision: which dtype each kind of state and each kind of math uses."""

from __future__ import annotations

from . import optimizers
from .config import Engine, Optimizer, Precision
from .engines import rules_of
from .hardware import GPU

_COMPUTE = {Precision.FP32: "float32", Precision.TF32: "float32", Precision.FP16_MIXED: "float16",
            Precision.BF16_MIXED: "bfloat16", Precision.BF16: "bfloat16", Precision.FP8: "bfloat16"}
_MATMUL = {Precision.FP32: "fp32", Precision.TF32: "tf32", Precision.FP16_MIXED: "fp16",
           Precision.BF16_MIXED: "bf16", Precision.BF16: "bf16", Precision.FP8: "fp8"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def compute_dtype(precision: Precision) -> str:
    """The dtype activations and the traced model use (the lowering's `dtype`)."""
    return _COMPUTE[precision]


def matmul_dtype(precision: Precision) -> str:
    """The tensor-core format of linear-layer matmuls (the GPU peak-FLOP/s column)."""
    return _MATMUL[precision]


def matmul_dtype_on(precision: Precision, gpu: GPU) -> str:
    """The format matmuls really run in on `gpu`: TF32 without TF32 tensor cores (Volta, Turing) is a no-op,
    PyTorch's allow_tf32 flag changes nothing and matmuls run in fp32."""
    dtype = _MATMUL[precision]
    return "fp32" if dtype == "tf32" and gpu.peak_flops("tf32") is None else dtype


def attention_dtype_on(precision: Precision, gpu: GPU) -> str:
    """Attention kernels run in the compute dtype even when linears run in fp8 (TF32 as for matmuls)."""
    return "bf16" if precision is Precision.FP8 else matmul_dtype_on(precision, gpu)


def is_mixed(precision: Precision) -> bool:
    """Mixed precision keeps fp32 master weights beside 16-bit compute."""
    return precision in (Precision.FP16_MIXED, Precision.BF16_MIXED, Precision.FP8)


def compute_itemsize(precision: Precision) -> int:
    return _ITEMSIZE[compute_dtype(precision)]


def weight_itemsize(precision: Precision, engine: Engine, *, trainable: bool) -> int:
    """Bytes per element of the parameters the engine keeps (before any gather).

    Plain PyTorch and FSDP2 keep trainable weights in fp32 under mixed precision (autocast / MixedPrecisionPolicy
    casts per use); DeepSpeed keeps the model in 16 bits and an fp32 master copy in the optimizer. Frozen weights
    (LoRA base) stay in the compute dtype.
    """
    if not trainable:
        return compute_itemsize(precision)
    if is_mixed(precision) and rules_of(engine).fp32_weights_when_mixed:
        return 4
    return compute_itemsize(precision)


def grad_itemsize(precision: Precision, engine: Engine) -> int:
    """Bytes per element of gradients as backward produces them (before reduction)."""
    if is_mixed(precision) and rules_of(engine).fp32_grads_when_mixed:
        return 4  # autocast: gradients of fp32 leaf weights are fp32
    return compute_itemsize(precision)


def master_itemsize(precision: Precision, engine: Engine, optimizer: Optimizer = Optimizer.ADAMW) -> int:
    """Extra fp32 master copy per trainable element: engines that keep 16-bit weights under mixed precision
    (DeepSpeed, Megatron), at the optimizer's own width where it stores the copy its way."""
    if not is_mixed(precision) or rules_of(engine).fp32_weights_when_mixed:
        return 0
    own = optimizers.master_itemsize(optimizer)
    return 4 if own is None else own


def reduce_itemsize(precision: Precision, engine: Engine, optimizer: Optimizer = Optimizer.ADAMW) -> int:
    """Bytes per element gradients are accumulated and reduced in: the optimizer's gradient dtype where it sets
    one, fp32 under mixed precision where the engine reduces in fp32 (FSDP2's reduce_dtype, Megatron's
    accumulate_allreduce_grads_in_fp32, which Megatron-LM sets for --bf16 only), else the dtype backward
    produces."""
    own = optimizers.grads_itemsize(optimizer)
    if own is not None:
        return own
    rules = rules_of(engine)
    if is_mixed(precision) and rules.reduce_fp32_when_mixed and not (
            precision is Precision.FP16_MIXED and rules.fp16_keeps_16bit_grads):
        return 4
    return grad_itemsize(precision, engine)


def state_itemsize(precision: Precision) -> int:
    """Optimizer moments follow the master weights: fp32, except for pure bf16 training."""
    return 2 if precision is Precision.BF16 else 4
