"""Megatron-LM's data parallelism (megatron-core 0.16.1 `DistributedDataParallel` and its optimizers): a 16-bit
model whose gradients accumulate into one persistent buffer (`main_grad`: fp32 under --bf16, fp16 under --fp16),
with fp32 main parameters and Adam moments in the optimizer; stage 1 is `--use-distributed-optimizer`, which shards
only the optimizer's part.

Its own memory estimate (megatron/training/theoretical_memory_usage.py, `compute_weight_and_optimizer_memory`)
counts 18 bytes per parameter, or 6 + 12/dp with the distributed optimizer: 2 (bf16 weights) + 4 (fp32 gradient
buffer) + 12 (fp32 main weights and both moments); under --fp16 the buffer is 2 bytes. DeepSpeed's ZeRO-0/1 keep
16-bit gradients beside an fp32 copy instead (`deepspeed.gradients`), which is why Megatron plans are not priced as
DeepSpeed."""

from __future__ import annotations

from ..choices import Engine
from .base import EngineRules, GradientSizes

# megatron/core/distributed/distributed_data_parallel.py (core_v0.16.1): with --overlap-grad-reduce and no
# --ddp-bucket-size, `bucket_size = max(40000000, 1000000 * dp_group.size())` elements.
BUCKET_ELEMENTS = 40_000_000
BUCKET_ELEMENTS_PER_RANK = 1_000_000


def gradients(stage: int, sizes: GradientSizes) -> tuple[int, int]:
    """The whole gradient buffer, at both stages, in the reduce dtype: fp32 under --bf16, for which arguments.py
    sets `accumulate_allreduce_grads_in_fp32` (megatron-core's `grad_reduce_in_fp32`); fp16 under --fp16, which
    leaves it unset (DistributedDataParallel: `grad_dtype = torch.float if ddp_config.grad_reduce_in_fp32 else
    param.dtype`), the optimizer casting the gradients it steps to fp32 at the step (`states._step_temp`). The
    distributed optimizer reduce-scatters into its shard of the same buffer (param_and_grad_buffer.py), so the
    buffer stays whole; the 16-bit `param.grad` of each parameter is added into it and freed in backward (or never
    made, with gradient accumulation fusion), so nothing accumulates beside it."""
    return sizes.full * sizes.reduce_itemsize, 0


def bucket_elements(dp: int) -> int:
    return max(BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_RANK * dp)


RULES = EngineRules(
    engine=Engine.MEGATRON, runtime="megatron-core 0.16.1 (Megatron-LM core_v0.16.1)", stages=(0, 1),
    stage_rule="runs stage 0 (its DistributedDataParallel) or 1 (--use-distributed-optimizer)",
    # The distributed optimizer shards main parameters and moments; gradients are reduce-scattered into the
    # shard each rank steps (traffic), though the buffer itself stays whole (`gradients`).
    sharded_from=(None, 1, 1), per_tensor_dim_shards=False, reshard_stages=(),
    fp32_weights_when_mixed=False, fp32_grads_when_mixed=False, reduce_fp32_when_mixed=True,
    fp16_keeps_16bit_grads=True,
    compile_stages=(),  # Megatron-LM's training loop does not torch.compile the model
    # --optimizer-cpu-offload (HybridDeviceOptimizer: a share of the states on the host, `partial_offload`) needs
    # --use-precision-aware-optimizer (arguments.py validate_args), which needs the distributed optimizer
    # (optimizer_config.py); parameters are never offloaded.
    optimizer_offload_stages=(1,), param_offload_stages=(), hybrid_offload=True, host_optimizer="adamw_torch_fused",
    gradients=gradients, bucket_elements=bucket_elements,
    # Adam is Transformer Engine's or apex's FusedAdam (megatron/core/optimizer/__init__.py): multi-tensor kernels
    # over the whole group, no foreach temporaries.
    own_fused_optimizer=True,
    # Gradients are reduced once per step, in --overlap-grad-reduce's buckets during the last micro-batch's
    # backward (finalize_model_grads), and the distributed optimizer all-gathers updated parameters after it.
    reduces_once_per_step=True,
    # megatron-core 0.16.1 optimizer_config.py: "--use-precision-aware-optimizer only supported with distributed
    # optimizer" (and with Adam).
    bf16_state_optimizer_stages=(1,),
    # megatron-core's pipeline schedules run with either optimizer (schedules.py), receiving each stage input and
    # output gradient into a tensor made for that message (p2p_communication.py `_communicate`).
    pipeline_stages=(0, 1), megatron_schedules=True,
    # Megatron-LM's default --transformer-impl is transformer_engine (arguments.py, core_v0.16.1): its layers are
    # TE's modules (megatron/core/extensions/transformer_engine.py).
    transformer_engine=True,
    vocab_parallel_loss=True,
)
