"""Sharding of model states by data parallelism (DeepSpeed ZeRO stages, FSDP2) and the engines' buffers.

Each way the engines differ is one named rule here. Sizes are per rank, after tensor parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from graphs import ParamTensor

from .config import Config, Engine


@dataclass(frozen=True, slots=True)
class Sharding:
    """Over how many data-parallel ranks each state is split (1 = replicated)."""

    params: int
    grads: int
    optimizer: int


def sharding(config: Config) -> Sharding:
    """ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters (Rajbhandari et al. 2020);
    FSDP2 `fully_shard` shards all three at both of its settings."""
    dp = config.dp
    if config.engine is Engine.FSDP2:
        return Sharding(dp, dp, dp)
    stage = config.zero if config.engine is Engine.DEEPSPEED else 0
    return Sharding(dp if stage >= 3 else 1, dp if stage >= 2 else 1, dp if stage >= 1 else 1)


def fsdp_shard_dim(shape: tuple[int, ...] | list[int], dp: int) -> int:
    """The dim FSDP2 shards: dim 0 (`fully_shard`'s default) unless it has fewer rows than ranks, then the
    largest dim. MoE expert stacks (8 experts over 32 ranks) would otherwise leave most ranks empty and an
    eighth of the experts on each; train_fitplan.py passes this rule as `shard_placement_fn`, as torchtitan
    shards experts on dim 1 when they are fewer than the ranks."""
    if not shape or shape[0] >= dp:
        return 0
    return max(range(len(shape)), key=lambda d: (shape[d], -d))


def local_shape(tensor: ParamTensor, *, tp: int, dp: int, engine: Engine) -> tuple[int, ...]:
    """The largest rank's shard shape: TP splits its dim (DTensor `Shard`: ceil chunks), then FSDP2 splits the
    dim `fsdp_shard_dim` picks (`fully_shard` chunks it). DeepSpeed flattens instead (see `local_elements`)."""
    shape = list(tensor.shape)
    if tensor.tp_dim is not None and tp > 1:
        shape[tensor.tp_dim] = math.ceil(shape[tensor.tp_dim] / tp)
    if engine is Engine.FSDP2 and dp > 1 and shape:
        dim = fsdp_shard_dim(shape, dp)
        shape[dim] = math.ceil(shape[dim] / dp)
    return tuple(shape)


def local_elements(tensors: Iterable[ParamTensor | tuple[ParamTensor, int]], *, tp: int, dp: int, engine: Engine,
                   sharded: bool) -> int:
    """Elements the largest rank holds of `tensors` (or (tensor, count) groups) when a state is (or is not)
    sharded over `dp`.

    FSDP2 shards every tensor on dim 0; DeepSpeed ZeRO partitions each tensor's flat view (stage 3) or the flat
    concatenation (stages 1-2) evenly, so a rank holds ceil(n / dp).
    """
    total = 0
    for item in tensors:
        tensor, count = item if isinstance(item, tuple) else (item, 1)
        if sharded and dp > 1 and engine is Engine.FSDP2:
            total += count * math.prod(local_shape(tensor, tp=tp, dp=dp, engine=engine))
        else:
            n = math.prod(local_shape(tensor, tp=tp, dp=1, engine=engine))
            total += count * (math.ceil(n / dp) if sharded and dp > 1 else n)
    return total


# DeepSpeed keeps parameters of at most `stage3_param_persistence_threshold` elements whole on every rank; the HF
# integration sets it to 10 * hidden ("auto", transformers integrations/deepspeed.py).
def persistence_threshold(hidden: int) -> int:
    return 10 * hidden


# The reduce bucket the HF integration sets for "auto": hidden * hidden elements (transformers integrations/
# deepspeed.py); fitplan emits this value explicitly. Stage 3 prefetches 0.9 * hidden^2 elements.
def reduce_bucket_elements(hidden: int) -> int:
    return hidden * hidden


def prefetch_bucket_elements(hidden: int) -> int:
    return int(0.9 * hidden * hidden)


@dataclass(frozen=True, slots=True)
class DataParallelTraffic:
    """Bytes each rank moves in data-parallel collectives, by when they happen."""

    forward_gather: int = 0
    """Parameters all-gathered during each micro-batch's forward (ZeRO-3 / FSDP2)."""
    backward_gather: int = 0
    """Parameters all-gathered again during backward (reshard-after-forward)."""
    backward_reduce: int = 0
    """Gradients reduce-scattered during each micro-batch's backward (ZeRO-2/3, FSDP2)."""
    step_allreduce: int = 0
    """Gradients all-reduced once per step, overlapping the last backward (DDP, ZeRO-0/1)."""
    step_gather: int = 0
    """Updated parameters all-gathered after the optimizer step (ZeRO-1/2)."""


def dp_traffic(config: Config, *, param_bytes: int, grad_bytes: int) -> DataParallelTraffic:
    """Full-buffer sizes of each data-parallel collective; `param_bytes`/`grad_bytes` are the TP-local
    parameter and gradient sizes in the communicated dtypes."""
    if config.dp == 1:
        return DataParallelTraffic()
    if config.engine is Engine.FSDP2 or (config.engine is Engine.DEEPSPEED and config.zero == 3):
        resharded = config.engine is Engine.DEEPSPEED or config.zero == 3
        return DataParallelTraffic(forward_gather=param_bytes, backward_gather=param_bytes if resharded else 0,
                                   backward_reduce=grad_bytes)
    if config.engine is Engine.DEEPSPEED and config.zero == 2:
        return DataParallelTraffic(backward_reduce=grad_bytes, step_gather=param_bytes)
    if config.engine is Engine.DEEPSPEED and config.zero == 1:
        return DataParallelTraffic(step_allreduce=grad_bytes, step_gather=0)
    return DataParallelTraffic(step_allreduce=grad_bytes)
