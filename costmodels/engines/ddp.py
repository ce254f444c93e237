"""PyTorch DistributedDataParallel (torch 2.x): replicated states, bucketed gradient all-reduces per step."""

from __future__ import annotations

from ..choices import Engine
from .base import EngineRules, GradientSizes

# DDP's gradient buckets hold 25 MB (`bucket_cap_mb=25`, torch.nn.parallel.DistributedDataParallel).
DDP_BUCKET_BYTES = 25 * 2**20


def gradients(stage: int, sizes: GradientSizes) -> tuple[int, int]:
    """Every rank accumulates full gradients; with dp > 1 DDP also keeps flat reduction buckets of the same size
    (gradient_as_bucket_view=False, the default)."""
    buckets = sizes.full * sizes.itemsize if sizes.dp > 1 else 0
    return buckets, sizes.full * sizes.itemsize


RULES = EngineRules(
    engine=Engine.DDP, runtime="torch DistributedDataParallel", stages=(0,),
    stage_rule="has no ZeRO stage; use deepspeed or fsdp2",
    sharded_from=(None, None, None), per_tensor_dim_shards=False, reshard_stages=(),
    # autocast keeps fp32 leaf weights and casts per use; their gradients are fp32 (torch.amp docs).
    fp32_weights_when_mixed=True, fp32_grads_when_mixed=True, runs_autocast=True,
    compile_stages=(0,),  # DDPOptimizer splits compiled graphs at bucket boundaries (torch/_dynamo/backends)
    optimizer_offload_stages=(), param_offload_stages=(),
    gradients=gradients, allreduce_bucket_bytes=DDP_BUCKET_BYTES,
    # DDP all-reduces buckets from its own autograd hooks; a post-accumulate-grad hook would step on the unreduced
    # local gradient (DDP uses these hooks only for compiled autograd).
    reduces_before_grad_hooks=False,
    quantized_base=True,
    # torchtitan 0.3.0 runs pipelines with plain data parallelism (parallelize: data_parallel_replicate).
    pipeline_stages=(0,),
)
