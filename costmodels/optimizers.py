"""Optimizer states and step temporaries per parameter tensor, as the real implementations allocate them."""

from __future__ import annotations

import math
from collections.abc import Iterable

from .config import Optimizer

# bitsandbytes 8-bit optimizers (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization";
# bitsandbytes `Optimizer2State.init_state`): uint8 state1/state2 with one fp32 absmax per 256-element block.
BNB_BLOCK = 256
# Tensors with fewer elements than `min_8bit_size` keep 32-bit states (bitsandbytes default 4096).
BNB_MIN_8BIT_SIZE = 4096
# Both 8-bit states share the 256-entry fp32 dynamic quantisation maps (qmap1, qmap2), once per optimizer.
BNB_QMAP_BYTES = 2 * 256 * 4

# bitsandbytes' paged AdamW (`PagedAdamW8bit`, `PagedAdamW32bit`, bitsandbytes/optim/adamw.py 0.50.2) keep the
# states of `AdamW8bit` / `AdamW32bit`; only where they live differs (costmodels/paging.py).
PAGED_ADAMW_8BIT = Optimizer.PAGED_ADAMW_8BIT
PAGED_ADAMW_32BIT = Optimizer.PAGED_ADAMW_32BIT
PAGED_OPTIMIZERS = (PAGED_ADAMW_8BIT, PAGED_ADAMW_32BIT)


def state_bytes(optimizer: Optimizer | str, shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes of optimizer state for one tensor of `shape` whose states are kept at `itemsize` bytes."""
    numel = math.prod(shape)
    match optimizer:
        case Optimizer.PAGED_ADAMW_32BIT:
            # bitsandbytes 32-bit states are fp32 whatever the parameter dtype (`Optimizer2State.init_state`).
            return 2 * numel * 4
        case Optimizer.ADAMW | Optimizer.ADAMW_FUSED:
            return 2 * numel * itemsize  # exp_avg, exp_avg_sq (torch.optim.AdamW)
        case Optimizer.ADAMW_BF16:
            # Megatron-LM --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 (TE FusedAdam `exp_avg_dtype`, ...)
            return 2 * numel * 2
        case Optimizer.SGD:
            return numel * itemsize  # momentum_buffer
        case Optimizer.ADAFACTOR:
            if len(shape) >= 2:  # torch.optim.Adafactor: row_var (..., r, 1) and col_var (..., 1, c)
                return (numel // shape[-1] + numel // shape[-2]) * itemsize
            return numel * itemsize  # variance
        case Optimizer.ADAMW_8BIT | Optimizer.PAGED_ADAMW_8BIT:
            if numel < BNB_MIN_8BIT_SIZE:
                return 2 * numel * 4
            return 2 * numel + 2 * math.ceil(numel / BNB_BLOCK) * 4
    raise ValueError(f"unknown optimizer {optimizer}")


def master_itemsize(optimizer: Optimizer | str) -> int | None:
    """Bytes per element of the fp32 master copy where the optimizer stores it its own way (None: as the engine
    keeps it). Transformer Engine's FusedAdam (>= 2.1) under Megatron's precision-aware optimizer keeps only the
    16 low bits of each fp32 master weight; the bf16 weight is its high half (megatron-core 0.16.1
    OptimizerConfig.store_param_remainders, default True)."""
    return 2 if optimizer is Optimizer.ADAMW_BF16 else None


def grads_itemsize(optimizer: Optimizer | str) -> int | None:
    """Bytes per element of the gradient buffer where the optimizer sets it (None: as the engine keeps it):
    Megatron's precision-aware optimizer with --main-grads-dtype bf16."""
    return 2 if optimizer is Optimizer.ADAMW_BF16 else None


def step_counter_bytes(optimizer: Optimizer | str, tensors: int) -> int:
    """Per-tensor `step` counters that live on the device: fused AdamW keeps them there as fp32 scalars.

    The foreach implementations keep `step` on the CPU (torch `_get_scalar_dtype`, capturable=False).
    """
    return 4 * tensors if optimizer is Optimizer.ADAMW_FUSED else 0


def fixed_state_bytes(optimizer: Optimizer | str) -> int:
    """State shared by all tensors of one optimizer instance (bitsandbytes' quantisation maps)."""
    return BNB_QMAP_BYTES if optimizer in (Optimizer.ADAMW_8BIT, PAGED_ADAMW_8BIT) else 0


def step_temp_bytes(optimizer: Optimizer | str, shapes: Iterable[tuple[int, ...]], itemsize: int) -> int:
    """Peak temporary bytes of one optimizer step over local tensors of `shapes` (states at `itemsize`).

    The foreach kernels (the CUDA default) materialise one intermediate per tensor for the whole list at once:
    AdamW's `exp_avg_sq.sqrt()` and Adafactor's row x column variance estimate (torch 2.13 `_multi_tensor_*`).
    Fused AdamW, SGD and the bitsandbytes kernels (paged ones included) update in place.
    """
    numels = [math.prod(s) for s in shapes]
    if optimizer in (Optimizer.ADAMW, Optimizer.ADAFACTOR):
        return sum(numels) * itemsize
    return 0
