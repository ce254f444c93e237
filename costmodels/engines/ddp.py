"""PyTorch DistributedDataParallel (torch 2.x): replicated states, one bucketed gradient all-reduce per step."""

from __future__ import annotations

from ..config import Engine
from .base import EngineRules

RULES = EngineRules(
    engine=Engine.DDP, runtime="torch DistributedDataParallel", stages=(0,),
    stage_rule="has no ZeRO stage; use deepspeed or fsdp2",
    sharded_from=(None, None, None), per_tensor_dim_shards=False, reshard_stages=(),
    # autocast keeps fp32 leaf weights and casts per use; their gradients are fp32 (torch.amp docs).
    fp32_weights_when_mixed=True, fp32_grads_when_mixed=True,
    compile_stages=(0,),  # DDPOptimizer splits compiled graphs at bucket boundaries (torch/_dynamo/backends)
    optimizer_offload_stages=(), param_offload_stages=(),
)
