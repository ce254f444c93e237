"""Sharding of model states by data parallelism (DeepSpeed ZeRO stages, FSDP2) and the engines' buffers.

Each way the engines differ is one named rule here. Sizes are per rank, after tensor parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from graphs import ParamTensor

from . import hybrid_shard
from .config import Config, Engine
from .engines import DataParallelTraffic, rules_of
from .expert_parallel import expert_local_shape, state_ranks
from .identity_memo import IdentityMemo


@dataclass(frozen=True, slots=True)
class Sharding:
    """Over how many data-parallel ranks each state is split (1 = replicated)."""

    params: int
    grads: int
    optimizer: int


def syncs_once_pipelined(config: Config) -> bool:
    """Its sharded parameters stay gathered and its gradients accumulate unsharded for the whole step, reduced
    once after the last backward (FSDP2 under torch's pipelining: `EngineRules.syncs_once_when_pipelined`)."""
    rules = rules_of(config.engine)
    return config.pp > 1 and rules.syncs_once_when_pipelined and rules.sharded(config.zero)[0]


def shard_ranks(config: Config) -> int:
    """The ranks the ZeRO stages shard over: `Config.shard_ranks`, or one replica group's share of them under
    hybrid sharding (`hybrid_shard.shard_degree`; the groups hold the same shards and all-reduce their gradients)."""
    return hybrid_shard.shard_degree(config.dp, config.cp, config.dp_replicate)


def sharding(config: Config) -> Sharding:
    """ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters (Rajbhandari et al. 2020);
    FSDP2 `fully_shard` shards all three at both of its settings (each engine's `sharded_from`), each over the
    `shard_ranks`."""
    params, grads, optimizer = rules_of(config.engine).sharded(config.zero)
    return Sharding(*(shard_ranks(config) if split else 1 for split in (params, grads, optimizer)))


def fsdp_shard_dim(shape: tuple[int, ...] | list[int], dp: int) -> int:
    """The dim FSDP2 shards: dim 0 (`fully_shard`'s default) unless it has fewer rows than ranks, then the
    largest dim. MoE expert stacks (8 experts over 32 ranks) would otherwise leave most ranks empty and an
    eighth of the experts on each; train_fitplan.py passes this rule as `shard_placement_fn`, as torchtitan
    shards experts on dim 1 when they are fewer than the ranks."""
    if not shape or shape[0] >= dp:
        return 0
    return max(range(len(shape)), key=lambda d: (shape[d], -d))


def local_shape(tensor: ParamTensor, *, tp: int, dp: int, engine: Engine, ep: int = 1) -> tuple[int, ...]:
    """The largest rank's shard shape: EP keeps experts / ep of an expert stack, TP splits its dim (DTensor `Shard`:
    ceil chunks), then FSDP2 splits the dim `fsdp_shard_dim` picks (`fully_shard` chunks it) over the data-parallel
    ranks, an expert stack over the expert-data-parallel ones. DeepSpeed flattens instead (see `local_elements`)."""
    shape = list(expert_local_shape(tensor.shape, ep))
    dp = state_ranks(tensor, dp, ep)
    if tensor.tp_dim is not None and tp > 1:
        shape[tensor.tp_dim] = math.ceil(shape[tensor.tp_dim] / tp)
    if rules_of(engine).per_tensor_dim_shards and dp > 1 and shape:
        dim = fsdp_shard_dim(shape, dp)
        shape[dim] = math.ceil(shape[dim] / dp)
    return tuple(shape)


def local_elements(tensors: Iterable[ParamTensor | tuple[ParamTensor, int]], *, tp: int, dp: int, engine: Engine,
                   sharded: bool, ep: int = 1) -> int:
    """Elements the largest rank holds of `tensors` (or (tensor, count) groups) when a state is (or is not)
    sharded over `dp` (expert stacks under expert parallelism: their experts / ep over `expert_dp(dp, ep)`).

    FSDP2 shards every tensor on dim 0; DeepSpeed ZeRO partitions each tensor's flat view (stage 3) or the flat
    concatenation (stages 1-2) evenly, so a rank holds ceil(n / dp); DeepSpeed-MoE and Megatron keep expert
    parameters in their own groups, partitioned over the expert-data-parallel ranks.
    """
    if type(tensors) is tuple:  # a graph's memoised tensor groups: the same tuple under many configurations
        return _ELEMENTS.get((tensors,), (tp, dp, engine, sharded, ep),
                             lambda: _local_elements(tensors, tp=tp, dp=dp, engine=engine, sharded=sharded, ep=ep))
    return _local_elements(tensors, tp=tp, dp=dp, engine=engine, sharded=sharded, ep=ep)


_ELEMENTS: IdentityMemo[int] = IdentityMemo()


def _local_elements(tensors: Iterable[ParamTensor | tuple[ParamTensor, int]], *, tp: int, dp: int, engine: Engine,
                    sharded: bool, ep: int) -> int:
    total = 0
    for item in tensors:
        tensor, count = item if isinstance(item, tuple) else (item, 1)
        degree = state_ranks(tensor, dp, ep)
        if sharded and degree > 1 and rules_of(engine).per_tensor_dim_shards:
            total += count * math.prod(local_shape(tensor, tp=tp, dp=dp, engine=engine, ep=ep))
        else:
            n = math.prod(local_shape(tensor, tp=tp, dp=1, engine=engine, ep=ep))
            total += count * (math.ceil(n / degree) if sharded and degree > 1 else n)
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


def dp_traffic(config: Config, *, param_bytes: int, grad_bytes: int) -> DataParallelTraffic:
    """Full-buffer sizes of each data-parallel collective (`EngineRules.traffic`); `param_bytes`/`grad_bytes` are
    the TP-local parameter and gradient sizes in the communicated dtypes."""
    if shard_ranks(config) == 1:
        return DataParallelTraffic()
    return rules_of(config.engine).traffic(config.zero, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                           pipelined=config.pp > 1)
