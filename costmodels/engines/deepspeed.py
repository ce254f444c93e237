"""DeepSpeed ZeRO stages 0-3 (DeepSpeed 0.19; Rajbhandari et al. 2020): stage 1 shards optimizer states, 2 also
gradients, 3 also parameters, each as a flat partition; a 16-bit model with an fp32 master copy in the optimizer."""

from __future__ import annotations

from ..config import Engine
from .base import EngineRules

RULES = EngineRules(
    engine=Engine.DEEPSPEED, runtime="DeepSpeed 0.19", stages=(0, 1, 2, 3), stage_rule="runs ZeRO stages 0-3",
    sharded_from=(3, 2, 1), per_tensor_dim_shards=False, reshard_stages=(3,),
    fp32_weights_when_mixed=False, fp32_grads_when_mixed=False,
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
)
