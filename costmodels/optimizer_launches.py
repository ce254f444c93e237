"""Kernels the optimizer step launches: a few multi-tensor kernels per step for torch's foreach and fused
optimizers, one per tensor for bitsandbytes'. A small model's step can wait on these launches rather than on HBM."""

from __future__ import annotations

import math

from .compute import KERNEL_LAUNCH_SECONDS
from .config import Config, Optimizer
from .engines import rules_of

# Multi-tensor ops each step issues over the parameter-sized tensor lists, counted over torch 2.13's own
# implementations (`_multi_tensor_adamw`, `_fused_adamw`, `_multi_tensor_sgd` with momentum,
# `_multi_tensor_adafactor`); fused AdamW adds one over its device-resident `step` counters (foreach keeps them
# on the host). tests/costmodels/test_optimizer_launches.py recounts them from the real optimizers.
MULTI_TENSOR_OPS = {Optimizer.ADAMW: 8, Optimizer.ADAMW_FUSED: 1 + 1, Optimizer.SGD: 3, Optimizer.ADAFACTOR: 13,
                    # Transformer Engine's FusedAdam (transformer_engine/pytorch/optimizers/fused_adam.py): one
                    # multi_tensor_adam kernel over the group's lists, its step count kept on the host
                    Optimizer.ADAMW_BF16: 1}
# bitsandbytes' optimizers step each parameter in its own call (`Optimizer8bit.step` -> `update_step`), one
# update kernel per tensor (`optimizer_update_8bit_blockwise` / `optimizer_update_32bit`, bitsandbytes 0.50).
PER_TENSOR_KERNELS = {Optimizer.ADAMW_8BIT: 1, Optimizer.PAGED_ADAMW_8BIT: 1, Optimizer.PAGED_ADAMW_32BIT: 1}
# One multi-tensor kernel covers at most 36 tensors of a depth-4 list (params, grads, two moments) and 320 blocks
# of 65536 elements (PyTorch aten/src/ATen/native/cuda/MultiTensorApply.cuh: depth_to_max_tensors,
# depth_to_max_blocks, kChunkSize); more of either starts another launch.
MAX_TENSORS_PER_LAUNCH = 36
MAX_ELEMENTS_PER_LAUNCH = 320 * 65536


def step_kernels(optimizer: Optimizer, *, tensors: int, elements: int) -> int:
    """Kernels one optimizer step launches over `tensors` local tensors holding `elements` elements."""
    if optimizer in PER_TENSOR_KERNELS:
        return PER_TENSOR_KERNELS[optimizer] * tensors
    launches = max(math.ceil(tensors / MAX_TENSORS_PER_LAUNCH), math.ceil(elements / MAX_ELEMENTS_PER_LAUNCH))
    return MULTI_TENSOR_OPS[optimizer] * launches


def optimizer_tensors(trainable_tensors: int, config: Config) -> int:
    """Tensors the optimizer steps on one rank: DeepSpeed ZeRO 1-3 steps one flat fp32 partition per parameter
    group (`single_partition_of_fp32_groups`, `fp32_partitioned_groups_flat`); DDP and FSDP2 step every
    parameter (FSDP2's are DTensor shards of the same tensors)."""
    rules = rules_of(config.engine)
    if rules.sharded(config.zero)[2] and not rules.per_tensor_dim_shards:  # a flat optimizer partition
        return 1
    return trainable_tensors


def step_launch_seconds(trainable_tensors: int, config: Config, *, elements: int) -> float:
    """Host seconds to launch one optimizer step's kernels over `elements` local trainable elements."""
    tensors = optimizer_tensors(trainable_tensors, config)
    return step_kernels(config.optimizer, tensors=tensors, elements=elements) * KERNEL_LAUNCH_SECONDS
