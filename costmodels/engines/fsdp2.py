"""FSDP2 `fully_shard` (torch >= 2.6): every state sharded per tensor on one dim at both settings;
`reshard_after_forward` is fitplan's ZeRO-3 (True) or ZeRO-2 (False)."""

from __future__ import annotations

from ..choices import Engine
from .base import Buffers, EngineRules, GradientSizes, UnitBytes


def gradients(stage: int, sizes: GradientSizes) -> tuple[int, int]:
    """Sharded gradients in the reduce dtype (fp32 under mixed precision: MixedPrecisionPolicy reduce_dtype). None
    exists when a step's backward starts (the step's `zero_grad(set_to_none=True)` freed them): each unit's
    appear as its reduce-scatter lands (`grads_land_sharded`), and later micro-batches accumulate into them."""
    return 0, sizes.partition * sizes.reduce_itemsize


def buffers(stage: int, units: UnitBytes) -> Buffers:
    """Each unit gathers its parameters and prefetches the next unit's (implicit prefetching); with
    reshard_after_forward (stage 3) it frees them after forward and gathers again in backward, otherwise they
    stay gathered from its forward to its backward; backward holds the unit's unsharded gradients."""
    gathered, result = units.gathered, []
    for i, (own, grads) in enumerate(zip(gathered, units.grads, strict=True)):
        after = gathered[i + 1] if i + 1 < len(gathered) else 0
        before = gathered[i - 1] if i > 0 else 0
        result.append((own + after, 0, own + before + grads) if stage == 3 else (own + after, own, grads))
    return result


RULES = EngineRules(
    engine=Engine.FSDP2, runtime="torch FSDP2", stages=(2, 3), stage_rule="shards like ZeRO-2 or ZeRO-3; use 2 or 3",
    sharded_from=(2, 2, 2), per_tensor_dim_shards=True, reshard_stages=(3,),
    # MixedPrecisionPolicy(param_dtype=bf16) keeps fp32 sharded parameters and casts the gathered copy; the
    # unsharded gradients come out in param_dtype and are reduced in reduce_dtype=fp32 (torch FSDP2 docs).
    fp32_weights_when_mixed=True, fp32_grads_when_mixed=False, reduce_fp32_when_mixed=True,
    compile_stages=(2, 3),  # per-layer fully_shard + compile is torchtitan's default stack
    # CPUOffloadPolicy offloads sharded parameters, gradients and optimizer states together; fitplan runs it
    # with reshard_after_forward=True (ZeRO-3), as torchtitan's training.enable_cpu_offload does.
    optimizer_offload_stages=(3,), param_offload_stages=(3,), offload_moves_all_states=True,
    host_optimizer="adamw_torch", gradients=gradients, buffers=buffers,
    # FSDP2 reduce-scatters a unit's gradients before its post-accumulate-grad hooks run (torchtune's
    # optimizer-in-backward steps on the sharded, reduced gradient).
    reduces_before_grad_hooks=True, grads_land_sharded=True,
    # bitsandbytes 0.50's optimizers on FSDP2's DTensor parameters: "optimizer_update_8bit_blockwise got mixed
    # torch.Tensor and DTensor" (8-bit, paged 8-bit), "optimizer_update_32bit does not have a sharding strategy
    # registered" (paged 32-bit): tests/costmodels/test_engine_rules.py runs them.
    bnb_optimizers=False,
    # torchtitan 0.3.0 keeps FSDP2 parameters gathered through forward and backward under PP
    # (fsdp_reshard_after_forward "default" = False with pipeline parallelism: parallelize.py).
    pipeline_stages=(2,),
    # torch 2.13 torch/distributed/pipelining/stage.py: every micro-batch's backward runs with
    # set_requires_gradient_sync(False) and set_reshard_after_backward(False) (`backward_maybe_with_nosync`), and
    # the schedule's REDUCE_GRAD action (`perform_reduce_grad`, after the last backward) runs each param group's
    # post_backward: one reduce-scatter per step; the parameters stay gathered from the first forward until then.
    syncs_once_when_pipelined=True,
    # torch 2.13 fsdp/_fully_shard/_fully_shard.py: "mesh: ... If a 2D mesh, then the parameters are sharded across
    # the 1st dim and replicated across the 0th dim" (HSDP), the reduce-scatter then an all-reduce across replicas.
    hybrid_shards=True,
)
