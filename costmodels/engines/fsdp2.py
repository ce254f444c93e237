"""FSDP2 `fully_shard` (torch >= 2.6): every state sharded per tensor on one dim at both settings;
`reshard_after_forward` is fitplan's ZeRO-3 (True) or ZeRO-2 (False)."""

from __future__ import annotations

from ..config import Engine
from .base import EngineRules

RULES = EngineRules(
    engine=Engine.FSDP2, runtime="torch FSDP2", stages=(2, 3), stage_rule="shards like ZeRO-2 or ZeRO-3; use 2 or 3",
    sharded_from=(2, 2, 2), per_tensor_dim_shards=True, reshard_stages=(3,),
    # MixedPrecisionPolicy(param_dtype=bf16) keeps fp32 sharded parameters and casts the gathered copy; the
    # unsharded gradients come out in param_dtype and are reduced in reduce_dtype (torch FSDP2 docs).
    fp32_weights_when_mixed=True, fp32_grads_when_mixed=False,
    compile_stages=(2, 3),  # per-layer fully_shard + compile is torchtitan's default stack
    # CPUOffloadPolicy offloads sharded parameters, gradients and optimizer states together; fitplan runs it
    # with reshard_after_forward=True (ZeRO-3), as torchtitan's training.enable_cpu_offload does.
    optimizer_offload_stages=(3,), param_offload_stages=(3,), offload_moves_all_states=True,
    host_optimizer="adamw_torch",
)
