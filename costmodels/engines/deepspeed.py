"""DeepSpeed ZeRO stages 0-3 (DeepSpeed 0.19; Rajbhandari et al. 2020): stage 1 shards optimizer states, 2 also
gradients, 3 also parameters, each as a flat partition; a 16-bit model with an fp32 master copy in the optimizer."""

from __future__ import annotations

from ..choices import Engine
from .base import Buffers, EngineRules, GradientSizes, UnitBytes

# DeepSpeed's estimators size host memory for offload with a 1.5x buffer factor
# (`estimate_zero3_model_states_mem_needs(..., additional_buffer_factor=1.5)`), for pinned staging buffers.
OFFLOAD_HOST_BUFFER_FACTOR = 1.5


def gradients(stage: int, sizes: GradientSizes) -> tuple[int, int]:
    """Stage 3 keeps only the fp32 gradient partition (16-bit when not mixed); stage 2 the 16-bit partition and
    its fp32 copy; stages 0-1 accumulate full 16-bit gradients beside the fp32 copy (the estimator's 18
    bytes/param for ZeRO-2/3: `estimate_zero2_model_states_mem_needs`, stage3 likewise)."""
    if stage == 3:
        return sizes.fp32_copy or sizes.partition * sizes.itemsize, 0
    if stage == 2:
        return sizes.partition * sizes.itemsize + sizes.fp32_copy, 0
    return sizes.fp32_copy, sizes.full * sizes.itemsize


def buffers(stage: int, units: UnitBytes) -> Buffers:
    """ZeRO-2 holds its double-buffered reduce bucket in backward; ZeRO-3 gathers a module's parameters and
    prefetches up to `stage3_prefetch_bucket_size` of the next, reducing through the bucket."""
    if stage == 2:
        return [(0, 0, units.bucket)] * len(units.gathered)
    if stage != 3:
        return [(0, 0, 0)] * len(units.gathered)
    gathered, result = units.gathered, []
    for i, own in enumerate(gathered):
        after = gathered[i + 1] if i + 1 < len(gathered) else 0
        before = gathered[i - 1] if i > 0 else 0
        result.append((own + min(units.prefetch, after), 0, own + min(units.prefetch, before) + units.bucket))
    return result


RULES = EngineRules(
    engine=Engine.DEEPSPEED, runtime="DeepSpeed 0.19", stages=(0, 1, 2, 3), stage_rule="runs ZeRO stages 0-3",
    sharded_from=(3, 2, 1), per_tensor_dim_shards=False, reshard_stages=(3,),
    fp32_weights_when_mixed=False, fp32_grads_when_mixed=False, fp32_grad_copy_when_mixed=True,
    # ZeRO-3 gathers parameters in module hooks that break torch.compile graphs; its compiler path (DeepCompile,
    # deepspeedai/DeepSpeed blogs/deepcompile) is "under active development" (DeepSpeedExamples
    # benchmarks/deepcompile), so a compiled ZeRO-3 step is not credited (issue 12).
    compile_stages=(0, 1, 2),
    # runtime/zero/config.py: offload_optimizer is "Valid for ZeRO stage 1, 2, 3"; offload_param and NVMe
    # (ZeRO-Infinity) only at stage 3.
    optimizer_offload_stages=(1, 2, 3), param_offload_stages=(3,), nvme_stages=(3,),
    # runtime/engine.py refuses a client optimizer under ZeRO-Offload unless zero_force_ds_cpu_optimizer is
    # false, and the offloaded step then runs on CPU tensors; accelerate swaps in DeepSpeedCPUAdam silently.
    offload_runs_own_optimizer=True, host_optimizer="adam_deepspeed",
    gradients=gradients, buffers=buffers,
    # stage3_param_persistence_threshold keeps small parameters whole on every rank (zero.persistence_threshold).
    small_params_whole_stages=(3,),
    # Its own fused Adam steps the flat partition after backward (no per-parameter hook path).
    own_fused_optimizer=True, bucketed_reduce_stages=(2,), host_buffer_factor=OFFLOAD_HOST_BUFFER_FACTOR,
    # No launcher fitplan emits runs DeepSpeed's own PipelineEngine (which needs a PipelineModule of the model).
    # ZeRO-3's PartitionedParameterCoordinator.fetch_sub_module: one all-gather per module, prefetching up to
    # stage3_prefetch_bucket_size elements ahead (`prefetch`).
    fetches_per_module=True,
)
